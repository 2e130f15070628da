"""The session's watchers: how a rank learns, off its training thread, that its generation ends.

::

    heartbeat thread (every heartbeat_interval_s) ─┐
    end-of-generation watch (blocks on ended(g), ──┴─> Watcher.look(ch)
      or, with a machine's agent, its "ended g" line)
                                                          ├─ Recovery.look: a fault? wake the waiter,
                                                          │                 mark the delta's groups broken
                                                          └─ Drain.look:    a drain? start phase 1

Two threads call the same look: the heartbeat's is the fallback, the watch on
``keys.ended(g)`` answers within a round trip of the controller's write, so a stayer blocked
in a collective on a dead peer is freed at once rather than at the next heartbeat.
"""

from __future__ import annotations

from typing import Optional

from pitstop import protocol
from pitstop.runtime import keys, worker
from pitstop.runtime.drain import Drain
from pitstop.runtime.host import Host
from pitstop.runtime.recovery import Recovery


class Watcher:
    """The session's piece that looks at the control store from other threads."""

    def __init__(self, host: Host, recovery: Recovery, drain: Drain) -> None:
        self.s = host
        self.recovery = recovery
        self.drain = drain
        self.end_watch: Optional[worker.KeyWatch] = None

    def start(self) -> "Watcher":
        """Register with the heartbeat and start the end-of-generation watch (a controlled rank)."""
        s = self.s
        if s.m.heartbeat is None:
            return self
        s.m.heartbeat.watchers.append(self.look)
        if s.m.local is not None:  # the machine's agent waits on ended(g) for its ranks and tells them
            hb = s.m.heartbeat
            s.m.local.on_ended(lambda _g: self.look(hb.channel))
            return self
        self.end_watch = worker.KeyWatch(f"ended-r{s.rank}", lambda: keys.ended(s.gen), self.look,
                                         s.ch, protocol.STAMP, s.m.take_connection()).start()
        return self

    def look(self, ch: protocol.Channel) -> None:
        gen = self.s.gen
        self.recovery.look(ch, gen)
        self.drain.look(ch, gen)
