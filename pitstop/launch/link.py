"""Each machine's agent holds one TCP connection to the controller, so its death is seen at once.

::

    agent k    --connect-->  the controller's link listener (address sealed under ctl/node/link)
               <-- nonce --
               -- "k seal_raw(token, link/k, nonce)" -->        verified: machine k's link
    the agent SIGKILLed with its process group (a machine failure):
               the kernel closes its sockets -> EOF at the controller -> machine k lost, now
    the agent leaving at the job's end sends "bye" first: not a loss

A machine that loses power or its network sends nothing: the probe and the heartbeat
(:mod:`pitstop.launch.remote`) stay the paths for that. A connection that does not prove
the job token within :data:`HELLO_S`, sends junk, or claims a machine that has a link
already is refused (logged through ``on_refused``) and closed; it never counts as a link,
so it cannot take a machine down by closing.
"""

from __future__ import annotations

import logging
import secrets
import select
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

from pitstop.protocol import Refused, open_raw, seal_raw

log = logging.getLogger(__name__)

#: How long a new connection has to prove the token.
HELLO_S = 10.0
_MAX_LINE = 256
BYE = b"bye\n"


def _key(node: int) -> str:
    """What a link's hello is sealed for (:func:`pitstop.protocol.seal_raw`): one machine's nonce."""
    return f"link/{node}"


class LinkServer:
    """The controller's side: accept, verify, and report links that closed (:meth:`poll`)."""

    def __init__(self, host: str, token, on_refused: Optional[Callable[[str, str], None]] = None) -> None:
        self.token = token.encode() if isinstance(token, str) else bytes(token)
        self.sock = socket.create_server((host, 0))
        self.sock.setblocking(False)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.on_refused = on_refused or (lambda what, why: log.warning("refused %s: %s", what, why))
        self.pending: Dict[socket.socket, Tuple[str, float, bytes]] = {}
        self.links: Dict[int, socket.socket] = {}

    def _refuse(self, s: socket.socket, why: str) -> None:
        try:
            peer = "%s:%d" % s.getpeername()[:2]
        except OSError:
            peer = "?"
        self.on_refused(f"link connection from {peer}", why)
        s.close()

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
        """Accept and verify new connections; return ``(machine, cause)`` for each link that closed."""
        while True:
            try:
                s, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            s.setblocking(False)
            nonce = secrets.token_hex(16)
            try:
                s.sendall((nonce + "\n").encode())
            except OSError:
                s.close()
                continue
            self.pending[s] = (nonce, time.monotonic(), b"")
        now = time.monotonic()
        for s, (nonce, t0, buf) in list(self.pending.items()):
            try:
                data = s.recv(_MAX_LINE)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError as exc:
                del self.pending[s]
                self._refuse(s, f"failed before its hello ({exc})")
                continue
            if data == b"":
                del self.pending[s]
                self._refuse(s, "closed before its hello")
                continue
            buf += data or b""
            if b"\n" not in buf:
                if len(buf) > _MAX_LINE or now - t0 > HELLO_S:
                    del self.pending[s]
                    self._refuse(s, f"no hello line within {HELLO_S:.0f}s and {_MAX_LINE} bytes")
                else:
                    self.pending[s] = (nonce, t0, buf)
                continue
            del self.pending[s]
            line = buf.split(b"\n", 1)[0].split()
            node = int(line[0]) if len(line) == 2 and line[0].isdigit() else None
            why = self._verify(node, line, nonce)
            if why:
                self._refuse(s, f"its hello does not prove the job token ({why})")
            elif node in self.links:
                self._refuse(s, f"machine {node} has a link already")
            else:
                self.links[node] = s
                log.info("machine %d linked", node)
        lost: List[Tuple[int, str]] = []
        if self.links:
            readable, _, _ = select.select(list(self.links.values()), [], [], 0)
            for node, s in list(self.links.items()):
                if s not in readable:
                    continue
                try:
                    data = s.recv(64)
                except OSError as exc:
                    data, why = b"", f"its agent's connection to the controller broke ({exc})"
                else:
                    why = "its agent's connection to the controller closed"
                if data.startswith(BYE):  # a clean leave
                    del self.links[node]
                    s.close()
                elif data == b"":
                    del self.links[node]
                    s.close()
                    lost.append((node, why))
        return lost

    def close(self) -> None:
        for s in [*self.pending, *self.links.values(), self.sock]:
            s.close()
        self.pending.clear()
        self.links.clear()


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
