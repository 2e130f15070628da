"""The worker side of ``pitstop emulate``: a real rank in a world of virtual ones.

``pitstop emulate`` starts each real rank with ``PITSTOP_EMULATE`` (JSON, see
:class:`EmulationConfig`). ``pitstop.runtime.worker.join`` then calls :func:`join`
instead of joining a controller: the default group and every group the registry
builds are ``pitstop_virtual`` groups (no world barrier, only this rank's groups, so
memory is O(its groups), not O(N)), answered by the hybrid oracle (real members
exchange real data, virtual members' contributions are synthesised). On top of it:

* phase ``trace``: a :class:`~pitstop.emulation.tracer.TracingOracle` writes the
  rank's timeline to ``<out>/traces/r<rank>.json`` at every iteration boundary;
* phase ``paced``: a :class:`~pitstop.emulation.tracer.PacingOracle` makes each
  operation return at its replayed end time (``<out>/schedules/r<rank>.json``);
* phase ``memory``: the tensor-memory tracker (:mod:`pitstop.memory`) counts
  every allocation of the program from before the model exists. A phase of its own:
  the tracker's cost must not reach the traced compute times or the paced ones.

Either way ``<out>/metrics/r<rank>.json`` gets the rank's measured iteration times
and memory at every boundary.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from pitstop.errors import ConfigError
from pitstop.runtime.worker import ENV_EMULATE  # the one definition of the variable's name

log = logging.getLogger(__name__)

PHASES = ("trace", "paced", "memory")


@dataclass(frozen=True)
class EmulationConfig:
    """What a real rank needs to know about the emulated job."""

    world_size: int
    tp: int
    pp: int
    real_ranks: List[int]
    """The ranks that run as processes in this phase (they exchange real data)."""
    phase: str
    """``trace``, ``paced`` or ``memory``."""
    out: str
    cp: int = 1
    ep: int = 1

    def to_env(self) -> Dict[str, str]:
        return {ENV_EMULATE: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> Optional["EmulationConfig"]:
        raw = os.environ.get(ENV_EMULATE)
        if not raw:
            return None
        try:
            cfg = cls(**json.loads(raw))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{ENV_EMULATE}={raw[:200]!r}: {exc}") from None
        if cfg.phase not in PHASES:
            raise ConfigError(f"{ENV_EMULATE}: phase {cfg.phase!r}; expected one of {', '.join(PHASES)}")
        return cfg


@dataclass
class _Active:
    cfg: EmulationConfig
    rank: int
    oracle: Any
    iter_s: List[float] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    rss0: int = 0
    setup_s: float = 0.0
    """Joining the virtual world (the default group)."""
    init: Dict[str, Any] = field(default_factory=dict)
    """The model-parallel initialisation: seconds from joining, RSS growth, groups built."""
    t_groups: Optional[float] = None
    """When the model-parallel groups were ready (``build_s`` counts from here)."""
    role: Dict[str, Any] = field(default_factory=dict)
    """What a replacement of this role would move and build: its state bytes, and the seconds
    from its groups being ready to its first step (model, optimizer, data)."""


ACTIVE: Optional[_Active] = None


def active() -> bool:
    return ACTIVE is not None


def join(cfg: EmulationConfig, rank: int) -> None:
    """Initialise torch.distributed as ``rank`` of a world of ``cfg.world_size`` virtual peers."""
    global ACTIVE
    import torch.distributed as dist

    from pitstop import virtual
    from pitstop.emulation.hybrid import HybridOracle, MirrorContributions
    from pitstop.layout import ParallelLayout
    from pitstop.store import connect_from_env

    t0, rss0 = time.perf_counter(), _rss_bytes()
    if cfg.phase == "memory":
        from pitstop import memory

        memory.start()  # before the model exists: every tensor of the program is counted
    layout = ParallelLayout(cfg.world_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep)
    store = connect_from_env()
    # a fresh key space per phase: both phases share the launcher's store
    oracle: Any = HybridOracle(cfg.real_ranks, rank, store, MirrorContributions(), prefix=f"pitstop-hybrid-{cfg.phase}")
    out = Path(cfg.out)
    if cfg.phase == "trace":
        from pitstop.emulation.tracer import TracingOracle

        oracle = TracingOracle(oracle, rank, layout.coords(rank)["pp"], layout.pp)
    elif cfg.phase == "paced":
        from pitstop.emulation.tracer import PacingOracle

        schedule = json.loads((out / "schedules" / f"r{rank}.json").read_text())
        oracle = PacingOracle(oracle, schedule)
    virtual.register()
    virtual.set_oracle(oracle)
    dist.init_process_group(virtual.VIRTUAL_BACKEND, store=dist.PrefixStore("pitstop/emulate", store),
                            rank=rank, world_size=cfg.world_size)
    ACTIVE = _Active(cfg, rank, oracle, t0=t0, rss0=rss0, setup_s=time.perf_counter() - t0)
    log.info("[emulate r%d] %s phase in a world of %d (%s); real ranks %s", rank, cfg.phase, cfg.world_size,
             layout.describe(), cfg.real_ranks)


def check_layout(layout) -> None:
    """The script's model parallel layout must be the one ``pitstop emulate`` was told."""
    cfg = ACTIVE.cfg if ACTIVE else None
    if cfg is None:
        return
    want = (cfg.world_size, cfg.tp, cfg.pp, cfg.cp, cfg.ep)
    got = (layout.world_size, layout.tp, layout.pp, layout.cp, layout.ep)
    if want != got:
        raise ConfigError(
            "the script's layout world_size/tp/pp/cp/ep = %s differs from pitstop emulate's %s: "
            "pass the same --tp/--pp (and --cp/--ep) to both" % ("/".join(map(str, got)), "/".join(map(str, want))))


def groups_ready(groups: int) -> None:
    """pitstop's ``initialize_model_parallel`` finished: note what the virtualised
    initialisation cost (from joining the world: seconds and resident memory)."""
    a = ACTIVE
    if a is not None and not a.init:
        a.t_groups = time.perf_counter()
        a.init = {"init_s": round(time.perf_counter() - a.t0, 4), "init_rss_bytes": _rss_bytes() - a.rss0,
                  "groups": groups}


def _rss_bytes() -> int:
    from pitstop.runtime.sandbox import rss_bytes

    return rss_bytes()


def boundary(iter_s: float, state_nbytes: Optional[Callable[[], int]] = None) -> None:
    """An iteration boundary of the real rank (called by the session with the iteration's
    loop-body time, measured as a real run's session measures it, and a function that returns
    the rank's state bytes, read once at the first boundary)."""
    a = ACTIVE
    if a is None:
        return
    if not a.iter_s:
        now = time.perf_counter()
        if a.t_groups is not None:
            a.role["build_s"] = round(now - iter_s - a.t_groups, 4)
        if state_nbytes is not None and a.cfg.phase != "memory":  # it reads the RNG states: tensors the
            a.role["state_bytes"] = int(state_nbytes())                # memory phase would count
    a.iter_s.append(iter_s)
    if a.cfg.phase != "memory":
        a.oracle.boundary()
    out = Path(a.cfg.out)
    if a.cfg.phase == "trace":
        _write(out / "traces" / f"r{a.rank}.json", a.oracle.trace(source=f"pitstop emulate, rank {a.rank}").to_json())
        _write(out / "traces" / f"r{a.rank}.measured.json", {"iterations": a.oracle.measured[1:]})
    from pitstop import memory

    metrics = {"rank": a.rank, "phase": a.cfg.phase, "iter_s": [round(x, 6) for x in a.iter_s],
               "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "setup_s": round(a.setup_s, 4),
               "peak_tensor_bytes": memory.peak_bytes(), **a.init, **a.role}
    if a.cfg.phase == "paced":
        metrics.update(slept_s=round(a.oracle.slept_s, 6), late_ops=a.oracle.late, late_total_s=round(a.oracle.late_s, 6),
                       overrun=a.oracle.overrun)
    _write(out / "metrics" / metrics_name(a.cfg.phase, a.rank), metrics)


def metrics_name(phase: str, rank: int) -> str:
    """``r5.json`` for the paced phase (the report's), ``trace-r5.json``, ``memory-r5.json``."""
    return f"r{rank}.json" if phase == "paced" else f"{phase}-r{rank}.json"


def _write(path: Path, data: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _join_hook(config) -> Optional["Any"]:
    """``pitstop.runtime.worker.join`` under ``pitstop emulate``: this process is a real rank of
    a world of virtual peers; its boundaries pace the emulator (:func:`boundary`)."""
    cfg = EmulationConfig.from_env()
    if cfg is None:
        return None
    import os

    from pitstop.runtime.worker import Membership

    rank = int(os.environ["RANK"])
    join(cfg, rank)
    return Membership(rank, int(os.environ["WORLD_SIZE"]), 0, "emulate", config=config, on_boundary=boundary)


def _register() -> None:
    from pitstop.runtime import worker

    worker.on_join(_join_hook)


_register()
