"""Ranks that provably share one timeline, so the replay runs one of each.

Pure: no torch. Two ranks evolve identically in the replay when they run the same
ops at the same costs and every peer they wait on evolves identically too. That is
the coarsest *equitable partition* of the ranks, found by colour refinement:

1. start: colour = (class, pp stage, link class of each group the rank uses, link
   class to each pipeline peer) -- everything that sets the rank's own costs;
2. refine: add, for each kind, the set of colours in the rank's group and the
   colour of each pipeline peer; repeat until the number of colours stops growing.

At the fixed point, every rank of colour ``c`` has groups holding the same colour
sets and peers of the same colours, so the replay's max-plus equations for all ranks
of ``c`` are the same equations: one representative per colour solves them all,
exactly. A uniform job (TP8 PP8 DP128 on 8-GPU nodes) has one colour per stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Sequence, Tuple

from pitstop.emulation.graph import Comm, ExecutionGraph
from pitstop.emulation.topology import Topology


@dataclass(frozen=True)
class Partition:
    """``color_of[rank]`` is the node (colour) of each rank; ``reps[node]`` its representative."""

    color_of: Tuple[int, ...]
    reps: Tuple[int, ...]
    rounds: int = 0
    """Refinement rounds it took (0 for the trivial partition)."""

    @property
    def n_nodes(self) -> int:
        return len(self.reps)


def trivial_partition(world_size: int) -> Partition:
    """Every rank its own node: the replay then simulates the whole world."""
    return Partition(tuple(range(world_size)), tuple(range(world_size)))


def used_kinds(graph: ExecutionGraph) -> Tuple[List[str], List[int]]:
    """The collective kinds and the pipeline offsets that some class uses."""
    kinds, offsets = set(), set()
    for program in graph.programs.values():
        for it in program:
            for op in it:
                if isinstance(op, Comm):
                    if op.is_p2p:
                        offsets.add(op.peer)
                    else:
                        kinds.add(op.group_kind)
    return sorted(kinds), sorted(offsets)


def _intern(keys: Sequence[Hashable]) -> Tuple[List[int], int]:
    """Number the distinct keys in order of first appearance."""
    ids: Dict[Hashable, int] = {}
    out = [ids.setdefault(k, len(ids)) for k in keys]
    return out, len(ids)


def pipeline_peers(graph: ExecutionGraph, offsets: Sequence[int]) -> Dict[int, List[int]]:
    """For each offset, the peer of every rank (``graph.peer`` for the whole world at once)."""
    pp = graph.layout.pp
    table = graph.group_table("pp")
    world = graph.world_size
    out = {}
    for o in offsets:
        peers = [0] * world
        for g in table.groups:
            for s, r in enumerate(g):
                peers[r] = g[(s + o) % pp]
        out[o] = peers
    return out


def partition(graph: ExecutionGraph, topology: Topology) -> Partition:
    """The coarsest equitable partition of the ranks (see the module docstring)."""
    world = graph.world_size
    kinds, offsets = used_kinds(graph)
    tables = [graph.group_table(k) for k in kinds]
    peers = pipeline_peers(graph, offsets)
    classes = graph.classes()
    stages = graph.stages()

    def link_key(link) -> Tuple[float, float]:
        return (link.alpha_s, link.bandwidth_bytes_per_s)

    group_links = [[link_key(topology.group_link(g)) for g in t.groups] for t in tables]
    start = []
    for r in range(world):
        groups = tuple(group_links[ki][t.index[r]] if t.index[r] >= 0 else None
                       for ki, t in enumerate(tables))
        p2p = tuple(link_key(topology.link_class(r, peers[o][r])) for o in offsets)
        start.append((classes[r], stages[r], groups, p2p))
    colors, n = _intern(start)
    rounds = 0
    while True:
        rounds += 1
        group_sets = []
        for t in tables:
            sets, _ = _intern([frozenset(colors[m] for m in g) for g in t.groups])
            group_sets.append(sets)
        keys = []
        for r in range(world):
            keys.append((
                colors[r],
                tuple(group_sets[ki][t.index[r]] if t.index[r] >= 0 else -1 for ki, t in enumerate(tables)),
                tuple(colors[peers[o][r]] for o in offsets),
            ))
        new, m = _intern(keys)
        if m == n:
            break
        colors, n = new, m
    reps = [-1] * n
    for r in range(world):
        if reps[colors[r]] < 0:
            reps[colors[r]] = r
    return Partition(tuple(colors), tuple(reps), rounds)
