"""A machine's agent speaks for its ranks: their heartbeats, hangs and the step's vote.

The rank's side and the wire are in :mod:`pitstop.runtime.local`. Here::

    ranks of machine k ──unix socket──> LocalHub (a thread of the agent)
                                          beats: a rank silent for the heartbeat timeout
                                                 -> on_hung(slot, silent_s)  (the agent reports it)
                                          arrivals of (g, s): once every rank of this machine
                                          that plays a role in g arrived (or died)
                                                 -> one task: add(arrive(g, s), k);
                                                    the job's last arrival settles the slot (as
                                                    :class:`pitstop.runtime.vote.Vote` does),
                                                    any other waits for it;
                                                    then "verdict g s <sealed>" to each of them
                                          a poisoned arrival -> on_poison(g, s)
                                          one wait per machine on ended(g) (the controller
                                          wrote generation g's fault or drain)
                                                 -> "ended g" to each rank that plays a
                                                    role in g (it then looks at the store)

The end of a generation reaches a machine through one store wait, not one per rank: at 8,192
ranks the store's server held 8,192 waits on the same key and one connection each for them,
and woke 8,192 threads at once when a fault was written. The line carries no trust: a rank
only reads the sealed fault and drain keys when it hears it, so a false one costs a look.

A rank that arrives after its machine's batch went (a joiner still rebuilding, a stayer
still in the last generation) is added on its own: the job's count is right either way, the
store only sees a second add. Every connection proves the job token (a sealed nonce); any
other, and any line that does not parse, is refused by name and never acted on.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from pitstop import protocol
from pitstop.launch.remote import Lookout
from pitstop.protocol import Channel, Refused, Verdict
from pitstop.runtime import keys
from pitstop.runtime.local import MAX_LINE, address, auth_key
from pitstop.runtime.vote import settle_last

log = logging.getLogger(__name__)

HELLO_S = 10.0


@dataclass
class _Conn:
    sock: socket.socket
    nonce: bytes
    opened: float
    buf: bytes = b""
    slot: Optional[int] = None
    """Set once the hello verified."""
    role: Optional[int] = None
    gen: int = 0
    last_beat: float = 0.0
    beating: bool = False
    """It has beaten once (admitted by the controller)."""
    hung: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Lines to the rank go from several threads (the vote's workers, the end-of-generation watch)."""


@dataclass
class _Batch:
    world: int
    mode: str = "now"
    members: Set[int] = field(default_factory=set)
    pending: Set[int] = field(default_factory=set)
    raw: Optional[bytes] = None
    waiting: bool = False
    """A wait for the slot was started (one per step, whatever the number of adds)."""
    created: float = field(default_factory=time.monotonic)


class LocalHub:
    """The agent's side (see the module docstring). ``open_store`` gives each vote worker a
    store connection of its own; ``blocking_get``: the store's ``get`` waits for a missing key
    (``TCPStore``), so waiting for the verdict costs one operation, not a wait and a get."""

    #: How long a rank may stay silent before its first beat: the bound of its authentication
    #: (``worker._authenticate``'s 120 s), after which it has given up anyway.
    FIRST_BEAT_S = 120.0

    def __init__(self, name: str, token, open_store: Callable[[], Any], heartbeat_timeout_s: float,
                 on_hung: Callable[[int, float], None], on_poison: Callable[[int, int], None] = lambda g, s: None,
                 blocking_get: bool = False, vote_timeout_s: float = 600.0,
                 on_said: Callable[[int], None] = lambda slot: None,
                 open_watch_store: Optional[Callable[[], Any]] = None) -> None:
        self.name = name
        self.token = token.encode() if isinstance(token, str) else bytes(token)
        self.open_store = open_store
        self.timeout_s = heartbeat_timeout_s
        self.on_hung, self.on_poison, self.on_said = on_hung, on_poison, on_said
        self.blocking_get = blocking_get
        self.vote_timeout_s = vote_timeout_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address(name))
        self.sock.listen(256)
        self.sock.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ)
        self.conns: Dict[socket.socket, _Conn] = {}
        self.batches: Dict[Tuple[int, int], _Batch] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        # adds are quick and go in order; a wait for a slot blocks, so it has a pool of its own
        # (one wait per step in flight: an add queued behind blocked waits would never be sent)
        self._adds = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pitstop-hub-add")
        self._waits = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pitstop-hub-wait")
        self._stop = threading.Event()
        self.refused = 0
        self._lookout = Lookout(0.5)
        self._thread = threading.Thread(target=self._run, name="pitstop-hub", daemon=True)
        self.open_watch_store = open_watch_store or open_store
        self._ended_watch: Any = None
        self.fired = -1
        """The last generation whose end this machine's ranks were told of."""
        self._watching = 0

    @staticmethod
    def new_name(node: int) -> str:
        return f"@pitstop-{os.getpid()}-{node}-{secrets.token_hex(4)}"

    def start(self) -> "LocalHub":
        self._thread.start()
        from pitstop.runtime.worker import KeyWatch

        conn = self.open_watch_store()
        ch = Channel(conn, self.token, lambda k, r: log.warning("refused %s: %s", k, r))
        self._ended_watch = KeyWatch(f"ended-{self.name}", self._ended_key, self._on_ended, ch,
                                     protocol.STAMP, conn).start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._ended_watch is not None:
            self._ended_watch.stop()
        self._adds.shutdown(wait=False, cancel_futures=True)
        self._waits.shutdown(wait=False, cancel_futures=True)
        for s in list(self.conns):
            s.close()
        self.sock.close()

    # ------------------------------------------------------------------ the socket loop
    def _refuse(self, c: _Conn, why: str, close: bool = True) -> None:
        self.refused += 1
        log.warning("refused a local line (slot %s): %s", c.slot, why)
        if close:
            _send(c.sock, f"refused {why[:200]}\n".encode(), 0.1)
            self._drop(c.sock)

    def _drop(self, s: socket.socket) -> None:
        c = self.conns.pop(s, None)
        try:
            self.sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()
        if c is not None and c.slot is not None:
            with self._lock:
                keys_ = list(self.batches)
            for k in keys_:
                self._maybe_flush(k)

    def _run(self) -> None:
        last_look = 0.0
        while not self._stop.is_set():
            try:
                events = self.sel.select(0.25)
            except (OSError, ValueError):
                return
            for key, _ in events:
                s = key.fileobj
                if s is self.sock:
                    self._accept()
                else:
                    self._read(s)
            now = time.monotonic()
            if now - last_look >= 0.1:
                last_look = now
                self._look(now)

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            nonce = secrets.token_hex(16).encode()
            try:
                s.sendall(b"nonce " + nonce + b"\n")
            except OSError:
                s.close()
                continue
            s.setblocking(False)
            self.conns[s] = _Conn(s, nonce, time.monotonic())
            self.sel.register(s, selectors.EVENT_READ)

    def _read(self, s: socket.socket) -> None:
        c = self.conns.get(s)
        if c is None:
            return
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(s)
            return
        c.buf += data
        while b"\n" in c.buf and s in self.conns:
            line, c.buf = c.buf.split(b"\n", 1)
            self._line(c, line)
        if len(c.buf) > MAX_LINE and s in self.conns:
            self._refuse(c, f"a line over {MAX_LINE} bytes")

    def _line(self, c: _Conn, line: bytes) -> None:
        words = line.split()
        if c.slot is None:
            self._hello(c, words)
            return
        try:
            if words[:1] == [b"beat"] and len(words) == 2:
                int(words[1])
                c.last_beat, c.hung, c.beating = time.monotonic(), False, True
            elif words == [b"said"]:
                self.on_said(c.slot)
            elif words[:1] == [b"role"] and len(words) == 3:
                c.role, c.gen = int(words[1]), int(words[2])
                if c.role < 0 or c.gen < 0:
                    raise ValueError("negative")
            elif words[:1] == [b"arrive"] and len(words) == 5:
                mode = words[3].decode()
                if mode not in ("now", "ahead", "switch"):
                    raise ValueError(f"mode {mode!r}")
                self._arrive(c, int(words[1]), int(words[2]), mode, int(words[4]))
            elif words[:1] == [b"poisoned"] and len(words) == 3:
                g, st = int(words[1]), int(words[2])
                self.on_poison(g, st)
                self._arrive(c, g, st, "now", None)
            else:
                raise ValueError("expected said, beat, role, arrive or poisoned")
        except (ValueError, UnicodeDecodeError) as exc:
            self._refuse(c, f"{line[:60]!r}: {exc}", close=False)

    def _hello(self, c: _Conn, words: List[bytes]) -> None:
        if len(words) != 5 or words[0] != b"hello" or not words[1].isdigit() or not words[3].isdigit():
            self._refuse(c, "expected 'hello <slot> <role|-> <generation> <seal>'")
            return
        slot = int(words[1])
        try:
            got = protocol.open_raw(self.token, auth_key(slot), words[4], 256)
        except Refused as exc:
            self._refuse(c, f"its hello does not prove the job token ({exc.reason})")
            return
        if got != c.nonce:
            self._refuse(c, "its hello is sealed for another nonce (a replay)")
            return
        if any(o.slot == slot for o in self.conns.values() if o is not c):
            self._refuse(c, f"slot {slot} has a line already")
            return
        c.slot, c.last_beat = slot, time.monotonic()
        c.role = None if words[2] == b"-" else int(words[2])
        c.gen = int(words[3])
        if not _send(c.sock, b"ok\n"):
            self._drop(c.sock)

    def _look(self, now: float) -> None:
        blind = self._lookout.look(now)  # this thread did not run: that silence is not the ranks'
        for c in list(self.conns.values()):
            if blind > 0:
                c.last_beat = min(now, c.last_beat + blind)
            if c.slot is None:
                if now - c.opened > HELLO_S:
                    self._refuse(c, f"no hello within {HELLO_S:.0f}s")
                continue
            silent = now - c.last_beat
            # before its first beat a rank is still saying hello to the controller (its heartbeat
            # starts once admitted, and admission waits on the controller): it has the
            # authentication's bound, not the heartbeat timeout
            limit = self.timeout_s if c.beating else max(self.timeout_s, self.FIRST_BEAT_S)
            if not c.hung and silent > limit:
                c.hung = True
                self.on_hung(c.slot, silent)
        with self._lock:  # batches whose verdict went out a while ago
            for k in [k for k, b in self.batches.items() if b.raw is not None and now - b.created > 60]:
                del self.batches[k]

    # ------------------------------------------------------------------ the end of a generation
    def _ended_key(self) -> str:
        """The end this machine waits for: that of the oldest generation one of its ranks plays a
        role in, and never one it has told of already (a joiner machine starts past 0; the walk
        over older ends, if any, is one store round trip each)."""
        gens = [c.gen for c in list(self.conns.values()) if c.slot is not None and c.role is not None]
        self._watching = max(self.fired + 1, min(gens) if gens else 0)
        return keys.ended(self._watching)

    def _on_ended(self, _ch: Channel) -> None:
        """``ended(g)`` was written and verified: tell each rank that plays a role in ``g``."""
        g = self._watching
        self.fired = max(self.fired, g)
        line = b"ended %d\n" % g
        for c in list(self.conns.values()):
            if c.slot is not None and c.role is not None and c.gen <= g:
                self._send_to(c, line)

    # ------------------------------------------------------------------ the vote
    def _arrive(self, c: _Conn, g: int, st: int, mode: str, world: Optional[int]) -> None:
        c.gen = g
        key = (g, st)
        with self._lock:
            b = self.batches.get(key)
            if b is None:
                b = self.batches[key] = _Batch(world or 0, mode)
            if world:
                b.world = world
            if mode == "switch":
                b.mode = "switch"
            elif mode == "ahead" and b.mode == "now":
                b.mode = "ahead"
            if c.slot in b.members:
                return
            b.members.add(c.slot)
            raw = b.raw
            if raw is None:
                b.pending.add(c.slot)
        if raw is not None:  # settled already: this late one hears at once
            self._send_verdict(c.slot, g, st, raw)
            return
        self._maybe_flush(key)

    def _maybe_flush(self, key: Tuple[int, int]) -> None:
        g = key[0]
        with self._lock:
            b = self.batches.get(key)
            if b is None or not b.pending or b.raw is not None:
                return
            # every rank of this machine that plays a role and has not moved past g: a stayer still
            # in the last generation arrives at g too (it has not told its generation yet)
            expected = {c.slot for c in self.conns.values() if c.slot is not None and c.role is not None and c.gen <= g}
            if not expected <= b.members:
                return
            n, b.pending = len(b.pending), set()
        if self._stop.is_set():  # closed: the machine is leaving
            return
        try:
            self._adds.submit(self._settle, key, n)
        except RuntimeError:  # shut down meanwhile
            return

    def _store(self):
        st = getattr(self._local, "store", None)
        if st is None:
            st = self._local.store = self.open_store()
            self._local.ch = Channel(st, self.token, lambda k, r: log.warning("refused %s: %s", k, r))
        return st, self._local.ch

    def _settle(self, key: Tuple[int, int], n: int) -> None:
        """One machine's arrivals at the job's counter: the job's last settles the slot and relays
        it; otherwise the first add of the step starts the one wait for it (:meth:`_wait`)."""
        g, st = key
        try:
            _, ch = self._store()
            with self._lock:
                b = self.batches[key]
                world, mode = b.world, b.mode
            name = ch.private(keys.verdict(g, st))
            if ch.add(keys.arrive(g, st), n) != world:
                with self._lock:
                    start, b.waiting = not b.waiting and b.raw is None, True
                if start and not self._stop.is_set():
                    try:
                        self._waits.submit(self._wait, key)
                    except RuntimeError:  # shut down meanwhile
                        pass
                return
            # the job's last arrival settles the slot as the last rank would; the verdict that holds
            # is relayed as the slot's bytes (sealing is deterministic: the same message, the same bytes)
            raw = protocol.seal(self.token, name, {"verdict": settle_last(ch, g, st, mode)})
        except Exception as exc:  # noqa: BLE001 - the ranks time out and poison the step themselves
            log.warning("the vote of g%d step %d: %s", g, st, str(exc).splitlines()[0][:200] if str(exc) else exc)
            return
        self._relay(key, raw)

    def _wait(self, key: Tuple[int, int]) -> None:
        """Wait for the slot of ``key`` (settled by another machine's last add, a poisoned rank or
        the controller), then relay it."""
        g, st = key
        try:
            store, ch = self._store()
            name = ch.private(keys.verdict(g, st))
            if not self.blocking_get:
                from datetime import timedelta

                store.wait([name], timedelta(seconds=self.vote_timeout_s))
            raw = store.get(name)
        except Exception as exc:  # noqa: BLE001 - the ranks time out and poison the step themselves
            log.warning("the vote of g%d step %d: %s", g, st, str(exc).splitlines()[0][:200] if str(exc) else exc)
            return
        self._relay(key, raw)

    def _relay(self, key: Tuple[int, int], raw: bytes) -> None:
        g, st = key
        with self._lock:
            b = self.batches.get(key)
            if b is None:
                return
            if b.raw is None:
                b.raw = bytes(raw)
            raw, members = b.raw, list(b.members)
        for slot in members:
            self._send_verdict(slot, g, st, raw)

    def _send_verdict(self, slot: int, g: int, st: int, raw: bytes) -> None:
        line = b"verdict %d %d " % (g, st) + base64.b64encode(raw) + b"\n"
        for c in list(self.conns.values()):
            if c.slot == slot:
                self._send_to(c, line)

    @staticmethod
    def _send_to(c: _Conn, line: bytes) -> bool:
        with c.lock:  # whole lines: two threads' sends never interleave on one socket
            return _send(c.sock, line)


def _send(s: socket.socket, data: bytes, timeout_s: float = 5.0) -> bool:
    """Write all of ``data`` to a non-blocking socket (the hub's thread reads it meanwhile), waiting
    for room at most ``timeout_s``; False if it could not."""
    import select

    deadline = time.monotonic() + timeout_s
    view = memoryview(data)
    while view:
        try:
            view = view[s.send(view):]
        except (BlockingIOError, InterruptedError):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            p = select.poll()
            p.register(s, select.POLLOUT)
            p.poll(int(left * 1000))
        except OSError:
            return False
    return True
