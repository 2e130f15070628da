"""A standby replacement's downtime at target scale, predicted (``pitstop emulate --fault``).

Pure: no torch, no processes. The prediction walks the same path a real replacement takes
(``pitstop launch``'s controller and the runtime), costing each step with something measured
*somewhere else* than the run it predicts::

    kill ──detect──> controller ──plan──> verdict ─┬─ joiner builds its delta groups ─┐
                                                   └─ joiner builds model, optimizer ──┴─ state copy ── redone step ── commit
    detect  RecoveryCosts.detect_s   a real replacement's kill-to-detection (any world: it is the
                                      control plane's, not the job's)
    plan    RecoveryCosts.plan_s     that replacement's detection-to-verdict
    groups  the delta plan           every communicator holding the faulted role (plan_replace),
                                      each at Topology.group_build_cost(its size), one after another
                                      (the joiner builds them all; each stayer only its own)
    build   the emulated role        its seconds from groups ready to its first step (model,
                                      optimizer, data), measured on the emulated rank itself
    state   the emulated role        its shard bytes from the data-parallel peer that holds them,
                                      over the topology's point-to-point link between the two
    step    the replay               the faulted rank's replayed iteration (the step redone)

    downtime = detect + plan + max(groups, build) + state + step

The joiner builds its model while its groups rendezvous, hence the ``max``. A role with no
data-parallel peer (dp 1) has no peer copy: a replacement falls back to a checkpoint, which
this model does not predict; it says so instead of guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping

from pitstop.errors import ConfigError, EmulationError
from pitstop.layout import ParallelLayout
from pitstop.plan import plan_replace
from pitstop.emulation.topology import Topology


@dataclass(frozen=True)
class FaultSpec:
    """``rank=R,step=S``: rank R's machine is lost during step S."""

    rank: int
    step: int

    @classmethod
    def parse(cls, text: str, world_size: int) -> "FaultSpec":
        fields: Dict[str, str] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, eq, value = part.partition("=")
            if not eq or key.strip() not in ("rank", "step") or key.strip() in fields:
                raise ConfigError(f"--fault {text!r}: expected rank=R,step=S (each once), e.g. rank=5,step=4")
            fields[key.strip()] = value.strip()
        if set(fields) != {"rank", "step"}:
            raise ConfigError(f"--fault {text!r}: expected rank=R,step=S; missing {sorted({'rank', 'step'} - set(fields))}")
        try:
            rank, step = int(fields["rank"]), int(fields["step"])
        except ValueError:
            raise ConfigError(f"--fault {text!r}: rank and step must be integers") from None
        if not 0 <= rank < world_size:
            raise ConfigError(f"--fault {text!r}: rank({rank}) outside the world 0..{world_size - 1}")
        if step < 1:
            raise ConfigError(f"--fault {text!r}: step({step}) must be >= 1")
        return cls(rank, step)


@dataclass(frozen=True)
class RecoveryCosts:
    """The control plane's measured share of a replacement (see the module docstring)."""

    detect_s: float
    plan_s: float
    source: str = ""
    """Where they were measured (a run directory, a file)."""

    def __post_init__(self) -> None:
        for name in ("detect_s", "plan_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"recovery costs {self.source or ''}: {name}({v!r}) must be a finite number >= 0 (seconds)")

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "RecoveryCosts":
        """``{"detect_s": .., "plan_s": ..}``, or a ``replaced`` event of ``pitstop launch``'s event
        log (it has both, among others)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"recovery costs {source}: expected an object with detect_s and plan_s, got {type(data).__name__}")
        missing = [k for k in ("detect_s", "plan_s") if data.get(k) is None]
        if missing:
            raise ConfigError(f"recovery costs {source}: {', '.join(missing)} missing or null (a replacement whose "
                              "kill was not stamped by the fault injector has no detect_s)")
        return cls(data["detect_s"], data["plan_s"], source)

    def to_dict(self) -> Dict[str, Any]:
        return {"detect_s": self.detect_s, "plan_s": self.plan_s, "source": self.source}


def predict(layout: ParallelLayout, fault: FaultSpec, topology: Topology, costs: RecoveryCosts,
            state_bytes: int, build_s: float, step_s: float) -> Dict[str, Any]:
    """The predicted downtime of replacing ``fault.rank`` by a standby, with its breakdown.

    ``state_bytes``, ``build_s``: the faulted role's, measured on its emulated rank;
    ``step_s``: its replayed iteration time."""
    layout._check_rank(fault.rank)
    for name, v in (("state_bytes", state_bytes), ("build_s", build_s), ("step_s", step_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise EmulationError(f"predict: {name}({v!r}) must be a finite number >= 0")
    plan = plan_replace(layout, (fault.rank,))
    source = plan.param_sources[fault.rank]
    if source is None:
        raise EmulationError(
            f"rank {fault.rank} has no data-parallel peer (dp={layout.dp}): a replacement restores it from a "
            "checkpoint, which this model does not predict")
    sizes = [len(g.ranks) for g in plan.rebuilt]
    groups_s = sum(topology.group_build_cost(n) for n in sizes)
    state_s = topology.p2p_cost(source, fault.rank, int(state_bytes))
    downtime = costs.detect_s + costs.plan_s + max(groups_s, build_s) + state_s + step_s
    by_size: Dict[str, int] = {}
    for n in sizes:
        by_size[str(n)] = by_size.get(str(n), 0) + 1
    return {
        "world_size": layout.world_size,
        "layout": layout.describe(),
        "fault": {"rank": fault.rank, "step": fault.step},
        "predicted_downtime_s": round(downtime, 4),
        "breakdown": {
            "detect_s": round(costs.detect_s, 4),
            "plan_s": round(costs.plan_s, 4),
            "groups_s": round(groups_s, 4),
            "build_s": round(build_s, 4),
            "state_s": round(state_s, 4),
            "step_s": round(step_s, 4),
        },
        "groups_rebuilt": len(sizes),
        "groups_rebuilt_by_size": by_size,
        "state_bytes": int(state_bytes),
        "state_source_rank": source,
        "link": topology.link_class(source, fault.rank).name,
        "costs_from": costs.to_dict(),
        "topology": topology.name,
    }
