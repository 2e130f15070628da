"""The fault injector: kill (or stop) the process of rank r at step s in phase p, with a real signal.

Fluent form, for tests and benchmarks::

    Fault.kill(rank=5).at(step=3, phase="backward").env()   # {"PITSTOP_FAULT": "..."}
    Fault.stop(rank=2).at(step=4, phase="optimizer")        # SIGSTOP: a hang

The worker runtime reads ``PITSTOP_FAULT`` and arms hooks on the real model and
optimizer. Only the process that first plays the role fires it: a joiner that
redoes the step does not die again.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Dict, List

from pitstop.errors import ConfigError

ENV_FAULT = "PITSTOP_FAULT"

#: Phases of one training step, in order. ``param-gather`` is the distributed
#: optimizer's all-gather of updated parameters, inside ``optimizer.step()``.
STEP_PHASES = ("forward", "backward", "grad-reduce", "optimizer", "param-gather")
#: ``committed``: at the boundary, after the vote made the step final and before ``commit``
#: hands its report back: the process dies with a final step it never logged.
PHASES = STEP_PHASES + ("committed",)
_SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM}


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    rank: int
    step: int = 1
    phase: str = "forward"
    sig: str = "KILL"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ConfigError(f"fault phase {self.phase!r} unknown; phases are {', '.join(PHASES)}")
        if self.sig not in _SIGNALS:
            raise ConfigError(f"fault signal {self.sig!r} unknown; signals are {', '.join(_SIGNALS)}")
        if self.rank < 0 or self.step < 1:
            raise ConfigError(f"fault rank({self.rank}) must be >= 0 and step({self.step}) >= 1")

    @classmethod
    def kill(cls, rank: int) -> "Fault":
        return cls(rank)

    @classmethod
    def stop(cls, rank: int) -> "Fault":
        return cls(rank, sig="STOP")

    def at(self, step: int, phase: str = "forward") -> "Fault":
        return Fault(self.rank, step, phase, self.sig)

    def spec(self) -> str:
        return f"rank={self.rank},step={self.step},phase={self.phase},signal={self.sig}"

    def env(self) -> Dict[str, str]:
        return {ENV_FAULT: self.spec()}

    @classmethod
    def parse(cls, text: str) -> "Fault":
        try:
            kv = dict(part.split("=", 1) for part in text.split(",") if part)
            unknown = sorted(set(kv) - {"rank", "step", "phase", "signal"})
            if unknown:
                raise KeyError(f"unknown key(s) {', '.join(unknown)}")
            return cls(int(kv["rank"]), int(kv.get("step", 1)), kv.get("phase", "forward"), kv.get("signal", "KILL"))
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"{ENV_FAULT}={text!r}: expected rank=R,step=S,phase=P[,signal=KILL|STOP] ({exc})"
            ) from None

    @classmethod
    def from_env(cls) -> List["Fault"]:
        """Every fault of ``PITSTOP_FAULT`` (several are separated by ``;``)."""
        return parse_all(os.environ.get(ENV_FAULT, ""))

    def __add__(self, other: "Fault") -> "Faults":
        return Faults((self, other))

    def fire(self) -> None:
        """Deliver the signal to this very process."""
        os.kill(os.getpid(), _SIGNALS[self.sig])


class Faults(tuple):
    """Several faults for one job (``Fault.kill(5).at(2) + Fault.kill(0).at(4, "optimizer")``)."""

    def __add__(self, other: "Fault") -> "Faults":
        return Faults(tuple(self) + (other,))

    def spec(self) -> str:
        return ";".join(f.spec() for f in self)

    def env(self) -> Dict[str, str]:
        return {ENV_FAULT: self.spec()}


def parse_all(text: str) -> List[Fault]:
    return [Fault.parse(part) for part in text.split(";") if part.strip()]
