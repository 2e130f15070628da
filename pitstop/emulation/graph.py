"""The execution graph: what every role does, built at target scale from a few traces.

Pure: no torch, no torch.distributed.

A traced rank's timeline is, per iteration, a list of ops in issue order:

* :class:`Compute` -- a segment of local work with its measured duration;
* :class:`Comm` -- a collective on the rank's group of one layout kind (``"dp"``,
  ``"tp"``, ``"embd"``, ...), or a pipeline ``send``/``recv`` to the stage ``peer``
  stages away (``+1`` next, ``-1`` previous).

Ops carry no explicit order field: the position in the list *is* the order, and a
collective matches the collective with the same count on the same group at every
other member (the k-th ``dp`` collective of each member is one operation), as NCCL
and gloo match them. A ``send`` matches the ``recv`` with the same count between the
same two ranks (FIFO channel).

Slicing (:func:`slice_graph`) maps every rank of the target layout to a
:class:`RoleClass` and gives it that class's ops. The ops of a class are stored
once; group ranks and pipeline peers are resolved per rank only when asked
(:meth:`ExecutionGraph.group`, :meth:`ExecutionGraph.peer`), so 8,192 ranks cost
as much memory as their few classes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from pitstop.errors import LayoutError, TraceError
from pitstop.emulation.topology import COLLECTIVES, P2P
from pitstop.layout import ParallelLayout

#: Pipeline stage kinds. ``first_last`` is the single stage of ``pp == 1``: it is
#: both the first and the last stage (it holds the embedding and the loss).
STAGES = ("first", "middle", "last", "first_last")


def stage_kind(pp_rank: int, pp: int) -> str:
    """The stage kind of pipeline stage ``pp_rank`` out of ``pp``; ``pp == 2`` has no middle."""
    if not 0 <= pp_rank < pp:
        raise TraceError(f"pp_rank({pp_rank}) out of range 0..{pp - 1}")
    if pp == 1:
        return "first_last"
    if pp_rank == 0:
        return "first"
    if pp_rank == pp - 1:
        return "last"
    return "middle"


# ---------------------------------------------------------------------- ops
@dataclass(frozen=True)
class Compute:
    """Local work of ``duration_s`` seconds (kernels, optimizer, data loading)."""

    duration_s: float
    name: str = ""

    def __post_init__(self) -> None:
        d = self.duration_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
            raise TraceError(f"Compute duration_s({d!r}) must be a finite number >= 0 (seconds)")


@dataclass(frozen=True)
class Comm:
    """A communication op.

    Collectives (``op`` in :data:`~pitstop.emulation.topology.COLLECTIVES`) run on
    the rank's group of layout kind ``group_kind``; ``nbytes`` is the full buffer
    (the all-gather output, the reduce-scatter input, each rank's all-to-all send
    buffer), so it does not change with the group size. ``send``/``recv`` go to the
    pipeline stage ``peer`` stages away in the rank's ``pp`` group (wrapping
    around, as Megatron's next/prev rank do).
    """

    op: str
    group_kind: str
    nbytes: int
    peer: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVES + P2P:
            raise TraceError(
                f"Comm op {self.op!r} is not one of {', '.join(COLLECTIVES + P2P)}"
            )
        nb = self.nbytes
        if isinstance(nb, bool) or not isinstance(nb, int) or nb < 0:
            raise TraceError(f"Comm {self.op} nbytes({nb!r}) must be an integer >= 0")
        if not isinstance(self.group_kind, str) or not self.group_kind:
            raise TraceError(f"Comm {self.op} group_kind({self.group_kind!r}) must be a layout kind like 'dp'")
        if isinstance(self.peer, bool) or not isinstance(self.peer, int):
            raise TraceError(f"Comm {self.op} peer({self.peer!r}) must be an integer stage offset")
        if self.is_p2p:
            if self.group_kind != "pp":
                raise TraceError(f"Comm {self.op} group_kind({self.group_kind!r}) must be 'pp'")
            if self.peer == 0:
                raise TraceError(f"Comm {self.op} peer(0) must be a non-zero stage offset (+1 next, -1 previous)")
        elif self.peer != 0:
            raise TraceError(f"Comm {self.op} on {self.group_kind} has peer({self.peer}); only send/recv take a peer")

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P

    @classmethod
    def send(cls, nbytes: int, peer: int = 1, name: str = "") -> "Comm":
        """A pipeline send to the stage ``peer`` stages away (default: the next)."""
        return cls("send", "pp", nbytes, peer, name)

    @classmethod
    def recv(cls, nbytes: int, peer: int = -1, name: str = "") -> "Comm":
        """A pipeline recv from the stage ``peer`` stages away (default: the previous)."""
        return cls("recv", "pp", nbytes, peer, name)


Op = Union[Compute, Comm]
#: One class's timeline: per iteration, its ops in issue order.
Program = Tuple[Tuple[Op, ...], ...]


@dataclass(frozen=True, order=True)
class RoleClass:
    """Ranks that run the same ops.

    ``stage`` is the stage kind (:data:`STAGES`). ``pp_rank`` pins the class to one
    pipeline stage: a 1F1B schedule gives each stage its own warmup length, so
    exact slicing traces each stage; ``None`` serves every stage of the kind.
    ``tag`` tells apart ranks with the same coordinates that still differ (a
    straggler, a rank holding a special layer).
    """

    stage: str
    pp_rank: Optional[int] = None
    tag: str = ""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise TraceError(f"RoleClass stage({self.stage!r}) must be one of {', '.join(STAGES)}")
        if self.pp_rank is not None and (
            isinstance(self.pp_rank, bool) or not isinstance(self.pp_rank, int) or self.pp_rank < 0
        ):
            raise TraceError(f"RoleClass pp_rank({self.pp_rank!r}) must be None or an integer >= 0")
        if not isinstance(self.tag, str):
            raise TraceError(f"RoleClass tag({self.tag!r}) must be a string")

    def __str__(self) -> str:
        s = self.stage if self.pp_rank is None else f"{self.stage}@pp{self.pp_rank}"
        return f"{s}/{self.tag}" if self.tag else s

    def to_json(self) -> Dict[str, Any]:
        return {"stage": self.stage, "pp_rank": self.pp_rank, "tag": self.tag}

    @classmethod
    def from_json(cls, data: Any, where: str = "class") -> "RoleClass":
        _need_keys(where, data, ("stage",), ("stage", "pp_rank", "tag"))
        return cls(data["stage"], data.get("pp_rank"), data.get("tag", ""))


# ---------------------------------------------------------------------- traces
@dataclass(frozen=True)
class Trace:
    """What one traced rank did: its role, its class and its ops per iteration."""

    role: int
    role_class: RoleClass
    iterations: Program
    source: str = ""
    """Where the trace comes from (the traced layout, a file, "synthetic")."""

    def __post_init__(self) -> None:
        its = tuple(tuple(it) for it in self.iterations)
        if not its:
            raise TraceError(f"trace of role {self.role} ({self.role_class}) has no iteration")
        for i, it in enumerate(its):
            if not it:
                raise TraceError(f"trace of role {self.role} ({self.role_class}): iteration {i} has no op")
            for j, op in enumerate(it):
                if not isinstance(op, (Compute, Comm)):
                    raise TraceError(
                        f"trace of role {self.role}: iteration {i} op {j} is a {type(op).__name__}, "
                        f"expected Compute or Comm"
                    )
        object.__setattr__(self, "iterations", its)

    def to_json(self) -> Dict[str, Any]:
        return {
            "role": self.role,
            "class": self.role_class.to_json(),
            "source": self.source,
            "iterations": [[op_to_json(op) for op in it] for it in self.iterations],
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "trace") -> "Trace":
        _need_keys(where, data, ("role", "class", "iterations"), ("role", "class", "iterations", "source"))
        its = data["iterations"]
        if not isinstance(its, list):
            raise TraceError(f"{where}.iterations must be a list of lists of ops")
        iterations = []
        for i, it in enumerate(its):
            if not isinstance(it, list):
                raise TraceError(f"{where}.iterations[{i}] must be a list of ops")
            iterations.append(tuple(op_from_json(o, f"{where}.iterations[{i}][{j}]") for j, o in enumerate(it)))
        return cls(data["role"], RoleClass.from_json(data["class"], f"{where}.class"), tuple(iterations),
                   data.get("source", ""))


def op_to_json(op: Op) -> Dict[str, Any]:
    """``{"compute": 0.01}`` or ``{"comm": "all_reduce", "group": "dp", "nbytes": 4096}``."""
    if isinstance(op, Compute):
        out: Dict[str, Any] = {"compute": op.duration_s}
    else:
        out = {"comm": op.op, "group": op.group_kind, "nbytes": op.nbytes}
        if op.peer:
            out["peer"] = op.peer
    if op.name:
        out["name"] = op.name
    return out


def op_from_json(data: Any, where: str = "op") -> Op:
    """Inverse of :func:`op_to_json`; errors name the key and what it expects."""
    if not isinstance(data, dict):
        raise TraceError(f"{where}({data!r}) must be an object with 'compute' or 'comm'")
    if "compute" in data:
        _need_keys(where, data, ("compute",), ("compute", "name"))
        return Compute(data["compute"], data.get("name", ""))
    if "comm" in data:
        _need_keys(where, data, ("comm", "group", "nbytes"), ("comm", "group", "nbytes", "peer", "name"))
        return Comm(data["comm"], data["group"], data["nbytes"], data.get("peer", 0), data.get("name", ""))
    raise TraceError(f"{where}: an op needs a 'compute' or a 'comm' key, got {sorted(data)}")


def _need_keys(where: str, data: Any, required: Sequence[str], allowed: Sequence[str]) -> None:
    if not isinstance(data, dict):
        raise TraceError(f"{where}({data!r}) must be an object with keys {', '.join(allowed)}")
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; expected {', '.join(allowed)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise TraceError(f"{where}: missing key(s) {', '.join(missing)}")


def dump_traces(traces: Iterable[Trace], path: Union[str, Path]) -> None:
    """Write traces as ``{"version": 1, "traces": [...]}``."""
    Path(path).write_text(json.dumps({"version": 1, "traces": [t.to_json() for t in traces]}))


def load_traces(path: Union[str, Path]) -> List[Trace]:
    """Read what :func:`dump_traces` wrote."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    _need_keys(str(path), data, ("version", "traces"), ("version", "traces"))
    if data["version"] != 1:
        raise TraceError(f"{path}: version({data['version']!r}) is not supported; expected 1")
    return [Trace.from_json(t, f"{path}: traces[{i}]") for i, t in enumerate(data["traces"])]


# ---------------------------------------------------------------------- the graph
@dataclass(frozen=True)
class GroupTable:
    """Every group of one kind, and which one holds each rank (-1: none, embd only)."""

    kind: str
    groups: Tuple[Tuple[int, ...], ...]
    index: Tuple[int, ...]


@dataclass(frozen=True, eq=False)
class ExecutionGraph:
    """The target-scale graph: the ops of each class once, and the rule that maps ranks to classes."""

    layout: ParallelLayout
    programs: Mapping[RoleClass, Program]
    """Ops of each class, stored once (only the classes some rank uses)."""
    overrides: Mapping[int, RoleClass] = field(default_factory=dict)
    """Ranks pinned to a class (stragglers, special layers)."""
    _by_stage: Tuple[RoleClass, ...] = field(init=False, repr=False, compare=False)
    _cache: Dict[Tuple[str, int], Tuple[int, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict)
    _tables: Dict[str, GroupTable] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_stage", tuple(_needed(self.layout, self.programs)))

    # ------------------------------------------------------------------ per rank
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def n_iterations(self) -> int:
        return len(next(iter(self.programs.values())))

    def stage(self, rank: int) -> int:
        """The pipeline stage (pp coordinate) of ``rank``."""
        return self.layout.coords(rank)["pp"]

    def class_of(self, rank: int) -> RoleClass:
        """The class whose ops ``rank`` runs: its override, else its stage's class."""
        cls = self.overrides.get(rank)
        return cls if cls is not None else self._by_stage[self.stage(rank)]

    def program(self, rank: int) -> Program:
        """The ops of ``rank`` per iteration: the very object stored for its class."""
        return self.programs[self.class_of(rank)]

    def group(self, rank: int, kind: str) -> Tuple[int, ...]:
        """The ranks of ``rank``'s group of ``kind`` (``layout.group_of``), cached."""
        key = (kind, rank)
        g = self._cache.get(key)
        if g is None:
            try:
                found = self.layout.group_of(kind, rank)
            except LayoutError as exc:
                raise TraceError(f"rank {rank} ({self.class_of(rank)}): {exc}") from None
            if found is None:
                raise TraceError(
                    f"rank {rank} ({self.class_of(rank)}) has a collective on {kind!r} but belongs "
                    f"to no {kind!r} group (pp stage {self.stage(rank)} of {self.layout.pp})"
                )
            g = self._cache[key] = tuple(found)
        return g

    def peer(self, rank: int, offset: int) -> int:
        """The rank ``offset`` pipeline stages away from ``rank`` (modulo pp, as Megatron)."""
        pp = self.layout.pp
        if offset % pp == 0:
            raise TraceError(
                f"rank {rank}: a send/recv with peer({offset}) lands on itself with pp({pp})"
            )
        g = self.group(rank, "pp")
        return g[(self.stage(rank) + offset) % pp]

    def target(self, rank: int, op: Op) -> Union[None, int, Tuple[int, ...]]:
        """What ``op`` of ``rank`` talks to: None (compute), the peer rank, or the group ranks."""
        if isinstance(op, Compute):
            return None
        if op.is_p2p:
            return self.peer(rank, op.peer)
        return self.group(rank, op.group_kind)

    def rank_ops(self, rank: int) -> Iterator[Tuple[int, int, Op, Union[None, int, Tuple[int, ...]]]]:
        """``(iteration, index, op, target)`` for every op of ``rank``, resolved on the fly."""
        for i, it in enumerate(self.program(rank)):
            for j, op in enumerate(it):
                yield i, j, op, self.target(rank, op)

    # ------------------------------------------------------------------ bulk
    def group_table(self, kind: str) -> GroupTable:
        """All groups of ``kind`` at once (``layout.group_ranks``), for whole-world passes."""
        t = self._tables.get(kind)
        if t is None:
            groups = tuple(tuple(g) for g in self.layout.group_ranks(kind))
            index = [-1] * self.world_size
            for gi, g in enumerate(groups):
                for r in g:
                    index[r] = gi
            t = self._tables[kind] = GroupTable(kind, groups, tuple(index))
        return t

    def stages(self) -> List[int]:
        """The pp stage of every rank, from the pp groups (a rank's position in its group)."""
        out = [0] * self.world_size
        for g in self.group_table("pp").groups:
            for s, r in enumerate(g):
                out[r] = s
        return out

    def classes(self) -> List[RoleClass]:
        """The class of every rank."""
        by_stage = self._by_stage
        out = [by_stage[s] for s in self.stages()]
        for r, cls in self.overrides.items():
            out[r] = cls
        return out


def _needed(layout: ParallelLayout, traced: Iterable[RoleClass]) -> List[RoleClass]:
    """The classes the stages of ``layout`` draw from ``traced`` (most specific first)."""
    traced = set(traced)
    out = []
    for s in range(layout.pp):
        kind = stage_kind(s, layout.pp)
        for cls in (RoleClass(kind, s), RoleClass(kind)):
            if cls in traced:
                out.append(cls)
                break
        else:
            raise TraceError(
                f"no trace for pipeline stage {s} of pp({layout.pp}): need class "
                f"{RoleClass(kind, s)} or {RoleClass(kind)}; traced: "
                f"{', '.join(sorted(map(str, traced))) or 'none'}"
            )
    return out


def slice_graph(
    layout: ParallelLayout,
    traces: Iterable[Trace],
    overrides: Optional[Mapping[int, RoleClass]] = None,
) -> ExecutionGraph:
    """Build the target-scale execution graph of ``layout`` from traced classes.

    Each rank gets the trace of its override class, else of ``RoleClass(kind,
    pp_rank)`` for its stage, else of ``RoleClass(kind)``. Every trace must be
    used (a spare one usually means the traces belong to another layout) and all
    must have the same number of iterations. Collective kinds and pipeline peers
    are checked once per class against the layout.
    """
    by_class: Dict[RoleClass, Program] = {}
    for t in traces:
        if not isinstance(t, Trace):
            raise TraceError(f"slice_graph takes Trace objects, got {type(t).__name__}")
        if t.role_class in by_class:
            raise TraceError(f"two traces for class {t.role_class} (the second is role {t.role})")
        by_class[t.role_class] = t.iterations
    overrides = dict(overrides or {})
    for r, cls in overrides.items():
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < layout.world_size:
            raise TraceError(f"override rank({r!r}) out of range 0..{layout.world_size - 1}")
        s = layout.coords(r)["pp"]
        kind = stage_kind(s, layout.pp)
        if cls.stage != kind or cls.pp_rank not in (None, s):
            raise TraceError(f"override rank {r} -> {cls}: rank {r} is pipeline stage {s} ({kind})")
        if cls not in by_class:
            raise TraceError(f"override rank {r} -> {cls}: no trace for class {cls}")
    used = set(_needed(layout, by_class)) | set(overrides.values())
    spare = [c for c in by_class if c not in used]
    if spare:
        raise TraceError(
            f"trace(s) for {', '.join(map(str, spare))} fit no rank of {layout.describe()}"
        )
    lengths = {c: len(p) for c, p in by_class.items()}
    if len(set(lengths.values())) > 1:
        raise TraceError(
            "traces differ in their number of iterations: "
            + ", ".join(f"{c}: {n}" for c, n in sorted(lengths.items()))
        )
    graph = ExecutionGraph(layout, by_class, overrides)
    # Check each class once on one of its ranks: its kinds exist and hold it, its peers exist.
    reps: Dict[RoleClass, int] = {}
    for s in range(layout.pp):
        reps.setdefault(graph._by_stage[s], layout.rank(pp=s))
    for r, cls in overrides.items():
        reps.setdefault(cls, r)
    for cls, r in reps.items():
        seen = set()
        for it in by_class[cls]:
            for op in it:
                if isinstance(op, Comm) and (op.op, op.group_kind, op.peer) not in seen:
                    seen.add((op.op, op.group_kind, op.peer))
                    graph.target(r, op)
    return graph
