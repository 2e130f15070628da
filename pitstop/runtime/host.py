"""What the session's pieces may read and call on the session that composes them.

::

    Session (the loop, the boundary)          pieces, each handed the session as a Host
      ├── ring      BuddyRing   buddy.py      rollback point and peer copy
      ├── vote      Vote        vote.py       the per-step verdict
      ├── recovery  Recovery    recovery.py   unplanned: fail fast, rollback, delta, state
      ├── drain     Drain       drain.py      planned: phase 1, the switch
      └── watcher   Watcher     watch.py      the heartbeat's look and the end-of-generation watch

The session owns the training objects (model, optimizer, data), the generation and the step
window; a piece owns only its own state (the drain in progress, the generation it aborted).
This protocol is the whole of a piece's reach into the session: a piece that needs more
adds it here, where a reader sees it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Protocol, Tuple

import torch.distributed as dist

from pitstop import pg as pgmod
from pitstop import protocol
from pitstop.layout import ParallelLayout
from pitstop.runtime.buddy import BuddyRing
from pitstop.runtime.config import RuntimeConfig
from pitstop.runtime.framework import Framework
from pitstop.runtime.state import Snapshot
from pitstop.runtime.worker import Membership


class Host(Protocol):
    rank: int
    layout: ParallelLayout
    cfg: RuntimeConfig
    m: Membership
    fw: Framework
    model: List[Any]
    optimizer: Any
    registry: Any
    fence: pgmod.Fence
    ring: BuddyRing
    gen: int
    stale_refs: List[Any]
    groups_lock: threading.Lock
    """Held while the groups change (a rollback, a switch): the heartbeat's fail-fast stays out."""

    @property
    def ch(self) -> protocol.Channel: ...

    @property
    def store(self) -> dist.Store: ...

    def prefix(self) -> str: ...

    def info(self, msg: str, *args: Any) -> None: ...

    def report(self, gen: int, who: str, **timings: float) -> None: ...

    def restore(self, snap: Snapshot) -> None: ...

    def advance(self, pending: Any) -> Tuple[Any, int]: ...

    def attach_world(self, seq: int) -> None: ...

    def take_redelivery(self, read: Callable[[], Optional[list]], where: str) -> None: ...

    def begin_at(self, step: int) -> None:
        """This process's loop starts at ``step`` (a joiner): the step and the data there."""

    def redo_from(self, step: int) -> None:
        """The window from ``step`` on was discarded: the loop yields ``step`` again."""
