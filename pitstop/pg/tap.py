"""The recording tap: one hook that sees every operation of every guarded group and of
the world group. The warmup recorder (:mod:`pitstop.record`) sets it for one iteration;
the sandbox lifts it while its own work runs. Set it here (``pitstop.pg.tap.TAP = f``):
``pitstop.pg`` hands it out for reading only."""

from __future__ import annotations

from typing import Callable, Optional

#: A hook that sees every operation of every guarded group and of the world group:
#: ``TAP(kind, what, args)`` is called as an operation is issued and may return a
#: callable, called once the operation has completed. The warmup recorder
#: (:mod:`pitstop.record`) sets it for one iteration; otherwise it is None
#: and costs one attribute test per operation.
TAP: Optional[Callable[[str, str, tuple], Optional[Callable[[], None]]]] = None


def _tapped(kind: str, what: str, args: tuple) -> Optional[Callable[[], None]]:
    return TAP(kind, what, args) if TAP is not None else None
