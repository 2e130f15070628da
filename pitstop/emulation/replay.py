"""Discrete-event replay of an execution graph under a network model.

Pure: no torch, no torch.distributed. Each rank runs its ops back to back, one at a
time (no compute/communication overlap is modelled):

* ``Compute`` takes its duration.
* A collective on group G completes for every member at ``max(arrival of all
  members) + cost(op, nbytes, G)``; a member's ``wait`` is ``max arrival - its
  arrival`` (counted as ``comm_wait``), the rest is transfer (``comm``).
* ``send`` is eager: it completes when posted (start == end), and the message
  reaches the peer ``p2p cost`` later. Link contention is not modelled.
* ``recv`` completes at ``max(recv posted, send posted + p2p cost)``; its ``wait``
  is the time until the peer stage posted its send (``bubble``), the rest is
  transfer (``comm``).

Per rank, iteration ``i`` lasts from the end of iteration ``i-1`` (0 for the first)
to the end of its last op, and splits exactly into
``compute + comm + comm_wait + bubble``.

Symmetry: ranks that provably share a timeline (:mod:`pitstop.emulation.symmetry`)
are replayed once; every rank reads its representative's timings. The result is
exact for the whole world, and memory is O(distinct timelines * ops + world).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Tuple

from pitstop.errors import ReplayError
from pitstop.emulation.graph import Compute, ExecutionGraph, Op, RoleClass
from pitstop.emulation.symmetry import Partition, partition, pipeline_peers, trivial_partition, used_kinds
from pitstop.emulation.topology import Topology, collective_cost, p2p_cost


@dataclass(frozen=True)
class OpTiming:
    """One op of one rank in the replay: seconds from the start of the run."""

    iteration: int
    index: int
    op: Op
    start: float
    end: float
    wait: float
    """Time blocked on peers: collective arrival skew, or a recv posted before its send."""


@dataclass
class ReplayResult:
    """Timings of every rank (stored once per distinct timeline)."""

    graph: ExecutionGraph
    topology: Topology
    partition: Partition
    starts: List[List[float]]
    ends: List[List[float]]
    waits: List[List[float]]
    ops: Dict[RoleClass, List[Op]]
    """Per class, its ops of all iterations in one list (the index of the timings)."""
    bounds: Dict[RoleClass, Tuple[int, ...]]
    """Per class, the flat op index where each iteration starts, plus the total."""
    wall_s: float = 0.0
    """Seconds the replay itself took."""

    def node_of(self, rank: int) -> int:
        self.graph.layout._check_rank(rank)
        return self.partition.color_of[rank]

    def _flat(self, rank: int) -> Tuple[List[Op], Tuple[int, ...], int]:
        cls = self.graph.class_of(rank)
        return self.ops[cls], self.bounds[cls], self.node_of(rank)

    def timeline(self, rank: int) -> List[OpTiming]:
        """Every op of ``rank`` with its start, end and wait."""
        ops, bounds, n = self._flat(rank)
        out = []
        for it in range(len(bounds) - 1):
            for j in range(bounds[it], bounds[it + 1]):
                out.append(OpTiming(it, j - bounds[it], ops[j], self.starts[n][j], self.ends[n][j], self.waits[n][j]))
        return out

    def iteration_ends(self, rank: int) -> List[float]:
        """When each iteration of ``rank`` ends."""
        _, bounds, n = self._flat(rank)
        return [self.ends[n][b - 1] for b in bounds[1:]]

    def iteration_times(self, rank: int) -> List[float]:
        """Duration of each iteration of ``rank``."""
        ends = self.iteration_ends(rank)
        return [e - s for s, e in zip([0.0] + ends[:-1], ends)]

    def breakdown(self, rank: int, iteration: int = -1) -> Dict[str, float]:
        """``{total, compute, comm, comm_wait, bubble}`` of one iteration of ``rank``."""
        ops, bounds, n = self._flat(rank)
        n_it = len(bounds) - 1
        if not -n_it <= iteration < n_it:
            raise ReplayError(f"iteration({iteration}) out of range for {n_it} iteration(s)")
        it = iteration % n_it
        out = {"total": self.iteration_times(rank)[it], "compute": 0.0, "comm": 0.0,
               "comm_wait": 0.0, "bubble": 0.0}
        s, e, w = self.starts[n], self.ends[n], self.waits[n]
        for j in range(bounds[it], bounds[it + 1]):
            op = ops[j]
            if isinstance(op, Compute):
                out["compute"] += e[j] - s[j]
            else:
                out["comm"] += e[j] - s[j] - w[j]
                out["bubble" if op.is_p2p else "comm_wait"] += w[j]
        return out

    def summary(self) -> Dict[str, object]:
        """Per iteration the slowest rank's time, per class its ranks' times; JSON-ready."""
        per_class: Dict[str, List[float]] = {}
        slowest: List[float] = []
        for n, rep in enumerate(self.partition.reps):
            times = self.iteration_times(rep)
            key = str(self.graph.class_of(rep))
            prev = per_class.get(key)
            per_class[key] = times if prev is None else [max(a, b) for a, b in zip(prev, times)]
            slowest = times if not slowest else [max(a, b) for a, b in zip(slowest, times)]
        return {
            "world_size": self.graph.world_size,
            "layout": self.graph.layout.describe(),
            "topology": self.topology.name,
            "distinct_timelines": self.partition.n_nodes,
            "iteration_time_s": slowest,
            "iteration_time_s_by_class": per_class,
            "replay_wall_s": self.wall_s,
        }


def replay(graph: ExecutionGraph, topology: Topology, symmetry: bool = True) -> ReplayResult:
    """Replay ``graph`` on ``topology``; ``symmetry=False`` simulates every rank on its own."""
    t0 = time.perf_counter()
    part = partition(graph, topology) if symmetry else trivial_partition(graph.world_size)
    result = _run(graph, topology, part)
    result.wall_s = time.perf_counter() - t0
    return result


def _run(graph: ExecutionGraph, topology: Topology, part: Partition) -> ReplayResult:
    color_of, reps = part.color_of, part.reps
    n_nodes = len(reps)
    kinds, offsets = used_kinds(graph)
    tables = {k: graph.group_table(k) for k in kinds}
    peers = pipeline_peers(graph, offsets)

    flat: Dict[RoleClass, List[Op]] = {}
    bounds: Dict[RoleClass, Tuple[int, ...]] = {}
    for cls, program in graph.programs.items():
        flat[cls] = [op for it in program for op in it]
        b = [0]
        for it in program:
            b.append(b[-1] + len(it))
        bounds[cls] = tuple(b)

    # Per (kind, group): the instance id (the set of nodes in it) and its link, once.
    set_ids: Dict[frozenset, int] = {}
    group_info: Dict[Tuple[str, int], Tuple[int, int, object, Tuple[int, ...]]] = {}

    def info(node: int, kind: str) -> Tuple[int, int, object, Tuple[int, ...]]:
        t = tables[kind]
        gi = t.index[reps[node]]
        if gi < 0:
            raise ReplayError(f"rank {reps[node]} has a collective on {kind!r} but no {kind!r} group")
        key = (kind, gi)
        got = group_info.get(key)
        if got is None:
            g = t.groups[gi]
            members = frozenset(color_of[r] for r in g)
            sid = set_ids.setdefault(members, len(set_ids))
            got = group_info[key] = (sid, len(members), topology.group_link(g), g)
        return got

    node_ops = [flat[graph.class_of(r)] for r in reps]
    starts = [[0.0] * len(ops) for ops in node_ops]
    ends = [[0.0] * len(ops) for ops in node_ops]
    waits = [[0.0] * len(ops) for ops in node_ops]
    pc = [0] * n_nodes
    clock = [0.0] * n_nodes
    counts: List[Dict[str, int]] = [{} for _ in range(n_nodes)]
    infos: List[Dict[str, Tuple]] = [{} for _ in range(n_nodes)]
    # instance key -> [remaining, max arrival, op, nbytes, cost, first node, waiters]
    instances: Dict[Tuple, list] = {}
    sends: Dict[Tuple[int, int], List[Tuple[float, int, float]]] = {}
    taken: Dict[Tuple[int, int], int] = {}
    blocked_recv: Dict[Tuple[int, int], int] = {}
    p2p_links: Dict[Tuple[int, int], object] = {}
    ready = deque(range(n_nodes))

    while ready:
        n = ready.popleft()
        ops = node_ops[n]
        s_, e_, w_ = starts[n], ends[n], waits[n]
        i, t = pc[n], clock[n]
        n_ops = len(ops)
        while i < n_ops:
            op = ops[i]
            if type(op) is Compute:
                s_[i] = t
                t += op.duration_s
                e_[i] = t
                i += 1
                continue
            name = op.op
            if name == "send":
                rep = reps[n]
                dst_rank = peers[op.peer][rep]
                dst = color_of[dst_rank]
                link = p2p_links.get((rep, op.peer))
                if link is None:
                    link = p2p_links[(rep, op.peer)] = topology.link_class(rep, dst_rank)
                key = (n, dst)
                sends.setdefault(key, []).append((t, op.nbytes, p2p_cost(op.nbytes, link)))
                s_[i] = e_[i] = t
                if blocked_recv.get(key) == dst:
                    del blocked_recv[key]
                    ready.append(dst)
                i += 1
            elif name == "recv":
                src = color_of[peers[op.peer][reps[n]]]
                key = (src, n)
                queue = sends.get(key)
                k = taken.get(key, 0)
                if queue is None or k >= len(queue):
                    blocked_recv[key] = n
                    break
                posted, nbytes, cost = queue[k]
                if nbytes != op.nbytes:
                    raise ReplayError(
                        f"rank {reps[n]} op {i} recv of {op.nbytes} bytes matches a send of {nbytes} "
                        f"bytes from rank {reps[src]} (message {k} on that channel)"
                    )
                taken[key] = k + 1
                s_[i] = t
                w_[i] = posted - t if posted > t else 0.0
                arrive = posted + cost
                if arrive > t:
                    t = arrive
                e_[i] = t
                i += 1
            else:
                kind = op.group_kind
                got = infos[n].get(kind)
                if got is None:
                    got = infos[n][kind] = info(n, kind)
                sid, size, link, g = got
                cnt = counts[n]
                k = cnt.get(kind, 0)
                cnt[kind] = k + 1
                key = (kind, sid, k)
                inst = instances.get(key)
                if inst is None:
                    inst = [size, t, name, op.nbytes, collective_cost(name, len(g), op.nbytes, link), n, []]
                    instances[key] = inst
                elif inst[2] != name or inst[3] != op.nbytes:
                    raise ReplayError(
                        f"{kind} collective {k}: rank {reps[n]} issues {name} of {op.nbytes} bytes "
                        f"but rank {reps[inst[5]]} issued {inst[2]} of {inst[3]} bytes"
                    )
                elif t > inst[1]:
                    inst[1] = t
                inst[0] -= 1
                if inst[0] > 0:
                    inst[6].append((n, i, t))
                    break
                del instances[key]
                latest = inst[1]
                done = latest + inst[4]
                for m, j, arrived in inst[6]:
                    starts[m][j] = arrived
                    ends[m][j] = done
                    waits[m][j] = latest - arrived
                    pc[m] = j + 1
                    clock[m] = done
                    ready.append(m)
                s_[i] = t
                w_[i] = latest - t
                t = done
                e_[i] = t
                i += 1
        # Blocked (or done): a recv resumes when its send is posted; a collective is
        # moved on by the last member to arrive.
        pc[n], clock[n] = i, t

    stuck = [n for n in range(n_nodes) if pc[n] < len(node_ops[n])]
    if stuck:
        lines = []
        for n in stuck[:5]:
            op = node_ops[n][pc[n]]
            lines.append(f"rank {reps[n]} ({graph.class_of(reps[n])}) at op {pc[n]}: {op}")
        raise ReplayError(
            f"deadlock: {len(stuck)} distinct timeline(s) wait forever, e.g. " + "; ".join(lines)
        )
    return ReplayResult(graph, topology, part, starts, ends, waits, flat, bounds)
