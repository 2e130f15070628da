"""The worker runtime's settings: one validated dataclass, passed to workers by environment.

The three timeouts must be ordered, because each catches what the one before
cannot::

    heartbeat_interval_s  <  heartbeat_timeout_s  <  collective_timeout_s
    (a beat every 0.5 s)     (no beat for 5 s: hung)  (a collective stuck 120 s:
                                                       the communicator gives up)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Dict, Mapping, Optional

from pitstop.errors import ConfigError

_ENV_PREFIX = "PITSTOP_"


@dataclass(frozen=True)
class RuntimeConfig:
    """What a pitstop worker needs to know besides its role."""

    heartbeat_interval_s: float = 0.5
    """How often a worker tells the controller it is alive."""
    heartbeat_timeout_s: float = 5.0
    """A worker silent this long is hung (e.g. SIGSTOP) and is treated as failed."""
    collective_timeout_s: float = 120.0
    """Timeout of every pitstop communicator; the last line of defence against a hang."""
    buddy: bool = True
    """Keep a CPU copy of a data-parallel neighbour's distributed-optimizer shard."""
    save_interval: int = 0
    """Save a Megatron dist_checkpointing checkpoint every K steps (0: never); the
    fallback when no standby is left."""
    save_dir: str = ""
    """Where checkpoints go (default: ``<run-dir>/checkpoints``)."""
    warmup: bool = True
    """Record each role class's first iteration at job start, and let standbys run a
    sandboxed iteration of every stage kind from those records before they are needed."""
    hold_for_warm_s: float = 0.0
    """After the recorded first step, hold training up to this long until every standby
    has finished its warmup (0: do not wait). For jobs that must not lose a worker to a
    cold standby, and for deterministic tests and benchmarks."""
    commit_interval: int = 1
    """Vote, take the rollback point and exchange the buddy copy every K steps, not every
    step. The boundaries in between cost nothing (no store, no copy); the price is a
    bounded rollback: a failure discards the steps since the last vote, at most K, and
    they are redone (bitwise, so the loss curve does not change). See :meth:`votes_at`."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            want = {"float": (int, float), "int": (int,), "bool": (bool,), "str": (str,)}[f.type if isinstance(f.type, str) else f.type.__name__]
            if isinstance(v, bool) and f.type != "bool":
                raise ConfigError(f"{f.name}={v!r}: expected {f.type}, got bool")
            if not isinstance(v, want):
                raise ConfigError(f"{f.name}={v!r}: expected {f.type}, got {type(v).__name__}")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}({getattr(self, name)}) must be > 0")
        if not self.heartbeat_interval_s < self.heartbeat_timeout_s < self.collective_timeout_s:
            raise ConfigError(
                "timeouts must be ordered heartbeat_interval_s < heartbeat_timeout_s < "
                f"collective_timeout_s, got {self.heartbeat_interval_s} < {self.heartbeat_timeout_s} "
                f"< {self.collective_timeout_s}"
            )
        if self.hold_for_warm_s < 0:
            raise ConfigError(f"hold_for_warm_s({self.hold_for_warm_s}) must be >= 0 (0: do not wait)")
        if self.save_interval < 0:
            raise ConfigError(f"save_interval({self.save_interval}) must be >= 0 (0 disables checkpoints)")
        if self.commit_interval < 1:
            raise ConfigError(f"commit_interval({self.commit_interval}) must be >= 1 (1: vote at every step)")

    # ------------------------------------------------------------------ the vote schedule
    def votes_at(self, step: int, last: int) -> bool:
        """Whether the boundary after ``step`` votes (of a loop that ends at ``last``).

        A pure function of the step and the settings, so every rank, a joiner and the
        controller agree on it without asking anyone::

            commit_interval 4, save_interval 6, last 10:
            step   1  2  3  4  5  6  7  8  9  10
            vote   *  .  .  *  .  *  .  *  .  *      (* votes; . costs nothing)
                 first      K     save  K     last

        Step 1 always votes (its record warms the standbys), and so does every checkpoint
        step (a checkpoint holds committed state only). Between two votes there are at
        most ``commit_interval`` steps, which bounds the rollback (:meth:`discard_window`).
        """
        k = self.commit_interval
        return (k == 1 or step % k == 0 or step == 1 or step >= last
                or (self.save_interval > 0 and step % self.save_interval == 0))

    def discard_window(self, last_committed: int) -> range:
        """The steps a failure after ``last_committed`` may discard: the next vote is at one of them."""
        return range(last_committed + 1, last_committed + self.commit_interval + 1)

    # ------------------------------------------------------------------ environment
    def to_env(self) -> Dict[str, str]:
        """``PITSTOP_HEARTBEAT_INTERVAL_S=0.5`` ... for the launcher to pass on."""
        return {_ENV_PREFIX + f.name.upper(): _fmt(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "RuntimeConfig":
        env = os.environ if env is None else env
        kw = {}
        for f in fields(cls):
            key = _ENV_PREFIX + f.name.upper()
            if key in env:
                kw[f.name] = _parse(key, env[key], f.type if isinstance(f.type, str) else f.type.__name__)
        return cls(**kw)

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], where: str = "pitstop config") -> "RuntimeConfig":
        """From a dict (e.g. a JSON section); unknown keys are refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys are {', '.join(sorted(known))}")
        return cls(**values)  # type: ignore[arg-type]


def _fmt(v: object) -> str:
    return ("1" if v else "0") if isinstance(v, bool) else str(v)


def _parse(key: str, text: str, typ: str):
    try:
        if typ == "bool":
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no", ""):
                return False
            raise ValueError(text)
        return {"float": float, "int": int, "str": str}[typ](text)
    except ValueError:
        raise ConfigError(f"{key}={text!r}: expected {typ}") from None
