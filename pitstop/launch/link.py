"""Each machine's agent holds one TCP connection to the controller, so its death is seen at once.

::

    agent k    --connect-->  the controller's link listener (address sealed under ctl/node/link)
               <-- nonce "\\n" --
               -- "k seal_raw(token, link/k, nonce)\\n" -->     verified: machine k's link
    then, both ways, short lines (printable ASCII, at most _MAX_LINE bytes, each ended by "\\n"):
               -- "<line>\\n" -->   LinkServer.poll(): inbox[k] += [line], last_seen[k] = now
               <-- "<line>\\n" --   LinkServer.send(k, line); the agent reads it with AgentLink.lines()
               -- "\\n" -->         an empty line: a keepalive (refreshes last_seen only)
    the agent SIGKILLed with its process group (a machine failure):
               the kernel closes its sockets -> EOF at the controller -> machine k lost, now
    the agent leaving at the job's end sends the line "bye" first: not a loss

A machine that loses power or its network sends nothing: the probe and the heartbeat
(:mod:`pitstop.launch.remote`) stay the paths for that. A connection that does not prove
the job token within :data:`HELLO_S`, sends junk, or claims a machine that has a link
already is refused (logged through ``on_refused``) and closed; it never counts as a link,
so it cannot take a machine down by closing. A junk line on a verified link (over
``_MAX_LINE`` bytes, or not printable ASCII) is refused by name and dropped; the link stays.

The token is proved once, at the hello: a line after it is as trustworthy as that TCP
connection (plain text, like the store's traffic). Whoever acts on lines parses each as
untrusted input.

The server waits on ``selectors`` (epoll), not ``select.select``, which refuses any
descriptor above 1,023: a controller of ~1,000 machines holds more. A :meth:`LinkServer.poll`
costs O(sockets with something to read), not O(links).
"""

from __future__ import annotations

import logging
import re
import secrets
import selectors
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

from pitstop.protocol import Refused, open_raw, seal_raw

log = logging.getLogger(__name__)

#: How long a new connection has to prove the token.
HELLO_S = 10.0
_MAX_LINE = 256
"""The longest line either side takes, its newline not counted (a hello is ~110 bytes)."""
_MAX_OUT = 64 * 1024
"""Bytes a side queues for a peer that does not read; a line past this is not sent (``False``)."""
_BACKLOG = 4096
"""Connections the kernel holds for :meth:`LinkServer.poll` to accept: every machine's agent may
connect at once when a job starts (Python's default, 128, would drop SYNs and cost 1 s retries)."""
BYE = b"bye\n"
_PRINTABLE = re.compile(rb"[\x20-\x7e]*")

_LISTENER = "listener"
_PENDING = "pending"


def _key(node: int) -> str:
    """What a link's hello is sealed for (:func:`pitstop.protocol.seal_raw`): one machine's nonce."""
    return f"link/{node}"


def _check_line(line: bytes) -> bytes:
    """``line`` if it may be sent (bytes, printable ASCII, no newline, at most ``_MAX_LINE``); ValueError if not."""
    if not isinstance(line, (bytes, bytearray)):
        raise ValueError(f"a link line is bytes, not {type(line).__name__}")
    if len(line) > _MAX_LINE or not _PRINTABLE.fullmatch(line):
        raise ValueError(f"a link line is printable ASCII of at most {_MAX_LINE} bytes: {bytes(line[:40])!r}")
    return bytes(line)


class _Lines:
    """A byte stream cut into lines: ``feed`` returns ``(line, why)`` pairs, ``why`` empty for a good
    line and naming the fault of a junk one (whose first bytes it then carries). An empty line is
    dropped (a keepalive); a line over ``_MAX_LINE`` is refused once and skipped to its newline."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.skipping = False

    def feed(self, data: bytes) -> List[Tuple[bytes, str]]:
        out: List[Tuple[bytes, str]] = []
        self.buf += data
        while True:
            i = self.buf.find(b"\n")
            if i < 0:
                if len(self.buf) > _MAX_LINE:
                    if not self.skipping:
                        out.append((bytes(self.buf[:40]), f"a line over {_MAX_LINE} bytes"))
                    self.skipping = True
                    self.buf.clear()
                return out
            line = bytes(self.buf[:i])
            del self.buf[:i + 1]
            if self.skipping:  # the tail of an over-long line, refused already
                self.skipping = False
            elif len(line) > _MAX_LINE:
                out.append((line[:40], f"a line over {_MAX_LINE} bytes"))
            elif not _PRINTABLE.fullmatch(line):
                out.append((line[:40], "a line that is not printable ASCII"))
            elif line:
                out.append((line, ""))


class LinkServer:
    """The controller's side: accept, verify, and report links that closed (:meth:`poll`).

    Besides what closed, :meth:`poll` collects what each link's agent sent: ``inbox[node]``, the
    complete lines not yet taken (:meth:`lines` takes them), and ``last_seen[node]``, the
    monotonic time of the last bytes received on the link (its hello at first). :meth:`send`
    writes a line to a machine. A link that closes leaves ``links`` and ``last_seen``; the lines
    it sent before closing stay in ``inbox`` until taken."""

    def __init__(self, host: str, token, on_refused: Optional[Callable[[str, str], None]] = None) -> None:
        self.token = token.encode() if isinstance(token, str) else bytes(token)
        self.sock = socket.create_server((host, 0), backlog=_BACKLOG)
        self.sock.setblocking(False)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.on_refused = on_refused or (lambda what, why: log.warning("refused %s: %s", what, why))
        self.pending: Dict[socket.socket, Tuple[str, float, bytes]] = {}
        """Connections not verified yet: (nonce, when accepted, bytes so far), oldest first."""
        self.links: Dict[int, socket.socket] = {}
        self.last_seen: Dict[int, float] = {}
        self.inbox: Dict[int, List[bytes]] = {}
        self._rx: Dict[int, _Lines] = {}
        self._tx: Dict[int, bytearray] = {}
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, _LISTENER)

    def _drop(self, s: socket.socket) -> None:
        try:
            self.sel.unregister(s)
        except (KeyError, ValueError, OSError):
            pass
        s.close()

    def _refuse(self, s: socket.socket, why: str) -> None:
        try:
            peer = "%s:%d" % s.getpeername()[:2]
        except OSError:
            peer = "?"
        self.on_refused(f"link connection from {peer}", why)
        self._drop(s)

    def _verify(self, node: Optional[int], line: List[bytes], nonce: str) -> str:
        """Why the hello ``line`` does not prove machine ``node``'s link ('' if it does)."""
        if node is None:
            return "expected '<machine> <sealed nonce>'"
        try:
            got = open_raw(self.token, _key(node), line[1], _MAX_LINE)
        except Refused as exc:
            return exc.reason
        return "" if got == nonce.encode() else "sealed for another nonce (a replay)"

    def poll(self) -> List[Tuple[int, str]]:
        """Accept and verify new connections, collect lines; return ``(machine, cause)`` for each link that closed."""
        lost: List[Tuple[int, str]] = []
        now = time.monotonic()
        for key, mask in self.sel.select(0):
            s = key.fileobj
            if s.fileno() < 0:  # closed earlier in this poll
                continue
            if key.data is _LISTENER:
                self._accept(now)
            elif key.data is _PENDING:
                self._hello(s, now, lost)
            else:
                if mask & selectors.EVENT_WRITE:
                    self._flush(key.data)
                if mask & selectors.EVENT_READ:
                    self._read(key.data, s, now, lost)
        while self.pending:  # oldest first: stop at the first still within its time
            s, (nonce, t0, buf) = next(iter(self.pending.items()))
            if now - t0 <= HELLO_S:
                break
            del self.pending[s]
            self._refuse(s, f"no hello line within {HELLO_S:.0f}s and {_MAX_LINE} bytes")
        return lost

    def _accept(self, now: float) -> None:
        while True:
            try:
                s, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the rest wait in the backlog
                log.warning("link listener: cannot accept (%s)", exc)
                return
            s.setblocking(False)
            nonce = secrets.token_hex(16)
            try:
                s.sendall((nonce + "\n").encode())
            except OSError:
                s.close()
                continue
            self.pending[s] = (nonce, now, b"")
            self.sel.register(s, selectors.EVENT_READ, _PENDING)

    def _hello(self, s: socket.socket, now: float, lost: List[Tuple[int, str]]) -> None:
        nonce, t0, buf = self.pending[s]
        try:
            data = s.recv(_MAX_LINE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            del self.pending[s]
            self._refuse(s, f"failed before its hello ({exc})")
            return
        if data == b"":
            del self.pending[s]
            self._refuse(s, "closed before its hello")
            return
        buf += data
        if b"\n" not in buf:
            if len(buf) > _MAX_LINE:
                del self.pending[s]
                self._refuse(s, f"no hello line within {HELLO_S:.0f}s and {_MAX_LINE} bytes")
            else:
                self.pending[s] = (nonce, t0, buf)
            return
        del self.pending[s]
        hello, rest = buf.split(b"\n", 1)
        line = hello.split()
        node = int(line[0]) if len(line) == 2 and line[0].isdigit() else None
        why = self._verify(node, line, nonce)
        if why:
            self._refuse(s, f"its hello does not prove the job token ({why})")
        elif node in self.links:
            self._refuse(s, f"machine {node} has a link already")
        else:
            self.links[node] = s
            self.last_seen[node] = now
            self._rx[node] = _Lines()
            self.sel.modify(s, selectors.EVENT_READ, node)
            log.info("machine %d linked", node)
            if rest:  # lines sent right behind the hello
                self._take(node, rest, lost)

    def _read(self, node: int, s: socket.socket, now: float, lost: List[Tuple[int, str]]) -> None:
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._unlink(node)
            lost.append((node, f"its agent's connection to the controller broke ({exc})"))
            return
        if data == b"":
            self._unlink(node)
            lost.append((node, "its agent's connection to the controller closed"))
            return
        self.last_seen[node] = now
        self._take(node, data, lost)

    def _take(self, node: int, data: bytes, lost: List[Tuple[int, str]]) -> None:
        """File the lines in ``data``; a ``bye`` line is a clean leave (what follows it is dropped)."""
        for line, why in self._rx[node].feed(data):
            if why:
                self.on_refused(f"link line from machine {node}", f"{why} (starts {line[:40]!r})")
            elif line == BYE.rstrip(b"\n"):
                self._unlink(node)
                log.info("machine %d left", node)
                return
            else:
                self.inbox.setdefault(node, []).append(line)

    def _unlink(self, node: int) -> None:
        s = self.links.pop(node)
        self.last_seen.pop(node, None)
        self._rx.pop(node, None)
        self._tx.pop(node, None)
        self._drop(s)

    def lines(self, node: int) -> List[bytes]:
        """Take the lines machine ``node``'s agent sent that :meth:`poll` collected (oldest first)."""
        return self.inbox.pop(node, [])

    def send(self, node: int, line: bytes) -> bool:
        """Write ``line`` (printable ASCII, at most ``_MAX_LINE`` bytes, no newline: ValueError if not) to
        machine ``node``. Never blocks: what the socket does not take now goes out in later polls.
        False if the machine has no link, the link broke, or the agent left ``_MAX_OUT`` unread."""
        line = _check_line(line)
        if node not in self.links:
            return False
        buf = self._tx.setdefault(node, bytearray())
        if len(buf) + len(line) + 1 > _MAX_OUT:
            log.warning("machine %d does not read its link: a line to it is dropped", node)
            return False
        buf += line + b"\n"
        return self._flush(node)

    def _flush(self, node: int) -> bool:
        """Write what is queued for ``node``; wait for writability while some is left. False if the link
        broke (its close is reported by the next poll, which reads the error or EOF)."""
        s, buf = self.links.get(node), self._tx.get(node)
        if s is None or buf is None:
            return s is not None
        try:
            while buf:
                del buf[:s.send(buf)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            log.info("machine %d: its link broke while writing (%s)", node, exc)
            buf.clear()
            self._want(s, node, selectors.EVENT_READ)
            return False
        self._want(s, node, selectors.EVENT_READ | (selectors.EVENT_WRITE if buf else 0))
        return True

    def _want(self, s: socket.socket, node: int, events: int) -> None:
        if self.sel.get_key(s).events != events:
            self.sel.modify(s, events, node)

    def close(self) -> None:
        for s in [*self.pending, *self.links.values(), self.sock]:
            s.close()
        self.pending.clear()
        self.links.clear()
        self.last_seen.clear()
        self._rx.clear()
        self._tx.clear()
        try:
            self.sel.close()
        except (AttributeError, OSError):  # closed already
            pass


def connect(host: str, port: int, node: int, token, timeout_s: float = 10.0) -> socket.socket:
    """The agent's side: open machine ``node``'s link and prove the token. Raises ``OSError``
    or ``ValueError`` if the controller does not take it."""
    tok = token.encode() if isinstance(token, str) else bytes(token)
    s = socket.create_connection((host, port), timeout=timeout_s)
    try:
        buf = b""
        while b"\n" not in buf:
            data = s.recv(_MAX_LINE)
            if not data or len(buf) > _MAX_LINE:
                raise ValueError(f"the controller's link at {host}:{port} sent no nonce")
            buf += data
        nonce = buf.split(b"\n", 1)[0]
        s.sendall(f"{node} ".encode() + seal_raw(tok, _key(node), nonce) + b"\n")
    except BaseException:
        s.close()
        raise
    s.settimeout(None)
    return s


def leave(s: Optional[socket.socket]) -> None:
    """Close the link at the job's end, saying so first (the controller does not count it a loss)."""
    if s is None:
        return
    try:
        s.sendall(BYE)
    except OSError:
        pass
    s.close()


class AgentLink:
    """The agent's end of its link (the socket :func:`connect` returned): send lines and read the
    controller's, never blocking (``MSG_DONTWAIT``: the socket itself may stay blocking, so
    :func:`leave` and ``close`` work on it as before).

    ``send`` queues what the socket does not take at once and ``flush`` (called by ``send`` and
    ``lines``) writes it later; ``closed`` turns True once the controller's end is gone."""

    def __init__(self, sock: socket.socket, on_refused: Optional[Callable[[str, str], None]] = None) -> None:
        self.sock = sock
        self.on_refused = on_refused or (lambda what, why: log.warning("refused %s: %s", what, why))
        self.closed = False
        self._rx = _Lines()
        self._tx = bytearray()

    def send(self, line: bytes) -> bool:
        """Send ``line`` (printable ASCII, at most ``_MAX_LINE`` bytes, no newline: ValueError if not);
        False if the link is gone or ``_MAX_OUT`` bytes wait unsent."""
        line = _check_line(line)
        if self.closed or len(self._tx) + len(line) + 1 > _MAX_OUT:
            return False
        self._tx += line + b"\n"
        return self.flush()

    def flush(self) -> bool:
        """Write what is queued, as far as the socket takes it now; False if the link is gone."""
        try:
            while self._tx and not self.closed:
                del self._tx[:self.sock.send(self._tx, socket.MSG_DONTWAIT)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.closed = True
        return not self.closed

    def lines(self) -> List[bytes]:
        """The complete lines the controller sent since the last call (junk refused and dropped)."""
        self.flush()
        got: List[bytes] = []
        while not self.closed:
            try:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            for line, why in self._rx.feed(data):
                if why:
                    self.on_refused("link line from the controller", f"{why} (starts {line[:40]!r})")
                else:
                    got.append(line)
        return got

    def leave(self) -> None:
        """:func:`leave`, after writing what is queued if the socket takes it now."""
        self.flush()
        leave(self.sock)
        self.closed = True

    def close(self) -> None:
        self.sock.close()
        self.closed = True
