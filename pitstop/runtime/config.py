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
from pitstop.settings import BY_FIELD, BY_KEY, check_all


def _d(field: str):
    return BY_FIELD[field].default


@dataclass(frozen=True)
class RuntimeConfig:
    """What a pitstop worker needs to know besides its role.

    The fields are the rows of :data:`pitstop.settings.SETTINGS` that the worker uses: their
    defaults, bounds, order and meaning live there (``tests/unit/test_settings.py`` holds the two
    together), and :meth:`__post_init__` checks with the same rows as every front door."""

    heartbeat_interval_s: float = _d("heartbeat_interval_s")
    heartbeat_timeout_s: float = _d("heartbeat_timeout_s")
    collective_timeout_s: float = _d("collective_timeout_s")
    buddy: bool = _d("buddy")
    save_interval: int = _d("save_interval")
    save_dir: str = _d("save_dir")
    warmup: bool = _d("warmup")
    hold_for_warm_s: float = _d("hold_for_warm_s")
    commit_interval: int = _d("commit_interval")
    async_commit: bool = _d("async_commit")

    def __post_init__(self) -> None:
        values = {BY_FIELD[f.name].key: getattr(self, f.name) for f in fields(self)}
        checked = check_all(values, where=lambda s: s.field)
        for f in fields(self):  # an int given for a float is kept as the float it means
            object.__setattr__(self, f.name, checked[BY_FIELD[f.name].key])

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
        """The steps a failure after ``last_committed`` may discard: the next vote is at one of them.

        With ``async_commit`` a rank runs one boundary past its vote before it reads the verdict,
        but that boundary reads it before it votes again: the window is the same."""
        return range(last_committed + 1, last_committed + self.commit_interval + 1)

    # ------------------------------------------------------------------ environment
    def to_env(self) -> Dict[str, str]:
        """``PITSTOP_HEARTBEAT_INTERVAL_S=0.5`` ... for the launcher to pass on."""
        return {BY_FIELD[f.name].env: _fmt(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "RuntimeConfig":
        env = os.environ if env is None else env
        kw = {}
        for f in fields(cls):
            s = BY_FIELD[f.name]
            if s.env in env:
                kw[f.name] = s.from_text(env[s.env], s.env)
        return cls(**kw)

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], where: str = "pitstop config") -> "RuntimeConfig":
        """From a dict (e.g. a JSON section); unknown keys are refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys are {', '.join(sorted(known))}")
        return cls(**values)  # type: ignore[arg-type]

    def settings(self) -> Dict[str, object]:
        """These values by setting key (``heartbeat_timeout``), as the other front doors name them."""
        return {BY_FIELD[f.name].key: getattr(self, f.name) for f in fields(self)}


def _fmt(v: object) -> str:
    return ("1" if v else "0") if isinstance(v, bool) else str(v)
