"""Record a real rank's collective results, and replay them to a sandboxed rank.

A standby warms up by running a real training iteration of a role before it has
one. Its collectives cannot reach anybody, so they are answered from a *record*:
at job start one rank of each role class writes down, in order, the result of
every operation its groups performed during its first iteration(s)::

    real rank 2 (middle stage), iteration 1         standby, sandboxed as rank 2
    pp    recv  [2,32,64] f32  -> values  ------->  recv served from the record
    tp    allreduce [1] f32    -> values  ------->  same grad norm, same clip branch
    dp    _reduce_scatter_base ...        ------->  ...
    pp    send  [2,32,64] f32  (no data)  ------->  completes locally

Replaying real values (not zeros) keeps loss scaling, gradient clipping and NaN
checks on the path a real step takes. Each entry keeps the op name, shapes and
dtypes, so a record of another model is refused (:class:`RecordMismatchError`)
instead of silently producing a different step.

A replayed result proves nothing about the sandbox: it is the recorder's value
whatever the sandbox computed. So each entry also keeps the recorder's *local
inputs*, captured as the operation was issued (an all-reduce's tensor before the
reduction, an all-gather's or reduce-scatter's input, a send's payload), and the
replay compares the sandbox's own local inputs with them, bit for bit. That is
evidence the sandboxed iteration computed what the real one did::

    recorder  allreduce  local [0.25, 1.5]  -> result [0.5, 3.0]
    sandbox   allreduce  local [0.25, 1.5]  == recorded local?  (counted, first difference named)
                         result <- [0.5, 3.0] from the record

The world group's operations are shown to the recorder only once complete, so theirs
are not compared; neither is a broadcast's (a non-root's buffer holds anything).

Role classes: a pipeline stage kind (``first``, ``middle``, ``last``; ``only`` when
pp=1). TP, CP, DP and EP ranks of one stage kind issue the same operations on the
same shapes, so one recorder per kind is enough: the rank of that stage with every
other coordinate 0 (for ``middle``, pipeline stage 1).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from pitstop import pg as pgmod
from pitstop.virtual import tensors_of
from pitstop.errors import RecordMismatchError
from pitstop.layout import ParallelLayout

log = logging.getLogger(__name__)

FORMAT = 2
_NO_DATA = ("send", "barrier", "monitored_barrier")


def _flat(x) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _flat(y)]
    return []


def local_inputs(what: str, args: tuple) -> Optional[List[torch.Tensor]]:
    """The tensors that hold this rank's own contribution to an operation as it is issued,
    or None where there is none to compare (a recv, a barrier, a broadcast)."""
    if not args:
        return None
    if what in ("allreduce", "allreduce_coalesced", "reduce", "send"):
        return _flat(args[0])
    if what in ("allgather", "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
                "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                "all_gather_single", "reduce_scatter_single", "all_gather_single_coalesced",
                "reduce_scatter_single_coalesced", "alltoall", "alltoall_base") and len(args) > 1:
        return _flat(args[1])
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN equals the same NaN; 0.0 differs from -0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


# --------------------------------------------------------------------------- role classes
def stage_class(layout: ParallelLayout, rank: int) -> str:
    """The role class of ``rank``: its pipeline stage kind."""
    if layout.pp == 1:
        return "only"
    stage = layout.coords(rank)["pp"]
    return "first" if stage == 0 else "last" if stage == layout.pp - 1 else "middle"


def stage_classes(layout: ParallelLayout) -> List[str]:
    """The role classes of a layout, in the order a standby warms them up."""
    if layout.pp == 1:
        return ["only"]
    return ["first"] + (["middle"] if layout.pp >= 3 else []) + ["last"]


def representative(layout: ParallelLayout, cls: str) -> int:
    """The rank that records class ``cls``: its stage, every other coordinate 0."""
    stage = {"only": 0, "first": 0, "middle": 1, "last": layout.pp - 1}[cls]
    return layout.rank(pp=stage)


def recorder_class(layout: ParallelLayout, rank: int) -> Optional[str]:
    """The class ``rank`` records, or None when it records nothing."""
    cls = stage_class(layout, rank)
    return cls if representative(layout, cls) == rank else None


# --------------------------------------------------------------------------- the record
@dataclass
class Entry:
    """One operation: what was issued, and what it produced."""

    op: str
    shapes: List[Tuple[int, ...]]
    dtypes: List[str]
    data: List[torch.Tensor] = field(default_factory=list)
    local: Optional[List[torch.Tensor]] = None
    """The recorder's own inputs as the operation was issued (see the module docstring)."""

    def describe(self) -> str:
        return f"{self.op} {[list(s) for s in self.shapes]} {sorted(set(self.dtypes))}"


@dataclass
class Record:
    """The operations of one role class's first iteration(s), per group kind, in order."""

    cls: str
    role: int
    layout: str
    world_size: int
    entries: Dict[str, List[Entry]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of recorded values."""
        return sum(t.numel() * t.element_size() for es in self.entries.values() for e in es for t in e.data)

    @property
    def count(self) -> int:
        return sum(len(es) for es in self.entries.values())

    def save(self, path: Path) -> int:
        """Write atomically; returns the file's size in bytes."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({
            "format": FORMAT, "cls": self.cls, "role": self.role, "layout": self.layout, "world_size": self.world_size,
            "entries": {k: [(e.op, e.shapes, e.dtypes, e.data, e.local) for e in es] for k, es in self.entries.items()},
        }, tmp)
        os.replace(tmp, path)
        return path.stat().st_size

    @classmethod
    def load(cls, path: Path) -> "Record":
        raw = torch.load(Path(path), weights_only=True)
        if raw.get("format") != FORMAT:
            raise RecordMismatchError(f"record {path}: format {raw.get('format')!r}, this pitstop reads format {FORMAT}")
        rec = cls(raw["cls"], raw["role"], raw["layout"], raw["world_size"])
        rec.entries = {k: [Entry(op, [tuple(s) for s in shapes], list(dtypes), list(data),
                                 None if local is None else list(local))
                           for op, shapes, dtypes, data, local in es]
                       for k, es in raw["entries"].items()}
        return rec


def _signature(what: str, args: tuple) -> Tuple[List[Tuple[int, ...]], List[str], List[torch.Tensor]]:
    ts = tensors_of(args)
    return [tuple(t.shape) for t in ts], [str(t.dtype).replace("torch.", "") for t in ts], ts


# --------------------------------------------------------------------------- recording
class Recorder:
    """Captures every operation of this process's groups while active (via :data:`pitstop.pg.TAP`)."""

    def __init__(self, layout: ParallelLayout, rank: int, cls: str) -> None:
        self.record = Record(cls, rank, layout.describe(), layout.world_size)
        self.started = time.perf_counter()

    def start(self) -> "Recorder":
        if pgmod.TAP is not None:
            raise RecordMismatchError("another recorder is already active in this process")
        pgmod.TAP = self._tap
        return self

    def stop(self) -> Record:
        if pgmod.TAP == self._tap:
            pgmod.TAP = None
        return self.record

    def _tap(self, kind: str, what: str, args: tuple) -> Optional[Callable[[], None]]:
        shapes, dtypes, ts = _signature(what, args)
        entry = Entry(what, shapes, dtypes)
        self.record.entries.setdefault(kind, []).append(entry)
        mine = local_inputs(what, args) if kind != "world" else None  # the world's tap comes after the op
        if mine is not None:
            entry.local = [t.detach().to("cpu", copy=True) for t in mine]
        if what in _NO_DATA:
            return None

        def capture() -> None:  # after the operation completed: its outputs hold the result
            entry.data = [t.detach().to("cpu", copy=True) for t in ts]

        return capture


# --------------------------------------------------------------------------- replay
class ReplayOracle:
    """Serves virtual groups from a :class:`Record`, checking every operation against it."""

    def __init__(self, record: Record) -> None:
        self.record = record
        self.cursor: Dict[str, int] = {}
        self.local_checked = 0
        """Operations whose local inputs were compared with the recorder's."""
        self.local_equal = 0
        self.local_mismatch = ""
        """The first operation whose local inputs differ, described."""

    @property
    def served(self) -> int:
        return sum(self.cursor.values())

    def serve(self, group, what: str, args: tuple) -> None:
        kind = group.kind
        i = self.cursor.get(kind, 0)
        entries = self.record.entries.get(kind, [])
        shapes, dtypes, ts = _signature(what, args)
        mine = Entry(what, shapes, dtypes)
        where = f"record of class {self.record.cls!r} (rank {self.record.role}, {self.record.layout})"
        if i >= len(entries):
            raise RecordMismatchError(
                f"{kind} operation #{i + 1} ({mine.describe()}): the {where} holds only {len(entries)} "
                f"operation(s) of kind {kind!r}; this process's step differs from the recorded one"
            )
        e = entries[i]
        if e.op != what or e.shapes != shapes or e.dtypes != dtypes:
            raise RecordMismatchError(
                f"{kind} operation #{i + 1}: the {where} has {e.describe()}, this process issues "
                f"{mine.describe()}; the model or layout changed since the record was made"
            )
        self.cursor[kind] = i + 1
        if e.local is not None:
            self._compare_local(kind, i, e, local_inputs(what, args))
        if what in _NO_DATA:
            return
        if len(e.data) != len(ts):
            raise RecordMismatchError(f"{kind} operation #{i + 1} ({e.describe()}) in the {where} has no recorded values")
        with torch.no_grad():  # a recv buffer may be a leaf that requires grad (pipeline activations)
            for out, val in zip(ts, e.data):
                out.copy_(val)

    def _compare_local(self, kind: str, i: int, e: Entry, mine: Optional[List[torch.Tensor]]) -> None:
        """Count whether this rank's own inputs equal the recorder's, bit for bit (before the
        recorded result overwrites anything)."""
        self.local_checked += 1
        mine = mine or []
        bad = [j for j, (a, b) in enumerate(zip(mine, e.local)) if not same_bits(a, b)]
        if len(mine) == len(e.local) and not bad:
            self.local_equal += 1
        elif not self.local_mismatch:
            j = bad[0] if bad else min(len(mine), len(e.local))
            detail = ""
            if bad:
                a, b = mine[j].detach().to("cpu").float().reshape(-1), e.local[j].float().reshape(-1)
                diff = int((a != b).sum())
                detail = f": {diff} of {a.numel()} values differ (max |diff| {float((a - b).abs().max()):.3g})"
            self.local_mismatch = (f"{kind} operation #{i + 1} ({e.describe()}), input {j}{detail}"
                                   if bad else f"{kind} operation #{i + 1}: {len(mine)} inputs, recorded {len(e.local)}")

    def unused(self) -> Dict[str, int]:
        """Recorded operations the replay did not reach, per kind (0 everywhere after a full step)."""
        return {k: len(es) - self.cursor.get(k, 0) for k, es in self.record.entries.items() if len(es) > self.cursor.get(k, 0)}
