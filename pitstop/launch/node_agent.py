"""One machine's agent, as its own process: it talks to the controller only through the control store.

::

    controller (head)                    store                         agent of machine k
    put node/k/cmd/n {start w5, env} ->  ctl/node/k/cmd/n  ----------> start it (elastic multiprocessing)
      and "cmd" on the link  ------------------------------------->   (the line wakes it; it reads the key)
                                         ctl/node/k/started/w5 <------ {pid}   and "ev w5" on the link
                                         ctl/node/k/exit/w5    <------ {pid, exit}   and "ev w5"
    machine k lost when its link's  <------------------------------   "beat n", every heartbeat interval
    beats stop (or the link closes)
    a failure was reported: "probe n" -----------------------------> "pong n" at once

Without a link (before it opens, or after a controller died until its successor publishes
a new address) the same travels through the store: ``node/k/hb``, ``node/k/probe`` and
``node/k/pong``, and the agent polls its commands every heartbeat interval. Linked, the
agent costs the store nothing while nothing happens (see :meth:`NodeAgent.run`).

Every message is sealed (:mod:`pitstop.protocol`). The agent runs the training script
from its *own* command line, so the store can only ask it to start a role or a standby
of this job, never an arbitrary program; the environment a command carries is limited
to torchrun's and pitstop's variables, and the job token is added from the agent's own
environment, never sent. Its children get ``PITSTOP_GLOO_ADDR`` (this machine's address,
so their gloo groups listen there) and ``PITSTOP_AGENT_PID`` (they die with the agent,
as a machine's processes die with it: SIGKILL of the agent's process group stands for a
machine failure).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import re
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from pitstop import protocol
from pitstop.errors import PitstopError
from pitstop.launch.agent import Agent, Proc
from pitstop.launch.hub import LocalHub
from pitstop.protocol import Channel
from pitstop.runtime import keys
from pitstop.runtime.local import ENV_AGENT_SOCK
from pitstop.store import is_etcd

log = logging.getLogger(__name__)

ENV_AGENT_PID = "PITSTOP_AGENT_PID"
ENV_NODE = "PITSTOP_NODE"
ENV_NODE_HOST = "PITSTOP_NODE_HOST"

#: What a start command may set in a child's environment.
_ALLOWED_ENV = re.compile(r"^(PITSTOP_[A-Z0-9_]+|RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|"
                          r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_USE_AGENT_STORE|OMP_NUM_THREADS|PYTHONUNBUFFERED)$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def connect(spec: str, timeout_s: float = 300.0):
    """A client of the control store at ``spec`` (``HOST:PORT`` or ``etcd://...``), waiting
    (bounded) for the head to open it; on etcd, reads come from a watched copy (the loop polls)."""
    from pitstop import store as store_mod

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return store_mod.connect(spec, timeout=timedelta(seconds=30), mirrored=True)
        except Exception as exc:  # noqa: BLE001 - DistNetworkError: not up yet
            if time.monotonic() > deadline:
                raise PitstopError(f"the control store at {spec} did not answer within {timeout_s:.0f}s: "
                                   f"{str(exc).splitlines()[0]}") from None
            time.sleep(0.5)


class NodeAgent:
    """The loop of one machine's agent (see the module docstring)."""

    def __init__(self, node: int, addr: str, nproc: int, argv: Sequence[str], run_dir: Path, store_spec: str,
                 token: str, heartbeat_interval_s: float = 0.5, agent: Optional[Agent] = None,
                 heartbeat_timeout_s: float = 5.0, open_store: Optional[Callable[[], object]] = None,
                 open_watch_store: Optional[Callable[[], object]] = None) -> None:
        if not token:
            raise PitstopError("a machine's agent needs the job token: set PITSTOP_JOB_TOKEN to the same secret "
                               "on every machine (for example exported before srun)")
        self.node, self.addr, self.nproc, self.argv = node, addr, nproc, list(argv)
        self.token = token
        self.interval = heartbeat_interval_s
        self.store = connect(store_spec)
        self.ch = Channel(self.store, token, lambda k, r: log.warning("[node %d] refused %s: %s", node, k, r))
        self.agent = agent if agent is not None else Agent(Path(run_dir))
        """Starts and watches this machine's processes (the scale harness hands in one that runs
        simulated ranks as threads, with the same methods)."""
        self.names: Dict[str, Proc] = {}
        self.next_cmd = 1
        self.beats = 0
        self.reported_names: set = set()
        """The processes whose started, exit or hung report this turn of the loop wrote."""
        self.answered = 0
        """The newest probe answered (an older one, replayed, is not answered again)."""
        self.store_spec = store_spec
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.open_store = open_store or (lambda: connect(store_spec))
        """A store connection for each of the hub's vote workers."""
        self.open_watch_store = open_watch_store
        """The connection of the hub's wait on the end of a generation (the vote's by default)."""
        self.hub: Optional[LocalHub] = None
        """Its ranks' line (:mod:`pitstop.launch.hub`): their beats, hangs and the step's vote."""
        self.slot_names: Dict[int, str] = {}
        """The slot each process it started was given (the hub knows processes by slot)."""
        self._hub_events: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()  # the hub's thread wakes the loop
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.link = None
        """The link to the controller (:class:`pitstop.launch.link.AgentLink`), once open."""
        self.reported = False
        """A started or exit report was written since the controller was last told ("ev")."""
        self.link_to: Optional[tuple] = None
        self._link_fails = 0
        self._link_retry_at = 0.0
        """The controller address the link was opened to (a restarted controller publishes a new one)."""

    def _child_env(self, env: Dict[str, str]) -> Dict[str, str]:
        bad = sorted(k for k in env if not _ALLOWED_ENV.match(k) or not isinstance(env[k], str))
        if bad:
            raise ValueError(f"environment variable(s) {bad[:5]} may not be set by a command")
        out = dict(os.environ)
        out.update(env)
        out[protocol.ENV_TOKEN] = self.token
        out["PITSTOP_GLOO_ADDR"] = self.addr
        out[ENV_NODE_HOST] = self.addr
        out[ENV_NODE] = str(self.node)
        out[ENV_AGENT_PID] = str(os.getpid())
        if self.hub is not None:
            out[ENV_AGENT_SOCK] = self.hub.name
        return out

    def _command(self, k: str, cmd: dict) -> None:
        name = cmd["name"]
        if not _NAME.match(name):
            self.ch.refuse(k, f"process name {name!r}: expected letters, digits, '_', '.', '-'")
            return
        if cmd["op"] == "start":
            if name in self.names:
                self.ch.refuse(k, f"process {name} was started already")
                return
            try:
                env = self._child_env(cmd.get("env") or {})
            except ValueError as exc:
                self.ch.refuse(k, str(exc))
                return
            p = self.agent.start(name, self.argv, env)
            self.names[name] = p
            if str(env.get("PITSTOP_SLOT", "")).isdigit():
                self.slot_names[int(env["PITSTOP_SLOT"])] = name
            self.ch.put(keys.node_event(self.node, name, "started"), {"pid": p.pid})
            self.reported = True
            self.reported_names.add(name)
            log.info("[node %d] started %s (pid %d)", self.node, name, p.pid)
        elif cmd["op"] == "kill":
            p = self.names.get(name)
            if p is not None and p.running:
                self.agent.kill(p, int(cmd.get("sig", signal.SIGKILL)))

    #: The longest wait before another try at a link whose connection failed (doubling from
    #: the heartbeat interval, with jitter).
    LINK_RETRY_MAX_S = 8.0

    def _try_link(self) -> None:
        """Open the TCP link to the controller (:mod:`pitstop.launch.link`) once its address is
        published. Without it the heartbeat and the probe stand alone. A restarted controller
        (etcd) publishes a new address: the link moves there.

        A link that opened and closed is not opened again (the controller counts that machine
        lost). A connection that failed is tried again, backing off: at 8,192 ranks, 1,026
        agents connecting at once timed out 20 of them, which then spoke through the store for
        the rest of the job (each machine's reports read every 0.25 s: 1,900 store reads a
        second at the controller, where 4,096 ranks cost it 35)."""
        from pitstop.launch import link

        now = time.monotonic()
        if now < self._link_retry_at:
            return
        where = self.ch.read(keys.NODE_LINK, protocol.NODE_LINK)
        if where is None or (where["host"], where["port"]) == self.link_to:
            return
        if self.link is not None:  # the old controller is gone
            self.link.close()
            self.link = None
        self.link_to = (where["host"], where["port"])
        try:
            self.link = link.AgentLink(link.connect(where["host"], where["port"], self.node, self.token),
                                       lambda what, why: log.warning("[node %d] refused %s: %s", self.node, what, why))
        except (OSError, ValueError) as exc:
            self._link_fails += 1
            wait = min(self.LINK_RETRY_MAX_S, self.interval * 2 ** (self._link_fails - 1)) * random.uniform(0.5, 1.0)
            self._link_retry_at = time.monotonic() + wait
            self.link_to = None  # the same address is tried again
            log.warning("[node %d] no link to the controller at %s:%s (try %d): %s; again in %.1fs", self.node,
                        where["host"], where["port"], self._link_fails, exc, wait)

    @property
    def linked(self) -> bool:
        return self.link is not None and not self.link.closed

    def _commands(self) -> None:
        while True:
            k = keys.node_cmd(self.node, self.next_cmd)
            cmd = self.ch.read(k, protocol.NODE_CMD)
            if cmd is None:
                return
            self.next_cmd += 1
            self._command(k, cmd)

    def _answer(self, n: int) -> None:
        """Answer probe ``n`` (an older one, replayed, is not answered again)."""
        if n > self.answered:
            self.answered = n
            if not (self.linked and self.link.send(f"pong {n}".encode())):
                self.ch.put(keys.node(self.node, "pong"), {"n": self.answered}, own=False)

    def _done(self) -> bool:
        return self.ch.read(keys.DONE, protocol.FLAG) is not None

    # ------------------------------------------------------------------ the hub's reports
    def _from_hub(self, what: str, a: int, b) -> None:
        """Called on the hub's thread: queued for the loop, which owns the store client."""
        self._hub_events.put((what, a, b))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _hub_reports(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                what, a, b = self._hub_events.get_nowait()
            except queue.Empty:
                return
            if what == "hung":  # a rank silent for the heartbeat timeout: the controller decides
                name = self.slot_names.get(a)
                p = self.names.get(name) if name else None
                if p is not None and p.running:
                    log.warning("[node %d] %s (slot %d) silent for %.1fs", self.node, name, a, b)
                    self.ch.put(keys.node_event(self.node, name, "hung"), {"pid": p.pid, "silent_s": round(b, 2)})
                    self.reported = True
                    self.reported_names.add(name)
            elif what == "poison" and self.linked:  # a stayer's step broke: the controller probes at once
                self.link.send(f"poison {a} {b}".encode())
            elif what == "said" and self.linked:  # a process's hello is written: the controller reads it
                self.link.send(f"hello {a}".encode())

    def _start_hub(self) -> None:
        self.hub = LocalHub(LocalHub.new_name(self.node), self.token, self.open_store, self.heartbeat_timeout_s,
                            on_hung=lambda slot, silent: self._from_hub("hung", slot, silent),
                            on_poison=lambda g, st: self._from_hub("poison", g, st),
                            on_said=lambda slot: self._from_hub("said", slot, None),
                            blocking_get=not is_etcd(self.store_spec),
                            open_watch_store=self.open_watch_store).start()

    #: The most processes one turn of the loop names in its "ev" lines (more: one bare "ev").
    EV_NAMES_MAX = 16

    #: While linked, how often the agent checks its own sealed messages for junk written over them.
    REASSERT_S = 5.0

    def run(self) -> int:
        """The loop. Linked (the usual case), it costs the store nothing while nothing happens::

            controller --"cmd"--> agent: read node/k/cmd/n..   (a sealed command was written)
            controller --"probe n"--> agent --"pong n"-->       (a failure was reported)
            controller --"done"--> agent: read ctl/done, leave  (sealed: the line only wakes it)
            agent --"beat n"--> controller, every interval       (liveness; the link's silence is a freeze)
            agent --"ev <name>"--> controller                    (node/k/started|exit/<name> written)

        Unlinked (before the link is up, or once a controller died and until its successor
        publishes a new address), it polls the store every interval: commands, the probe, the
        end of the job, and writes its heartbeat there."""
        self._start_hub()
        self.ch.put(keys.node(self.node, "hello"), {"node": self.node, "host": socket.gethostname(), "addr": self.addr,
                                                   "nproc": self.nproc, "pid": os.getpid()})
        last_beat = last_look = last_reassert = 0.0
        try:
            while True:
                now = time.monotonic()
                nudged = done = False
                if self.linked:
                    for line in self.link.lines():
                        words = line.split()
                        if words == [b"cmd"]:
                            nudged = True
                        elif words == [b"done"]:
                            done = True
                        elif len(words) == 2 and words[0] == b"probe" and words[1].isdigit():
                            self._answer(int(words[1]))
                        else:
                            log.warning("[node %d] refused link line %r: expected cmd, done or probe N",
                                        self.node, line[:40])
                look = not self.linked and now - last_look >= self.interval
                if look:
                    last_look = now
                    self._try_link()
                if nudged or look:
                    self._commands()
                for p in self.agent.poll():
                    self.ch.put(keys.node_event(self.node, p.name, "exit"), {"pid": p.pid, "exit": p.exit})
                    self.reported = True
                    self.reported_names.add(p.name)
                self._hub_reports()
                if self.reported and self.linked:
                    # "ev <name>": the controller reads that process's reports alone (a bare "ev"
                    # had it read every process of the machine, three keys each, at every start)
                    names = sorted(self.reported_names)
                    if 0 < len(names) <= self.EV_NAMES_MAX:
                        for name in names:
                            self.link.send(f"ev {name}".encode())
                    else:
                        self.link.send(b"ev")
                self.reported = False
                self.reported_names.clear()
                if look:
                    probe = self.ch.read(keys.node(self.node, "probe"), protocol.HEARTBEAT)
                    if probe is not None:
                        self._answer(probe["n"])
                if now - last_beat >= self.interval:
                    self.beats += 1
                    last_beat = now
                    if not (self.linked and self.link.send(f"beat {self.beats}".encode())):
                        self.ch.put(keys.node(self.node, "hb"), {"n": self.beats}, own=False)
                    if not self.linked or now - last_reassert >= self.REASSERT_S:
                        self.ch.reassert()
                        last_reassert = now
                if (done or look) and self._done():
                    log.info("[node %d] the job is over", self.node)
                    if self.link is not None:
                        self.link.leave()
                    self.link = None
                    return 0
                wait = self.interval if self.linked else min(self.interval, 0.02)
                self.agent.wait_exit(max(0.0, min(wait, last_beat + self.interval - time.monotonic())),
                                     [self._wake_r] + ([self.link.sock] if self.linked else []))
        except (RuntimeError, OSError) as exc:  # the store went away: the head is gone
            log.warning("[node %d] lost the control store (%s); stopping this machine's processes", self.node,
                        str(exc).splitlines()[0])
            return 1
        finally:
            if self.link is not None:  # not a clean leave: the controller sees the close (the store is gone anyway)
                self.link.close()
            self.agent.close()
            if self.hub is not None:
                self.hub.close()


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m pitstop.launch.node_agent --node K --addr A --nproc N --run-dir D --store H:P -- SCRIPT ...``:
    how the head starts its own machine's agent (other machines run ``pitstop launch --node-rank K``)."""
    import argparse

    p = argparse.ArgumentParser(prog="pitstop-node-agent")
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("script", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    from pitstop.store import parse_spec

    parse_spec(args.store)  # a clear error for a bad address
    setup_logging()
    return NodeAgent(args.node, args.addr, args.nproc, script, Path(args.run_dir), args.store,
                     protocol.take_token_from_env(), args.heartbeat_interval,
                     heartbeat_timeout_s=args.heartbeat_timeout).run()


def setup_logging() -> None:
    """The agent is a program of its own: its lines go to stderr (the library configures nothing)."""
    logging.basicConfig(level=logging.INFO, format="pitstop-agent %(asctime)s %(message)s")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
