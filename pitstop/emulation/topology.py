"""Network model of emulation: two link classes and alpha-beta collective costs.

Pure: no torch, no torch.distributed. A :class:`Topology` says how many ranks share
a node and, for each link class (``intra_node``, ``inter_node``), a latency ``alpha_s``
(seconds per message step) and a bandwidth ``bandwidth_bytes_per_s`` (bytes per
second, one direction). Costs use ``beta = 1 / bandwidth`` (seconds per byte).

Placement: rank ``r`` runs on node ``r // gpus_per_node`` (launchers fill nodes with
consecutive ranks, as torchrun and SLURM do).

Topology files are JSON (``.json``) or TOML (``.toml``)::

    {"name": "h200-nvlink-ib", "doc": "...", "gpus_per_node": 8,
     "intra_node": {"alpha_s": 2e-6, "bandwidth_bytes_per_s": 4.5e11},
     "inter_node": {"alpha_s": 5e-6, "bandwidth_bytes_per_s": 5.0e10}}

A link class may also carry measured cost tables, in the style of nccl-tests: per operation
and group size, the seconds one operation took at each of several message sizes (``pitstop
calibrate`` writes them)::

    "intra_node": {"alpha_s": ..., "bandwidth_bytes_per_s": ...,
                   "table": {"all_reduce": {"2": [[1024, 1.9e-4], [1048576, 1.1e-3], ...]},
                             "send": {"2": [[1024, 1.2e-4], ...]}}}

A cost is then read off the table (:meth:`LinkClass.tabled`): linear between the two
measured sizes around it, flat below the smallest (latency), along the last segment's slope
above the largest (bandwidth). A group size the table lacks takes the nearest measured size
scaled by the alpha-beta model's ratio between the two; an operation it lacks, the
alpha-beta model alone.

A topology may also say what building one communicator costs, per group size (``pitstop
calibrate`` measures it; ``pitstop emulate --fault`` reads it to cost a replacement's delta
groups)::

    "group_build_s": {"1": 2.1e-3, "2": 4.0e-3, "4": 7.9e-3}

linear between measured sizes and along the last segment beyond the largest.

Shipped files live in ``pitstop/emulation/topologies/``; :func:`load` also takes their
bare name (``load("h200-nvlink-ib")``).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from pitstop.errors import TopologyError

#: Directory of the shipped topology files.
TOPOLOGY_DIR = Path(__file__).with_name("topologies")

#: Collective operations the cost model knows (torch.distributed names).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier")
#: Point-to-point operations.
P2P = ("send", "recv")

_LINK_KEYS = ("alpha_s", "bandwidth_bytes_per_s")
_LINK_OPTIONAL = ("table",)
#: Operations a measured table may hold: the collectives and ``send`` (one point-to-point message).
TABLE_OPS = COLLECTIVES + ("send",)

#: op -> group size -> (sizes in bytes, ascending; seconds at each)
Table = Mapping[str, Mapping[int, Tuple[Tuple[int, ...], Tuple[float, ...]]]]
_TOP_KEYS = ("name", "doc", "calibrated", "gpus_per_node", "intra_node", "inter_node", "group_build_s")


@dataclass(frozen=True)
class LinkClass:
    """One class of link: latency per message step and one-direction bandwidth."""

    name: str
    alpha_s: float
    """Latency of one message step, seconds."""
    bandwidth_bytes_per_s: float
    """Bandwidth of one direction, bytes per second."""

    table: Table = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Measured costs (see the module docstring); empty: the alpha-beta model alone."""

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte, ``1 / bandwidth``."""
        return 1.0 / self.bandwidth_bytes_per_s

    def tabled(self, op: str, n: int, nbytes: int) -> Optional[float]:
        """The measured cost of ``op`` over ``n`` ranks and ``nbytes``, or None when the table
        has no row for ``op``. See the module docstring for interpolation and group sizes."""
        rows = self.table.get(op)
        if not rows or n <= 1:
            return None
        if n in rows:
            return interpolate(*rows[n], nbytes)
        near = min(rows, key=lambda m: (abs(m - n), m))
        base = interpolate(*rows[near], nbytes)
        den = _model_cost(op, near, nbytes, self)  # the line alone: _model_cost never reads the table
        return base if den <= 0 else base * _model_cost(op, n, nbytes, self) / den


@dataclass(frozen=True)
class Topology:
    """Ranks per node and the two link classes; see the module docstring for placement."""

    gpus_per_node: int
    intra_node: LinkClass
    inter_node: LinkClass
    name: str = ""
    doc: str = field(default="", repr=False)
    calibrated: str = field(default="", repr=False)
    """Where the numbers come from when measured: date, machine, command."""
    group_build_s: Mapping[int, float] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Seconds to build one communicator, per group size (measured; empty when unknown)."""

    def __post_init__(self) -> None:
        gpn = self.gpus_per_node
        if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
            raise TopologyError(f"gpus_per_node({gpn!r}) must be an integer >= 1")
        for attr in ("intra_node", "inter_node"):
            link = getattr(self, attr)
            if not isinstance(link, LinkClass):
                raise TopologyError(f"{attr}({link!r}) must be a LinkClass")
            _check_number(f"{attr}.alpha_s", link.alpha_s, "seconds", allow_zero=True)
            _check_number(f"{attr}.bandwidth_bytes_per_s", link.bandwidth_bytes_per_s,
                          "bytes per second", allow_zero=False)

    # ------------------------------------------------------------------ placement
    def node_of(self, rank: int) -> int:
        """The node that runs ``rank``."""
        return rank // self.gpus_per_node

    def link_class(self, rank_a: int, rank_b: int) -> LinkClass:
        """The link between two ranks: ``intra_node`` when they share a node."""
        if rank_a // self.gpus_per_node == rank_b // self.gpus_per_node:
            return self.intra_node
        return self.inter_node

    def group_link(self, ranks: Sequence[int]) -> LinkClass:
        """The link class that paces a collective over ``ranks``.

        A group inside one node uses ``intra_node``. A group that spans nodes is paced
        by the slowest link it uses: every ring step waits for its slowest hop, so
        the whole group is costed with the worse alpha and the worse bandwidth of the
        classes it touches (``inter_node``, plus ``intra_node`` where two members share
        a node). With the usual ``inter_node`` slower than ``intra_node`` that is plain
        ``inter_node``.
        """
        gpn = self.gpus_per_node
        nodes = {r // gpn for r in ranks}
        if len(nodes) <= 1:
            return self.intra_node
        used = [self.inter_node]
        if len(nodes) < len(ranks):
            used.append(self.intra_node)
        if len(used) == 1:
            return self.inter_node
        return LinkClass(
            "inter_node",
            max(link.alpha_s for link in used),
            min(link.bandwidth_bytes_per_s for link in used),
            self.inter_node.table,
        )

    # ------------------------------------------------------------------ costs
    def group_build_cost(self, n: int) -> float:
        """Seconds to build one communicator of ``n`` ranks: the measured sizes, linear between
        them, along the last segment (never downward) beyond the largest, flat below the smallest."""
        if not self.group_build_s:
            raise TopologyError(f"topology {self.name or '<unnamed>'!r} has no group_build_s: measure it "
                                "with `pitstop calibrate --out FILE` and pass that file")
        sizes = sorted(self.group_build_s)
        if len(sizes) == 1:
            return float(self.group_build_s[sizes[0]])
        return interpolate(sizes, [self.group_build_s[k] for k in sizes], n)

    def cost(self, op: str, ranks: Sequence[int], nbytes: int) -> float:
        """Seconds a collective ``op`` of ``nbytes`` over ``ranks`` takes once all arrived."""
        return collective_cost(op, len(ranks), nbytes, self.group_link(ranks))

    def p2p_cost(self, src: int, dst: int, nbytes: int) -> float:
        """Seconds one message of ``nbytes`` takes from ``src`` to ``dst``."""
        return p2p_cost(nbytes, self.link_class(src, dst))

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> Dict[str, Any]:
        """The file form (what :func:`from_dict` reads)."""
        out: Dict[str, Any] = {"name": self.name, "doc": self.doc}
        if self.calibrated:
            out["calibrated"] = self.calibrated
        out["gpus_per_node"] = self.gpus_per_node
        for attr in ("intra_node", "inter_node"):
            link = getattr(self, attr)
            out[attr] = {"alpha_s": link.alpha_s, "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s}
            if link.table:
                out[attr]["table"] = {op: {str(n): [[b, t] for b, t in zip(*pts)] for n, pts in sorted(rows.items())}
                                      for op, rows in link.table.items()}
        if self.group_build_s:
            out["group_build_s"] = {str(n): t for n, t in sorted(self.group_build_s.items())}
        return out


# ---------------------------------------------------------------------- cost model
def ring_all_reduce(n: int, nbytes: int, link: LinkClass) -> float:
    """Ring all-reduce: reduce-scatter then all-gather, ``2(n-1)/n * bytes * beta + 2(n-1) alpha``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes * link.beta_s_per_byte + 2 * (n - 1) * link.alpha_s


def ring_all_gather(n: int, nbytes: int, link: LinkClass) -> float:
    """Ring all-gather of a ``nbytes`` *output* buffer: ``(n-1)/n * bytes * beta + (n-1) alpha``."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes * link.beta_s_per_byte + (n - 1) * link.alpha_s


def ring_reduce_scatter(n: int, nbytes: int, link: LinkClass) -> float:
    """Ring reduce-scatter of a ``nbytes`` *input* buffer; same cost as all-gather."""
    return ring_all_gather(n, nbytes, link)


def pipelined_broadcast(n: int, nbytes: int, link: LinkClass) -> float:
    """Broadcast along a pipelined chain (NCCL's ring broadcast), large-message form:
    ``bytes * beta + (n-1) alpha`` (the whole buffer crosses each link once, the
    chunks overlap, the last rank is ``n-1`` hops away)."""
    if n <= 1:
        return 0.0
    return nbytes * link.beta_s_per_byte + (n - 1) * link.alpha_s


def pairwise_all_to_all(n: int, nbytes: int, link: LinkClass) -> float:
    """All-to-all by pairwise exchange, ``nbytes`` = each rank's whole send buffer:
    ``(n-1)/n * bytes * beta + (n-1) alpha`` (the 1/n kept locally never moves)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes * link.beta_s_per_byte + (n - 1) * link.alpha_s


def dissemination_barrier(n: int, nbytes: int, link: LinkClass) -> float:
    """Barrier by dissemination: ``ceil(log2 n)`` rounds of one empty message,
    ``ceil(log2 n) * alpha``; ``nbytes`` is ignored."""
    if n <= 1:
        return 0.0
    return math.ceil(math.log2(n)) * link.alpha_s


def p2p_cost(nbytes: int, link: LinkClass) -> float:
    """One point-to-point message: the link's measured ``send`` row, else ``alpha + bytes * beta``."""
    t = link.tabled("send", 2, nbytes) if link.table else None
    return link.alpha_s + nbytes * link.beta_s_per_byte if t is None else t


_COST = {
    "all_reduce": ring_all_reduce,
    "all_gather": ring_all_gather,
    "reduce_scatter": ring_reduce_scatter,
    "broadcast": pipelined_broadcast,
    "all_to_all": pairwise_all_to_all,
    "barrier": dissemination_barrier,
}


def _model_cost(op: str, n: int, nbytes: int, link: LinkClass) -> float:
    if op == "send":
        return link.alpha_s + nbytes * link.beta_s_per_byte
    try:
        fn = _COST[op]
    except KeyError:
        raise TopologyError(
            f"unknown collective {op!r}; the cost model knows {', '.join(COLLECTIVES)}"
        ) from None
    return fn(n, nbytes, link)


def collective_cost(op: str, n: int, nbytes: int, link: LinkClass) -> float:
    """Seconds collective ``op`` over ``n`` ranks and ``nbytes`` takes on ``link``: its
    measured table where it has one for ``op``, the alpha-beta model otherwise."""
    if op not in _COST:
        raise TopologyError(f"unknown collective {op!r}; the cost model knows {', '.join(COLLECTIVES)}")
    t = link.tabled(op, n, nbytes) if link.table else None
    return _model_cost(op, n, nbytes, link) if t is None else t


def interpolate(sizes: Sequence[int], seconds: Sequence[float], nbytes: int) -> float:
    """Piecewise-linear cost at ``nbytes`` through the measured ``(sizes, seconds)`` points
    (ascending sizes): flat below the first point, the last segment's slope (never negative)
    beyond the last."""
    if nbytes <= sizes[0]:
        return float(seconds[0])
    i = bisect.bisect_left(sizes, nbytes)
    if i < len(sizes):
        if sizes[i] == nbytes:
            return float(seconds[i])
        x0, x1, y0, y1 = sizes[i - 1], sizes[i], seconds[i - 1], seconds[i]
        return float(y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0))
    x0, x1, y0, y1 = sizes[-2], sizes[-1], seconds[-2], seconds[-1]
    return float(y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (nbytes - x1))


# ---------------------------------------------------------------------- loading
def _check_number(where: str, value: Any, unit: str, allow_zero: bool) -> float:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise TopologyError(f"{where}({value!r}) must be a finite number {bound} ({unit})")
    return float(value)


def _check_keys(where: str, data: Mapping[str, Any], allowed: Sequence[str], required: Sequence[str]) -> None:
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise TopologyError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; expected keys are "
            f"{', '.join(allowed)}"
        )
    missing = [k for k in required if k not in data]
    if missing:
        raise TopologyError(f"{where}: missing key(s) {', '.join(missing)} (required: {', '.join(required)})")


def _link(source: str, attr: str, data: Any) -> LinkClass:
    if not isinstance(data, Mapping):
        raise TopologyError(
            f"{source}: {attr}({data!r}) must be a table with keys {', '.join(_LINK_KEYS)}"
        )
    _check_keys(f"{source}: {attr}", data, _LINK_KEYS + _LINK_OPTIONAL, _LINK_KEYS)
    return LinkClass(
        attr,
        _check_number(f"{source}: {attr}.alpha_s", data["alpha_s"], "seconds", allow_zero=True),
        _check_number(f"{source}: {attr}.bandwidth_bytes_per_s", data["bandwidth_bytes_per_s"],
                      "bytes per second", allow_zero=False),
        _table(f"{source}: {attr}.table", data.get("table", {})),
    )


def _table(where: str, data: Any) -> Dict[str, Dict[int, Tuple[Tuple[int, ...], Tuple[float, ...]]]]:
    """A link's measured table from its file form; every error names the entry and what it expects."""
    if not isinstance(data, Mapping):
        raise TopologyError(f"{where}({str(data)[:60]}) must be a table {{op: {{group size: [[bytes, seconds], ...]}}}}")
    out: Dict[str, Dict[int, Tuple[Tuple[int, ...], Tuple[float, ...]]]] = {}
    for op, rows in data.items():
        if op not in TABLE_OPS:
            raise TopologyError(f"{where}: unknown operation {op!r}; expected one of {', '.join(TABLE_OPS)}")
        if not isinstance(rows, Mapping) or not rows:
            raise TopologyError(f"{where}.{op}({str(rows)[:60]}) must be a non-empty table {{group size: points}}")
        out[op] = {}
        for n, pts in rows.items():
            if not (isinstance(n, str) and n.isdigit() and int(n) >= 2):
                raise TopologyError(f"{where}.{op}: group size {n!r} must be an integer >= 2 (as a string key)")
            w = f"{where}.{op}[{n}]"
            if not (isinstance(pts, list) and len(pts) >= 2 and all(isinstance(p, list) and len(p) == 2 for p in pts)):
                raise TopologyError(f"{w}({str(pts)[:60]}) must be >= 2 points [bytes, seconds]")
            sizes = [p[0] for p in pts]
            if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in sizes) or \
                    any(b >= c for b, c in zip(sizes, sizes[1:])):
                raise TopologyError(f"{w}: sizes {sizes[:8]} must be integers >= 0, strictly ascending")
            secs = tuple(_check_number(f"{w} at {b} bytes", p[1], "seconds", allow_zero=False) for b, p in zip(sizes, pts))
            out[op][int(n)] = (tuple(sizes), secs)
    return out


def from_dict(data: Any, source: str = "<dict>") -> Topology:
    """Build a :class:`Topology` from its file form; every error names the key and what it expects."""
    if not isinstance(data, Mapping):
        raise TopologyError(f"{source}: a topology must be a table/object, got {type(data).__name__}")
    _check_keys(source, data, _TOP_KEYS, ("gpus_per_node", "intra_node", "inter_node"))
    for key in ("name", "doc", "calibrated"):
        if key in data and not isinstance(data[key], str):
            raise TopologyError(f"{source}: {key}({data[key]!r}) must be a string")
    gpn = data["gpus_per_node"]
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise TopologyError(f"{source}: gpus_per_node({gpn!r}) must be an integer >= 1")
    return Topology(
        gpus_per_node=gpn,
        intra_node=_link(source, "intra_node", data["intra_node"]),
        inter_node=_link(source, "inter_node", data["inter_node"]),
        name=data.get("name", ""),
        doc=data.get("doc", ""),
        calibrated=data.get("calibrated", ""),
        group_build_s=_group_build(f"{source}: group_build_s", data.get("group_build_s", {})),
    )


def _group_build(where: str, data: Any) -> Dict[int, float]:
    """``{"group size": seconds}``: sizes integers >= 1, seconds > 0."""
    if not isinstance(data, Mapping):
        raise TopologyError(f"{where}({data!r}) must be a table of group size -> seconds")
    out: Dict[int, float] = {}
    for n, t in data.items():
        try:
            size = int(n)
        except (TypeError, ValueError):
            size = 0
        if size < 1 or str(size) != str(n).strip():
            raise TopologyError(f"{where}: group size {n!r} must be an integer >= 1")
        out[size] = _check_number(f"{where} at {size} ranks", t, "seconds", allow_zero=False)
    return out


def load(path: Union[str, Path]) -> Topology:
    """Read a topology from a ``.json`` or ``.toml`` file, or a shipped one by bare name."""
    p = Path(path)
    if not p.exists() and p.suffix == "" and p.parent == Path("."):
        shipped = TOPOLOGY_DIR / f"{p.name}.json"
        if shipped.exists():
            p = shipped
    if not p.exists():
        names = sorted(f.stem for f in TOPOLOGY_DIR.glob("*.json"))
        raise TopologyError(f"topology file {str(path)!r} does not exist (shipped: {', '.join(names)})")
    if p.is_dir():
        raise TopologyError(f"topology {str(path)!r} is a directory, expected a .json or .toml file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"topology file {str(path)!r} cannot be read: {exc}") from None
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(f"{p}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    elif p.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise TopologyError(f"{p}: reading TOML needs Python >= 3.11 (tomllib); use a .json file") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise TopologyError(f"{p}: not valid TOML: {exc}") from None
    else:
        raise TopologyError(f"{p}: unknown topology file type {p.suffix!r}; expected .json or .toml")
    return from_dict(data, source=str(p))
