"""The parallel layout: pure data, Megatron's rank math, no torch.distributed.

A layout is the set of parallel degrees of a job and the order in which they vary
over global ranks. Its group math equals megatron-core's ``RankGenerator`` exactly
(the tests use megatron-core itself as the oracle), but this module imports neither
torch nor megatron, so the controller, the planner and the benchmarks can reason
about a 8,192-rank job in one cheap process.

Two rank spaces share the world, as in Megatron:

* the dense space, ordered by ``order`` over ``tp, cp, ep(=1), dp, pp``;
* the expert space, ordered by ``order`` over ``etp, ep, edp, pp`` (``cp`` is 1 there).

Example, world 8, tp2 pp2 (dp2), order ``tp-cp-ep-dp-pp``::

    rank:  0  1  2  3  4  5  6  7
    tp:    0  1  0  1  0  1  0  1      tp groups  [0,1] [2,3] [4,5] [6,7]
    dp:    0  0  1  1  0  0  1  1      dp groups  [0,2] [1,3] [4,6] [5,7]
    pp:    0  0  0  0  1  1  1  1      pp groups  [0,4] [1,5] [2,6] [3,7]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Dict, List, Tuple

from pitstop.errors import LayoutError, UnknownGroupKindError

#: The dimensions Megatron knows, in its default order.
DIMS: Tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")

#: Tokens of the expert rank space, mapped onto Megatron's expert ``RankGenerator`` names.
_EXPERT_TOKEN = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"}

#: Every group kind that Megatron-Core's ``initialize_model_parallel`` builds, in the
#: order Megatron builds them. Each rank belongs to exactly one group of each kind,
#: except ``embd`` and ``pos-embd``, which hold only the first/last pipeline stages.
MEGATRON_KINDS: Tuple[str, ...] = (
    "dp-cp",
    "dp",
    "cp",
    "tp-pp",
    "tp",
    "pp",
    "embd",
    "pos-embd",
    "tp-dp-cp",
    "tp-dp",
    "tp-cp",
    "ep",
    "etp",
    "tp-ep",
    "tp-ep-pp",
    "edp",
    "intra-dist-opt",
)

#: Kinds that are not a plain orthogonal slice of a rank space.
SPECIAL_KINDS = ("embd", "pos-embd", "intra-dist-opt")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name}({value!r}) must be a positive integer")


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel degrees of a Megatron-Core job and their rank order.

    ``dp`` is derived: ``world_size // (tp * pp * cp)``, with Megatron's meaning
    (context parallelism is *not* part of dp). The expert data-parallel degree
    ``edp`` is ``world_size // (etp * ep * pp)``.
    """

    world_size: int
    """Number of global ranks (processes), as ``torch.distributed.get_world_size()``."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each weight matrix."""
    pp: int = 1
    """Pipeline-parallel degree: number of pipeline stages."""
    cp: int = 1
    """Context-parallel degree: ranks that split the sequence inside attention."""
    ep: int = 1
    """Expert-parallel degree: ranks that split the experts of an MoE layer."""
    etp: int | None = None
    """Expert tensor-parallel degree; ``None`` means equal to ``tp`` (Megatron's default)."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying first, as Megatron's ``order=`` argument."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule); ``None`` = not interleaved."""
    dist_opt_instances: int = 1
    """Distributed-optimizer instances across the data-parallel domain (Megatron's
    ``num_distributed_optimizer_instances``)."""
    _dense: Tuple[str, ...] = field(init=False, repr=False, compare=False)
    _expert: Tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "dist_opt_instances"):
            _positive(name, getattr(self, name))
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        _positive("etp", self.etp)
        if self.vpp is not None:
            _positive("vpp", self.vpp)
            if self.pp < 2:
                raise LayoutError(
                    f"vpp({self.vpp}) needs pp > 1 (interleaved schedule), got pp({self.pp})"
                )
        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            raise LayoutError(
                f"tp({self.tp}) * pp({self.pp}) * cp({self.cp}) "
                f"does not divide world_size({self.world_size})"
            )
        expert = self.etp * self.ep * self.pp
        if self.world_size % expert:
            raise LayoutError(
                f"etp({self.etp}) * ep({self.ep}) * pp({self.pp}) "
                f"does not divide world_size({self.world_size})"
            )
        if not isinstance(self.order, str):
            raise LayoutError(f"order({self.order!r}) must be a string like 'tp-cp-ep-dp-pp'")
        tokens = self.order.lower().split("-")
        unknown = [t for t in tokens if t not in DIMS]
        if unknown or len(set(tokens)) != len(tokens):
            raise LayoutError(
                f"order({self.order!r}) must list distinct dimensions out of {'-'.join(DIMS)}"
                + (f"; unknown: {', '.join(unknown)}" if unknown else "; a dimension repeats")
            )
        sizes = {"tp": max(self.tp, self.etp), "cp": self.cp, "ep": self.ep,
                 "dp": max(self.dp, self.edp), "pp": self.pp}
        missing = [f"{d}({sizes[d]})" for d in DIMS if d not in tokens and sizes[d] != 1]
        if missing:
            raise LayoutError(f"order({self.order!r}) leaves out {', '.join(missing)}, which are > 1")
        # Megatron appends the dimensions the order leaves out (all of size 1).
        full = tokens + [d for d in DIMS if d not in tokens]
        if not (tokens[-1] == "pp" or self.pp == 1 or self.edp == self.dp):
            raise LayoutError(
                f"order({self.order!r}) does not end in pp, so edp({self.edp}) must equal "
                f"dp({self.dp}) with pp({self.pp}) > 1"
            )
        # Megatron also asserts that the dense and expert spaces have the same pp groups,
        # i.e. the same pp stride (the product of the sizes ordered before pp).
        before_pp = full[: full.index("pp")]
        dense_stride = prod(self._sizes(False)[d] for d in before_pp)
        expert_stride = prod(self._sizes(True)[d] for d in before_pp)
        if self.pp > 1 and dense_stride != expert_stride:
            raise LayoutError(
                f"order({self.order!r}) gives pp({self.pp}) a stride of {dense_stride} in the "
                f"dense space but {expert_stride} in the expert space (etp({self.etp}) "
                f"ep({self.ep}) edp({self.edp})), so attention and MoE pp groups would differ"
            )
        if (self.dp * self.cp) % self.dist_opt_instances:
            raise LayoutError(
                f"dist_opt_instances({self.dist_opt_instances}) does not divide "
                f"dp({self.dp}) * cp({self.cp}) = {self.dp * self.cp}"
            )
        if self.edp % self.dist_opt_instances:
            raise LayoutError(
                f"dist_opt_instances({self.dist_opt_instances}) does not divide edp({self.edp})"
            )
        object.__setattr__(self, "_dense", tuple(full))
        object.__setattr__(self, "_expert", tuple(d for d in full if d != "cp") + ("cp",))

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        """Data-parallel degree, excluding cp (Megatron's ``get_data_parallel_world_size()``)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert data-parallel degree."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def _sizes(self, expert: bool) -> Dict[str, int]:
        if expert:
            return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    # ------------------------------------------------------------------ kinds
    @staticmethod
    def _parse(kind: str) -> Tuple[bool, frozenset]:
        """Map a kind to (expert space?, set of Megatron dimension tokens)."""
        if not isinstance(kind, str) or not kind:
            raise UnknownGroupKindError(f"group kind {kind!r} must be a non-empty string")
        tokens = kind.lower().split("-")
        if len(set(tokens)) != len(tokens):
            raise UnknownGroupKindError(f"group kind {kind!r} repeats a dimension")
        expert = any(t in ("ep", "etp", "edp") for t in tokens)
        if expert:
            bad = [t for t in tokens if t not in _EXPERT_TOKEN and t not in ("tp", "dp")]
            mapped = [_EXPERT_TOKEN.get(t, t) for t in tokens]
            if bad or len(set(mapped)) != len(mapped):
                raise UnknownGroupKindError(
                    f"group kind {kind!r} mixes expert dimensions (ep, etp, edp) with "
                    f"{', '.join(bad) or 'a duplicate'}; expert kinds use etp/tp, ep, edp/dp, pp"
                )
            return True, frozenset(mapped)
        bad = [t for t in tokens if t not in ("tp", "cp", "dp", "pp")]
        if bad:
            raise UnknownGroupKindError(
                f"unknown group kind {kind!r}: {', '.join(bad)} is not one of tp, cp, dp, pp, "
                f"ep, etp, edp, or a special kind ({', '.join(SPECIAL_KINDS)})"
            )
        return False, frozenset(tokens)

    def _slices(self, expert: bool, tokens: frozenset) -> List[List[int]]:
        """Orthogonal groups of the masked dimensions, in Megatron's enumeration order."""
        order = self._expert if expert else self._dense
        sizes = self._sizes(expert)
        shape = [sizes[d] for d in order]
        strides, s = [], 1
        for n in shape:
            strides.append(s)
            s *= n
        inner = [i for i, d in enumerate(order) if d in tokens]
        outer = [i for i, d in enumerate(order) if d not in tokens]

        def offsets(axes: List[int]) -> List[int]:
            out = [0]
            for a in axes:  # first axis varies fastest
                out = [o + k * strides[a] for k in range(shape[a]) for o in out]
            return out

        members = offsets(inner)
        return [[base + m for m in members] for base in offsets(outer)]

    def group_ranks(self, kind: str) -> List[List[int]]:
        """Every group of ``kind`` as Megatron builds it, e.g. ``group_ranks("tp")``.

        Kinds use Megatron's tokens (``"tp"``, ``"dp-cp"``, ``"tp-pp"``, ...); expert
        kinds use ``ep``, ``etp`` and ``edp`` (``"tp-ep"`` means etp x ep), plus the
        special kinds ``"embd"``, ``"pos-embd"`` and ``"intra-dist-opt"``.
        """
        if kind == "embd":
            return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.group_ranks("pp")]
        if kind == "pos-embd":
            return [[g[0]] for g in self.group_ranks("pp")]
        if kind == "intra-dist-opt":
            # Megatron concatenates consecutive expert tp-ep-pp groups, edp/instances at a time.
            per = self.edp // self.dist_opt_instances
            mp = self.group_ranks("tp-ep-pp")
            return [sum(mp[i : i + per], []) for i in range(0, len(mp), per)]
        if kind == "intra-dp-cp":
            return self._partial(self.group_ranks("dp-cp"))
        if kind == "intra-edp":
            return self._partial(self.group_ranks("edp"))
        expert, tokens = self._parse(kind)
        return self._slices(expert, tokens)

    def _partial(self, groups: List[List[int]]) -> List[List[int]]:
        n = self.dist_opt_instances
        out = []
        for g in groups:
            per = len(g) // n
            out.extend(g[i * per : (i + 1) * per] for i in range(n))
        return out

    def kinds(self) -> Tuple[str, ...]:
        """The group kinds a Megatron job with this layout builds (see ``MEGATRON_KINDS``)."""
        extra = ("intra-dp-cp", "intra-edp") if self.dist_opt_instances > 1 else ()
        return MEGATRON_KINDS + extra

    # ------------------------------------------------------------------ coordinates
    def coords(self, rank: int) -> Dict[str, int]:
        """Coordinates of ``rank``: dense ``tp, cp, dp, pp`` and expert ``etp, ep, edp``."""
        self._check_rank(rank)
        out = {}
        for name, expert, dim in (
            ("tp", False, "tp"),
            ("cp", False, "cp"),
            ("dp", False, "dp"),
            ("pp", False, "pp"),
            ("etp", True, "tp"),
            ("ep", True, "ep"),
            ("edp", True, "dp"),
        ):
            order = self._expert if expert else self._dense
            sizes = self._sizes(expert)
            stride = prod(sizes[d] for d in order[: order.index(dim)])
            out[name] = (rank // stride) % sizes[dim]
        return out

    def rank(self, **coords: int) -> int:
        """Global rank at the given coordinates, dense (``tp, cp, dp, pp``) or expert
        (``etp, ep, edp, pp``); dimensions left out are 0."""
        dense = {"tp", "cp", "dp", "pp"}
        expert_names = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"}
        keys = set(coords)
        if keys <= dense:
            expert, mapping = False, {k: k for k in keys}
        elif keys <= set(expert_names):
            expert, mapping = True, {k: expert_names[k] for k in keys}
        else:
            raise LayoutError(
                f"coordinates {sorted(keys)} mix or misname dimensions; use tp/cp/dp/pp "
                f"or etp/ep/edp/pp"
            )
        order = self._expert if expert else self._dense
        sizes = self._sizes(expert)
        rank, stride = 0, 1
        by_dim = {mapping[k]: v for k, v in coords.items()}
        for d in order:
            v = by_dim.get(d, 0)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < sizes[d]:
                name = next((k for k, m in mapping.items() if m == d), d)
                raise LayoutError(f"{name}({v!r}) out of range 0..{sizes[d] - 1}")
            rank += v * stride
            stride *= sizes[d]
        return rank

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank({rank!r}) out of range 0..{self.world_size - 1}")

    def group_of(self, kind: str, rank: int) -> List[int] | None:
        """The group of ``kind`` that holds ``rank``, or None (only for embd/pos-embd)."""
        self._check_rank(rank)
        if kind in SPECIAL_KINDS or (isinstance(kind, str) and kind.startswith("intra-")):
            return next((g for g in self.group_ranks(kind) if rank in g), None)
        expert, tokens = self._parse(kind)
        # Direct construction: fix this rank's coordinates outside the mask.
        order = self._expert if expert else self._dense
        sizes = self._sizes(expert)
        strides, s = {}, 1
        for d in order:
            strides[d] = s
            s *= sizes[d]
        base = sum(((rank // strides[d]) % sizes[d]) * strides[d] for d in order if d not in tokens)
        members = [0]
        for d in order:
            if d in tokens:
                members = [m + k * strides[d] for k in range(sizes[d]) for m in members]
        return [base + m for m in members]

    def groups_of(self, rank: int) -> Dict[str, List[int]]:
        """Each kind's group that holds ``rank`` (kinds where it holds none are left out)."""
        out = {}
        for kind in self.kinds():
            g = self.group_of(kind, rank)
            if g is not None:
                out[kind] = g
        return out

    def describe(self) -> str:
        """``tp2 pp2 cp1 ep1 dp2 (world 8)``: a short tag for logs."""
        return (
            f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} etp{self.etp} dp{self.dp} "
            f"(world {self.world_size}, order {self.order})"
        )
