"""A rank's line to its own machine's agent: the heartbeat and the step's vote, off the store.

::

    rank (this module)                      its machine's agent (pitstop.launch.hub)
      connect @pitstop-<job>-<node>  ---->  "nonce <hex>"
      "hello <slot> <role|-> <g> <seal>" -> verified: seal_raw(token, "local/<slot>", nonce)
                                     <----  "ok"
      "said"                         ---->  its sealed hello is in the store: the controller reads it
      "beat <n>", every interval     ---->  silent for the heartbeat timeout: reported hung
      "role <r> <g>"                 ---->  a standby that took a role (it votes from now on)
      "arrive <g> <s> <mode> <world>" --->  when every role of this machine arrived: one add
      "poisoned <g> <s>"             ---->    to the job's counter for all of them, then one
                                     <----  "verdict <g> <s> <b64 sealed slot>"  (a wait for the slot)
                                     <----  "ended <g>": generation g ended (one store wait per
                                            machine); the rank looks at the sealed fault and
                                            drain keys (its session's look), as a wait of its
                                            own on ended(g) did

The store then sees the vote once per machine, not once per rank, and no heartbeat at all:
a job of 1,024 machines of 8 ranks costs it 1,024 adds and 1,024 waits a step, not 8,192 of
each plus 8,192 reads. The verdict travels as the slot's sealed bytes: the rank opens them with
the job token, so the line adds no trust of its own (a process squatting the agent's socket
name can delay a verdict, not forge one). A poisoned rank still settles the job's slot itself,
at once, before it tells its agent. The agent is the machine: a rank dies with it
(``PR_SET_PDEATHSIG``), so a rank never outlives its line.
"""

from __future__ import annotations

import base64
import logging
import os
import selectors
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from pitstop import protocol
from pitstop.errors import PitstopError
from pitstop.protocol import Refused, Verdict
from pitstop.runtime import keys
from pitstop.runtime.vote import Vote

log = logging.getLogger(__name__)

#: The environment variable that names the agent's socket (``@name``: Linux's abstract namespace).
ENV_AGENT_SOCK = "PITSTOP_AGENT_SOCK"
#: The longest line either side sends (a verdict's sealed slot, base64: ~2.3 KB at most).
MAX_LINE = 8192


def address(name: str) -> str:
    """The ``AF_UNIX`` address of ``name``: ``@x`` is ``\\0x`` (abstract, no file to clean up)."""
    return "\0" + name[1:] if name.startswith("@") else name


def auth_key(slot: int) -> str:
    """What a rank's hello is sealed for: its slot (a hello replayed for another slot fails)."""
    return f"local/{slot}"


class LocalLink:
    """The rank's end (see the module docstring). ``send`` is thread-safe (the heartbeat, the
    training thread and the pipeline's vote thread share it); a reader thread files verdicts."""

    def __init__(self, name: str, slot: int, role: Optional[int], generation: int, token,
                 timeout_s: float = 30.0, reader: Optional["LineReader"] = None) -> None:
        tok = token.encode() if isinstance(token, str) else bytes(token)
        self.slot = slot
        self.closed = False
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._verdicts: Dict[Tuple[int, int], bytes] = {}
        self.ended = -1
        """The newest generation whose end the agent told of."""
        self._on_ended: List[Callable[[int], None]] = []
        self._ended_wake = threading.Event()
        self._looker: Optional[threading.Thread] = None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        try:
            s.connect(address(name))
            self._buf = b""
            first = self._line(s)
            if not first.startswith(b"nonce "):
                raise PitstopError(f"the machine's agent at {name} sent {first[:40]!r}, expected a nonce")
            seal = protocol.seal_raw(tok, auth_key(slot), first[6:])
            s.sendall(f"hello {slot} {'-' if role is None else role} {generation} ".encode() + seal + b"\n")
            got = self._line(s)
            if got != b"ok":
                raise PitstopError(f"the machine's agent at {name} refused slot {slot}: {got[:200].decode(errors='replace')}")
        except (OSError, PitstopError) as exc:
            s.close()
            raise PitstopError(f"no line to this machine's agent at {name!r} ({exc})") from None
        s.settimeout(None)
        self.sock = s
        self._shared = reader
        if reader is not None:
            reader.add(self)
            return
        self._reader = threading.Thread(target=self._read, name=f"pitstop-local-{slot}", daemon=True)
        self._reader.start()

    def _line(self, s: socket.socket) -> bytes:
        while b"\n" not in self._buf:
            data = s.recv(4096)
            if not data or len(self._buf) > MAX_LINE:
                raise PitstopError("the agent closed the line")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def send(self, line: str) -> bool:
        """Send one line; False once the agent is gone."""
        if self.closed:
            return False
        try:
            with self._lock:
                self.sock.sendall(line.encode() + b"\n")
            return True
        except OSError:
            self._close()
            return False

    def _close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def _read(self) -> None:
        """The reader thread of a link that has one: what arrives goes to :meth:`feed`."""
        try:
            ok = self.feed(b"")  # lines that came with the handshake's
            while ok:
                data = self.sock.recv(4096)
                ok = bool(data) and self.feed(data)
        except OSError:
            pass
        self._close()

    def feed(self, data: bytes) -> bool:
        """Take bytes read from the agent: file each whole line. False when a line outgrows
        :data:`MAX_LINE` (the agent is not speaking this protocol: the caller closes the link)."""
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self._handle(line)
        return len(self._buf) <= MAX_LINE

    def _handle(self, line: bytes) -> None:
        words = line.split()
        if len(words) == 4 and words[0] == b"verdict" and words[1].isdigit() and words[2].isdigit():
            try:
                raw = base64.b64decode(words[3], validate=True)
            except ValueError:
                log.warning("[slot %d] refused a verdict line from the agent: not base64", self.slot)
                return
            with self._cond:
                self._verdicts[(int(words[1]), int(words[2]))] = raw
                if len(self._verdicts) > 256:  # old steps: nobody waits for them any more
                    for k in sorted(self._verdicts)[:128]:
                        del self._verdicts[k]
                self._cond.notify_all()
        elif len(words) == 2 and words[0] == b"ended" and words[1].isdigit():
            self.ended = max(self.ended, int(words[1]))
            self._wake_looker()
        else:
            log.warning("[slot %d] refused a line from the agent: %r", self.slot, line[:60])

    def on_ended(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(g)`` on a thread of its own each time the agent says a generation
        ended (several lines while it runs: one more call). Registered after such a line came,
        it is called once at once: what it looks at decides whether anything ended for it."""
        with self._cond:
            self._on_ended.append(callback)
        if self.ended >= 0:
            self._wake_looker()

    def _wake_looker(self) -> None:
        """Run the callbacks on a thread that lives only while there is something to look at:
        an idle thread per rank for an event of each generation was 8,192 threads at 8,192
        ranks, held for nothing."""
        with self._cond:
            self._ended_wake.set()
            if self._looker is not None or not self._on_ended:
                return
            self._looker = threading.Thread(target=self._look_loop, name=f"pitstop-ended-{self.slot}", daemon=True)
            self._looker.start()

    def _look_loop(self) -> None:
        while True:
            with self._cond:
                if not self._ended_wake.is_set() or self.closed:
                    self._looker = None
                    return
                self._ended_wake.clear()
                callbacks = list(self._on_ended)
            for cb in callbacks:
                try:
                    cb(self.ended)
                except Exception as exc:  # noqa: BLE001 - the heartbeat's look covers the same ground
                    log.warning("[slot %d] the look after generation %d ended: %s", self.slot, self.ended,
                                str(exc).splitlines()[0][:200] if str(exc) else exc)

    def verdict(self, gen: int, step: int, timeout_s: float) -> Optional[bytes]:
        """The sealed slot of ``(gen, step)`` as the agent relayed it; None at the timeout or once
        the agent is gone."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (gen, step) not in self._verdicts:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self._cond.wait(left)
            return self._verdicts[(gen, step)]

    def close(self) -> None:
        self._close()
        try:  # shutdown first: a close alone leaves the reader thread's recv holding the socket open
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._shared is not None:  # the shared reader sees the end, unregisters, then closes it
            return
        try:
            self.sock.close()
        except OSError:
            pass


class LineReader:
    """One thread that reads the lines of many :class:`LocalLink` objects.

    A worker process has one link and reads it on a thread of its own. The scale harness
    (:mod:`pitstop.bench.scale_sim`) runs hundreds of simulated ranks in a process: a reader
    thread each was 8,192 threads at 8,192 ranks, and every thread takes a pid (this host's
    ``kernel.pid_max`` is 32,768). Each link's bytes still go through its own
    :meth:`LocalLink.feed`, the code a worker's reader runs::

        LineReader thread: epoll over every link's socket
            readable -> recv -> link.feed(data) -> its verdicts, its "ended" looks
            end      -> unregister, close the socket, the link is closed
    """

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._new: List[LocalLink] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="pitstop-local-reader", daemon=True)
        self._thread.start()

    def add(self, link: LocalLink) -> None:
        """Read ``link`` from now on (registered by the reader's own thread: a selector is not
        shared across threads)."""
        with self._lock:
            self._new.append(link)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: the reader wakes anyway
            pass

    def _run(self) -> None:
        while True:
            for key, _ in self.sel.select():
                link = key.data
                if link is None:
                    self._register()
                    continue
                try:  # the socket stays blocking for the link's senders
                    data = link.sock.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data or not link.feed(data):
                    self.sel.unregister(link.sock)
                    link._close()
                    try:
                        link.sock.close()
                    except OSError:
                        pass

    def _register(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        with self._lock:
            new, self._new = self._new, []
        for link in new:
            self.sel.register(link.sock, selectors.EVENT_READ, link)
            if not link.feed(b""):  # lines that came with the handshake's
                self.sel.unregister(link.sock)
                link._close()


class LocalVote(Vote):
    """The vote through the machine's agent (see the module docstring): what :class:`Vote`
    decides, with the arrival batched per machine and the verdict relayed."""

    def __init__(self, ch: protocol.Channel, store, world_size: int, fence, timeout_s: float,
                 link: LocalLink) -> None:
        super().__init__(ch, store, world_size, fence, timeout_s)
        self.link = link

    def tell_poisoned(self, gen: int, step: int, rank: int) -> None:
        super().tell_poisoned(gen, step, rank)
        self.link.send(f"poisoned {gen} {step}")

    def __call__(self, gen: int, step: int, rank: int, poisoned: bool, mode: str = "now",
                 why: Optional[str] = None) -> str:
        if mode not in self.MODES:
            raise ValueError(f"vote mode {mode!r}: expected one of {', '.join(self.MODES)}")
        vk = keys.verdict(gen, step)
        if poisoned:  # settled by this rank itself, at once; the agent counts it as arrived
            got = self.ch.vote(vk, Verdict.poisoned(rank, why or self.why()))
            self.link.send(f"poisoned {gen} {step}")
            return got
        if not self.link.send(f"arrive {gen} {step} {mode} {self.world_size}"):
            return Verdict.poisoned(None, "this machine's agent is gone")
        raw = self.link.verdict(gen, step, self.timeout_s)
        if raw is None:
            return Verdict.poisoned(None, f"no verdict from this machine's agent within {self.timeout_s:.0f}s")
        name = self.ch.private(vk)
        try:
            return protocol.open_(self.ch.token, name, raw, protocol.VOTE)["verdict"]
        except Refused as exc:
            self.ch.refuse(name, f"relayed by the agent: {exc.reason}", raw)
            return Verdict.poisoned(None, "the verdict does not verify")
