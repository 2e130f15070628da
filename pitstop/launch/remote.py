"""The controller's view of the machines' agents: start, kill and watch processes through the store.

:class:`RemoteAgents` offers what the in-process :class:`~pitstop.launch.agent.Agent`
offers (``start``, ``poll``, ``kill``, ``log_paths``, ``log_tail``, ``close``), but each
call is a sealed message to a machine's agent (:mod:`pitstop.launch.node_agent`).
It also watches each agent's heartbeat: a machine whose agent falls silent for the
heartbeat timeout is lost, and every process on it is reported as exited at once, so
the controller sees one correlated failure.

A silent machine is only one sign of loss. When a stayer's collective fails (a peer's
connection was reset: its step is poisoned), the controller calls :meth:`suspect`. That
*probes* every live machine: a sealed ``node/k/probe {n}``, which a live agent answers
with ``node/k/pong {n}`` on its next loop (tens of milliseconds). A machine that leaves
the probe unanswered for ``probe_s`` is lost; so is one whose agent stays silent for
``confirm_s`` (a few beats) during the suspicion::

    agent beats  |  |  |  |  X (machine gone)
    stayer                      poisoned vote -> suspect() -> probe n to every machine
    live agents                 pong n (next loop)
    controller                  ... probe_s with no pong -> lost  (not heartbeat_timeout)

A live agent answers, so a suspicion does not take a healthy machine; an old pong
(replayed) carries an older ``n`` and answers nothing.

Fastest of all: each agent holds a TCP link to the controller (:mod:`pitstop.launch.link`).
When the agent dies with its machine's processes, the kernel closes it, and the machine is
lost on the controller's next poll, before any stayer has reported anything.
"""

from __future__ import annotations

import glob
import logging
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from pitstop import protocol
from pitstop.launch.link import LinkServer
from pitstop.protocol import Channel
from pitstop.runtime import keys

#: A process name an agent may send in "ev <name>" (as the names it accepts in a command).
_NAME = re.compile(rb"[A-Za-z0-9_.-]{1,64}")

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RemoteProc:
    """A process some machine's agent runs for this job."""

    name: str
    node: int
    pid: Optional[int] = None
    """Known once the agent reports it started."""
    exit: Optional[str] = None
    cmds: List[str] = field(default_factory=list)
    """The keys of the commands sent about it: owned (reasserted against junk) until the agent
    acted on them (it reported the start, or the exit)."""

    @property
    def running(self) -> bool:
        return self.exit is None


@dataclass
class NodeState:
    hello: Optional[dict] = None
    beats: int = 0
    last_beat: float = field(default_factory=time.monotonic)
    lost: bool = False
    probe_n: int = 0
    """The probe this machine has yet to answer (0: none outstanding)."""
    probe_sent: float = 0.0
    cause: str = ""
    """Why it was called lost: silence, an unanswered probe, or no hello."""
    looked: float = 0.0
    """When its hello was last looked for."""
    reports_looked: float = 0.0
    """When its processes' reports were last read while it had no link."""


class Lookout:
    """How long a watcher could not look: silence it did not see is no evidence.

    The controller judges a machine (or a process) by how long its heartbeat has been
    silent. If the controller itself did not look for a while (its loop was busy handling
    a failure, or its store reads waited on a stalled store server), every heartbeat looks
    silent at once, and the next look would call every machine lost together (seen once: all
    five machines "silent for 3.2 s after a reported failure", after the controller's loop had
    not polled for 3.5 s; the job failed with no machine left). :meth:`look` returns the
    seconds of the gap since the previous look beyond ``allowance_s`` (a normal loop's gap),
    which the caller adds to each heartbeat's last-seen time::

        look   look   (busy 3.5 s)                 look
          |------|-------------------------------------|
                                                 blind = 3.5 - allowance
    """

    def __init__(self, allowance_s: float = 0.5) -> None:
        if allowance_s <= 0:
            raise ValueError(f"allowance_s({allowance_s}) must be > 0")
        self.allowance_s = allowance_s
        self._last: Optional[float] = None
        self.blind_s = 0.0
        """All the blind time seen so far."""

    def look(self, now: float) -> float:
        last, self._last = self._last, now
        if last is None:
            return 0.0
        blind = max(0.0, now - last - self.allowance_s)
        self.blind_s += blind
        return blind


class RemoteAgents:
    """Processes on machines ``0 .. nodes-1``, each run by that machine's agent."""

    #: How often the hello of a machine that has not said one is looked for, and the reports
    #: of an unlinked machine's processes are read (a linked one says when it wrote one).
    KEY_LOOK_S = 0.25

    def __init__(self, ch: Channel, run_dir: Path, nodes: int, heartbeat_timeout_s: float,
                 on_node_lost: Optional[Callable[[int, float], None]] = None, poll_s: float = 0.05,
                 join_timeout_s: float = 600.0, confirm_s: Optional[float] = None,
                 probe_s: Optional[float] = None, link_host: Optional[str] = None,
                 on_refused: Optional[Callable[[str, str], None]] = None) -> None:
        self.ch = ch
        self.run_dir = Path(run_dir)
        self.timeout = heartbeat_timeout_s
        self.confirm_s = heartbeat_timeout_s if confirm_s is None else min(confirm_s, heartbeat_timeout_s)
        """The silence that confirms a loss while a failure is suspected (:meth:`suspect`)."""
        self.probe_s = self.confirm_s if probe_s is None else min(probe_s, self.confirm_s)
        """How long a probed machine has to answer, while a failure is suspected."""
        self.probes = 0
        self.suspected_at: Optional[float] = None
        self.nodes: Dict[int, NodeState] = {k: NodeState() for k in range(nodes)}
        self.cmds: Dict[int, int] = {k: 0 for k in range(nodes)}
        self.procs: Dict[str, RemoteProc] = {}
        self.on_node_lost = on_node_lost
        self.poll_s = poll_s
        self.join_timeout = join_timeout_s
        """A machine whose agent has not said hello by then never joined: its processes are lost."""
        self._started = time.monotonic()
        self._last_poll = 0.0
        # a normal loop's gap counts as seen; a longer one is blind time (a third of the
        # confirming silence at most, so a blind spell cannot confirm a loss by itself)
        self._lookout = Lookout(max(4 * poll_s, min(0.5, self.confirm_s / 3)) or 0.5)
        self._hung: List[tuple] = []
        self._hellos: set = set()
        self._named: set = set()
        """(machine, process) whose reports its agent said it wrote ("ev <name>")."""
        self._hung_seen: set = set()
        self.links: Optional[LinkServer] = None
        """Each agent's TCP link (:mod:`pitstop.launch.link`): a machine whose agent dies is lost at once."""
        if link_host is not None:
            self.links = LinkServer(link_host, ch.token, on_refused)
            ch.put(keys.NODE_LINK, {"host": link_host, "port": self.links.port})

    # ------------------------------------------------------------------ a restarted controller
    def state(self) -> Dict:
        """JSON: the machines, the command counters and the processes (see :meth:`restore`)."""
        # not the beat counts: they move every beat; a restored machine's next beat is news anyway
        return {"nodes": [[k, {"hello": st.hello, "lost": st.lost, "cause": st.cause}]
                          for k, st in self.nodes.items()],
                "cmds": [[k, n] for k, n in self.cmds.items()], "probes": self.probes,
                "procs": [{"name": p.name, "node": p.node, "pid": p.pid, "exit": p.exit} for p in self.procs.values()]}

    def restore(self, d: Dict) -> List[tuple]:
        """Take over from a controller that died: its machines and processes, as it left them.
        Every live machine's silence counts from now (the agents never stopped). Commands
        the old controller sent after its last saved state are found in the store, so no
        number is used twice; the processes they started are returned as ``(node, command)``
        for the controller to adopt."""
        now = time.monotonic()
        for k, n in d["nodes"]:
            st = self.nodes[int(k)]
            st.hello, st.lost, st.cause = n["hello"], bool(n["lost"]), n["cause"]
            hb = self.ch.read(keys.node(int(k), "hb"), protocol.HEARTBEAT)
            st.beats, st.last_beat = (hb["n"] if hb else 0), now
        self.probes = int(d["probes"])
        self.procs = {p["name"]: RemoteProc(p["name"], int(p["node"]), p["pid"], p["exit"]) for p in d["procs"]}
        self._started = now
        unrecorded: List[tuple] = []
        for k, n in d["cmds"]:
            k, n = int(k), int(n)
            while self.ch.store.check([keys.node_cmd(k, n + 1)]):
                n += 1
                cmd = self.ch.read(keys.node_cmd(k, n), protocol.NODE_CMD)
                if cmd is not None and cmd["op"] == "start" and cmd["name"] not in self.procs:
                    self.procs[cmd["name"]] = RemoteProc(cmd["name"], k)
                    unrecorded.append((k, cmd))
            self.cmds[k] = n
        return unrecorded

    # ------------------------------------------------------------------ commands
    def linked(self, node: int) -> bool:
        """Whether machine ``node``'s agent holds a verified link now."""
        return self.links is not None and node in self.links.links

    def _send(self, node: int, body: dict) -> str:
        self.cmds[node] += 1
        key = keys.node_cmd(node, self.cmds[node])
        self.ch.put(key, body)
        if self.linked(node):  # the line only wakes the agent: it acts on the sealed command
            self.links.send(node, b"cmd")
        return key

    def start(self, name: str, env: Dict[str, str], node: int) -> RemoteProc:
        if name in self.procs:
            raise ValueError(f"process name {name} is taken")
        # the token never crosses the store: each agent adds its own copy
        env = {k: v for k, v in env.items() if k != protocol.ENV_TOKEN}
        p = RemoteProc(name, node)
        self.procs[name] = p
        if self.nodes[node].lost:
            p.exit = f"machine {node} is lost"
        else:
            p.cmds.append(self._send(node, {"op": "start", "name": name, "env": env}))
        return p

    def kill(self, p: RemoteProc, sig: int = signal.SIGKILL) -> None:
        if p.running and not self.nodes[p.node].lost:
            p.cmds.append(self._send(p.node, {"op": "kill", "name": p.name, "sig": int(sig)}))

    # ------------------------------------------------------------------ watching
    def suspect(self) -> None:
        """A failure was reported (a poisoned step): probe every live machine (one that
        leaves it unanswered for ``probe_s`` is lost), and for one heartbeat timeout from
        now, ``confirm_s`` of silence is enough to call a machine lost."""
        now = time.monotonic()
        if self.suspected_at is None or now - self.suspected_at > self.timeout:
            log.info("a failure was reported: probing the machines (%.2fs to answer; %.2fs of silence is a loss)",
                     self.probe_s, self.confirm_s)
        self.suspected_at = now
        self.probes += 1
        for k, st in self.nodes.items():
            if st.hello is not None and not st.lost and not st.probe_n:
                st.probe_n, st.probe_sent = self.probes, now
                if not (self.linked(k) and self.links.send(k, f"probe {self.probes}".encode())):
                    self.ch.put(keys.node(k, "probe"), {"n": self.probes}, own=False)

    def suspecting(self, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.suspected_at is not None and now - self.suspected_at <= self.timeout

    def _timeout(self, now: float) -> float:
        return self.confirm_s if self.suspecting(now) else self.timeout

    def alive(self, node: int) -> bool:
        st = self.nodes[node]
        return st.hello is not None and not st.lost

    def poll(self) -> List[RemoteProc]:
        """Processes that exited (or whose machine was lost) since the last poll."""
        now = time.monotonic()
        if now - self._last_poll < self.poll_s:
            return []
        self._last_poll = now
        blind = self._lookout.look(now)
        if blind > 0:
            log.info("the controller did not look at the machines for %.2fs: that silence is not counted", blind)
            for st in self.nodes.values():
                st.last_beat = min(now, st.last_beat + blind)
                if st.probe_n:
                    st.probe_sent = min(now, st.probe_sent + blind)
        timeout = self._timeout(now)
        out: List[RemoteProc] = []
        dirty = set()  # machines whose agent wrote started/exit reports ("ev"), or that have no link
        if self.links is not None:
            before = set(self.links.links)
            for k, cause in self.links.poll():
                st = self.nodes.get(k)
                if st is not None and st.hello is not None and not st.lost:
                    self._lose(k, cause, now - st.last_beat, out)
            for k in set(self.links.links) - before:  # commands written before it linked: look now
                self.links.send(k, b"cmd")
                dirty.add(k)
                if k in self.nodes:
                    self.nodes[k].looked = 0.0  # and at its hello
            for k in list(self.links.inbox):  # only machines that sent something
                self._link_lines(k, now, dirty)
        for k, st in self.nodes.items():
            # an unlinked machine's reports are read every KEY_LOOK_S, not at every 50 ms poll:
            # three keys per process each time were ~50,000 store checks in a 256-rank start-up
            if not self.linked(k) and now - st.reports_looked >= self.KEY_LOOK_S:
                st.reports_looked = now
                dirty.add(k)
            if st.lost:
                continue
            # a machine that has not said hello is looked for at most every KEY_LOOK_S (and at once
            # when its link opens), not at every 50 ms poll: 20 store checks a second for each
            # machine still starting
            if st.hello is None:
                if now - st.looked < self.KEY_LOOK_S and now - self._started <= self.join_timeout:
                    continue
                st.looked = now
                st.hello = self.ch.read(keys.node(k, "hello"), protocol.NODE_HELLO)
                if st.hello is not None:
                    st.last_beat = now
                elif now - self._started > self.join_timeout:
                    st.lost = True
                    st.cause = f"its agent said no hello within {self.join_timeout:.0f}s"
                    log.warning("machine %d never joined within %.0fs", k, self.join_timeout)
                    if self.on_node_lost is not None:
                        self.on_node_lost(k, now - self._started)
                    for p in self.procs.values():
                        if p.node == k and p.running:
                            p.exit = f"machine {k} never joined (no agent hello within {self.join_timeout:.0f}s)"
                            out.append(p)
                continue
            if self.linked(k):  # its beats and pongs come over the link (_link_lines)
                n = st.beats
            else:
                hb = self.ch.read(keys.node(k, "hb"), protocol.HEARTBEAT)
                n = st.beats if hb is None else hb["n"]
                if st.probe_n:
                    pong = self.ch.read(keys.node(k, "pong"), protocol.HEARTBEAT)
                    if pong is not None and pong["n"] >= st.probe_n:
                        st.probe_n, st.last_beat = 0, now
            if n < st.beats:
                self.ch.refuse(keys.node(k, "hb"), f"replayed: beat {n} after beat {st.beats}")
            elif n > st.beats:
                st.beats, st.last_beat = n, now
            elif now - st.last_beat > timeout or (st.probe_n and now - st.probe_sent > self.probe_s):
                silent = now - st.last_beat
                if now - st.last_beat > timeout:
                    cause = f"its agent was silent for {silent:.1f}s" + (
                        " after a reported failure" if timeout < self.timeout else "")
                else:
                    cause = f"its agent left probe {st.probe_n} unanswered for {now - st.probe_sent:.2f}s"
                self._lose(k, cause, silent, out)
        named, self._named = self._named, set()
        for p in self.procs.values():
            if not p.running or (p.node not in dirty and (p.node, p.name) not in named):
                continue
            if p.pid is None:
                st = self.ch.read(keys.node_event(p.node, p.name, "started"), protocol.NODE_STARTED)
                if st is not None:
                    p.pid = st["pid"]
                    self._acted(p)
            ex = self.ch.read(keys.node_event(p.node, p.name, "exit"), protocol.NODE_EXIT)
            if ex is not None:
                p.exit = ex["exit"]
                self._acted(p)
                out.append(p)
            elif p.name not in self._hung_seen:
                h = self.ch.read(keys.node_event(p.node, p.name, "hung"), protocol.NODE_HUNG)
                if h is not None:
                    self._hung_seen.add(p.name)
                    self._hung.append((p, float(h["silent_s"])))
        return out

    def _acted(self, p: RemoteProc) -> None:
        """The agent acted on what was sent about ``p``: those commands need no defending."""
        for key in p.cmds:
            self.ch.disown(key)
        p.cmds.clear()

    def take_hellos(self) -> set:
        """The slots whose hello an agent said was written, since the last call."""
        out, self._hellos = self._hellos, set()
        return out

    def take_hung(self) -> List[tuple]:
        """``(process, silent_s)`` for each process its agent reported silent since the last call."""
        out, self._hung = self._hung, []
        return out

    def _link_lines(self, k: int, now: float, dirty: set) -> None:
        """What machine ``k``'s agent sent on its link: ``beat n`` (liveness, as its store
        heartbeat), ``pong n`` (the answer to a probe), ``ev <name>`` (it wrote process
        ``name``'s started, exit or hung report: read this poll) or a bare ``ev`` (read every
        process of the machine). Anything else is refused by name."""
        st = self.nodes.get(k)
        for line in self.links.lines(k):
            words = line.split()
            if st is None:
                continue
            if words == [b"ev"]:
                dirty.add(k)
            elif len(words) == 2 and words[0] == b"ev" and _NAME.fullmatch(words[1]):
                self._named.add((k, words[1].decode()))
            elif len(words) == 2 and words[0] == b"hello" and words[1].isdigit():
                self._hellos.add(int(words[1]))
            elif len(words) == 3 and words[0] == b"poison" and words[1].isdigit() and words[2].isdigit():
                self.suspect()  # a stayer's step broke on a dead peer: probe every machine now
            elif len(words) == 2 and words[0] in (b"beat", b"pong") and words[1].isdigit():
                n = int(words[1])
                if words[0] == b"beat":
                    if n > st.beats:
                        st.beats, st.last_beat = n, now
                elif st.probe_n and n >= st.probe_n:
                    st.probe_n, st.last_beat = 0, now
            else:
                self.links.on_refused(f"link line from machine {k}", f"{line[:40]!r}: expected beat N, pong N or ev")

    def _lose(self, k: int, cause: str, silent: float, out: List[RemoteProc]) -> None:
        """Machine ``k`` is lost: every process on it has exited, reported at once."""
        st = self.nodes[k]
        st.lost, st.cause = True, cause
        log.warning("machine %d lost: %s", k, cause)
        if self.on_node_lost is not None:
            self.on_node_lost(k, silent)
        for p in self.procs.values():
            if p.node == k and p.running:
                p.exit = f"machine {k} lost"
                out.append(p)

    # ------------------------------------------------------------------ logs (a shared file system, or nothing)
    def log_paths(self, p: RemoteProc) -> Dict[str, str]:
        out = {}
        for stream in ("stdout", "stderr"):
            found = sorted(glob.glob(str(self.run_dir / "logs" / p.name / "*" / "attempt_0" / "0" / f"{stream}.log")))
            out[stream] = found[0] if found else f"(on machine {p.node}) logs/{p.name}"
        return out

    def log_tail(self, p: RemoteProc, n: int = 30) -> str:
        lines = []
        for stream, path in self.log_paths(p).items():
            try:
                tail = Path(path).read_text(errors="replace").splitlines()[-n:]
            except OSError:
                tail = ["<not on this machine>"]
            lines.append(f"----- [{p.name} on machine {p.node}] {stream} ({path})")
            lines.extend(tail)
        return "\n".join(lines)

    def close(self) -> None:
        """The agents end their processes when the controller sets ``ctl/done`` (a linked agent is
        woken by a ``done`` line, and reads the sealed key); the links close."""
        if self.links is not None:
            for k in list(self.links.links):
                self.links.send(k, b"done")
            self.links.poll()  # flush what the sockets did not take at once
            self.links.close()
