"""Trace a real rank's iterations, and pace its virtual collectives to a replay.

Both wrap the oracle that answers the rank's virtual groups (see
:mod:`pitstop.virtual`), so they see every operation at the moment it
is issued, whichever library issued it::

    real rank      fwd ... | allreduce tp | ... bwd ... | send pp+1 | ... optimizer | boundary
    TracingOracle  Compute(t1)  Comm(all_reduce, tp, 4 KiB)  Compute(t2)  Comm(send, pp, +1) ...
    PacingOracle   the allreduce returns at its replayed end time, not at once

A compute segment is the time from the end of one operation to the issue of the
next (or to the iteration boundary). World-group operations (set-up barriers) are
counted but left out of the graph: the graph holds layout kinds only.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple


from pitstop.emulation.graph import Comm, Compute, Op, RoleClass, Trace, stage_kind
from pitstop.virtual import tensors_of
from pitstop.errors import EmulationError

#: ProcessGroup method -> the execution graph's op name.
OPS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "reduce": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather", "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "gather": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "scatter": "broadcast",
    "all_gather_single": "all_gather", "all_gather_single_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_single_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
    "barrier": "barrier", "monitored_barrier": "barrier", "send": "send", "recv": "recv",
    "recv_anysource": "recv",
}
#: Operations whose full buffer is the input (the second argument), not the output.
_INPUT_SIZED = ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_single",
                "reduce_scatter_single_coalesced", "alltoall", "alltoall_base")


def nbytes_of(what: str, args: tuple) -> int:
    """The op's full buffer in bytes, as the execution graph counts it."""
    if what in ("barrier", "monitored_barrier"):
        return 0
    ts = tensors_of(args[1:2]) if what in _INPUT_SIZED and len(args) > 1 else tensors_of(args)
    return int(sum(t.numel() * t.element_size() for t in ts))


def peer_offset(group, what: str, args: tuple) -> int:
    """A send/recv's peer as a stage offset in the pp group (+1 next, -1 previous)."""
    peer = int(args[1])
    n, me = group.size(), group.rank()
    off = (peer - me) % n
    if 2 * off == n:  # both ways round reach the same stage (pp 2): a send goes forward, a recv comes from behind
        return off if what == "send" else -off
    return off - n if off > n // 2 else off


class TracingOracle:
    """Answers through ``inner`` and writes down the timeline of each iteration."""

    def __init__(self, inner, role: int, pp_rank: int, pp: int) -> None:
        self.inner = inner
        self.role = role
        self.role_class = RoleClass(stage_kind(pp_rank, pp), pp_rank)
        self.iterations: List[Tuple[Op, ...]] = []
        self.world_ops = 0
        self._ops: List[Op] = []
        self._last = time.perf_counter()
        self.active = True
        self.measured: List[List[Tuple[str, int, int, float]]] = []
        """Per iteration: (op, group size, bytes, seconds from issue to return) of each
        collective; with every member real these are the machine's own costs, which
        :func:`pitstop.emulation.calibrate.fit_link` turns into a link class."""
        self._measured: List[Tuple[str, int, int, float]] = []

    def serve(self, group, what: str, args: tuple) -> None:
        t_issue = time.perf_counter()
        self.inner.serve(group, what, args)
        if not self.active:
            return
        if group.kind == "world":
            self.world_ops += 1
            return
        op = OPS.get(what)
        if op is None:
            raise EmulationError(f"{what} on {group.kind} group (size {group.size()}): no execution-graph op for it")
        self._ops.append(Compute(max(0.0, t_issue - self._last)))
        peer = peer_offset(group, what, args) if op in ("send", "recv") else 0
        nbytes = nbytes_of(what, args)
        self._ops.append(Comm(op, "pp" if op in ("send", "recv") else group.kind, nbytes, peer))
        self._last = time.perf_counter()
        self._measured.append((op, group.size(), nbytes, self._last - t_issue))

    def boundary(self) -> None:
        """End of an iteration: close its last compute segment."""
        now = time.perf_counter()
        self._ops.append(Compute(max(0.0, now - self._last)))
        self.iterations.append(tuple(self._ops))
        self.measured.append(self._measured)
        self._ops, self._measured = [], []
        self._last = now

    def trace(self, skip: int = 1, source: str = "") -> Trace:
        """The traced iterations after the first ``skip`` (the first one pays lazy set-up)."""
        its = self.iterations[skip:] or self.iterations
        if not its:
            raise EmulationError(f"rank {self.role}: no iteration was traced")
        return Trace(self.role, self.role_class, tuple(its), source)


class PacingOracle:
    """Makes each operation of a real rank return at its replayed end time.

    ``schedule[i]`` lists, for replayed iteration ``i``, the end time of each of the
    rank's comm operations relative to the iteration's start. The first ``skip`` real
    iterations (set-up and lazy initialisation, which the trace left out too) run
    unpaced; after them, real iteration ``k`` follows ``schedule[(k - skip) % len]``.
    Compute stays real; so the real rank's wall clock shows the target-scale job's
    waits and pipeline bubbles.
    """

    def __init__(self, inner, schedule: Sequence[Sequence[float]], skip: int = 1) -> None:
        if not schedule or not all(len(s) for s in schedule):
            raise EmulationError("pacing needs a replayed schedule with at least one operation per iteration")
        self.inner = inner
        self.schedule = [list(s) for s in schedule]
        self.skip = skip
        self.iteration = 0
        self.index = 0
        self.t0 = time.perf_counter()
        self.slept_s = 0.0
        self.late: int = 0
        """Operations that came later than their replayed end (the real compute was slower)."""
        self.late_s = 0.0
        """How late they came, in total: what the paced step owes the emulator, not the model."""
        self.overrun: Optional[str] = None
        """Why pacing gave up on an iteration (the last time it did)."""
        self._off = False

    def serve(self, group, what: str, args: tuple) -> None:
        self.inner.serve(group, what, args)
        if group.kind == "world" or self.iteration < self.skip or self._off:
            return
        ends = self.schedule[(self.iteration - self.skip) % len(self.schedule)]
        if self.index >= len(ends):
            self.overrun = f"iteration {self.iteration + 1} issues more than the {len(ends)} replayed operations"
            self._off = True  # for the rest of this iteration
            return
        wait = self.t0 + ends[self.index] - time.perf_counter()
        self.index += 1
        if wait > 0:
            time.sleep(wait)
            self.slept_s += wait
        else:
            self.late += 1
            self.late_s -= wait

    def boundary(self) -> None:
        self.iteration += 1
        self.index = 0
        self._off = False
        self.t0 = time.perf_counter()


def schedule_of(result, rank: int) -> List[List[float]]:
    """A rank's comm-operation end times per replayed iteration, relative to its start."""
    out: List[List[float]] = []
    start = 0.0
    cur: Dict[int, List[float]] = {}
    for t in result.timeline(rank):
        if isinstance(t.op, Comm):
            cur.setdefault(t.iteration, []).append(t.end)
    ends = result.iteration_ends(rank)
    for i in range(len(ends)):
        out.append([e - start for e in cur.get(i, [])])
        start = ends[i]
    return out

