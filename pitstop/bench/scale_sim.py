"""Simulated ranks and machines: the real control plane with thousands of ranks on one host.

::

    pitstop bench scale (the orchestrator, pitstop.bench.scale)
      ├─ controller process   the real Controller of `pitstop launch`, hosting the real TCPStore
      │                       (or on the real etcd), with its real RemoteAgents and link listener
      ├─ bulk host processes  many machines each: the real NodeAgent loop, one thread per machine,
      │                       whose processes are SimRank threads (SimAgent has the methods of
      │                       pitstop.launch.agent.Agent: start, poll, kill, wait_exit, close)
      └─ real machines        one process per machine, one NodeAgent, its own loopback address:
                              SIGKILL or SIGSTOP of its process group is a machine lost or frozen

A simulated rank has no model and no torch collective. It speaks the worker's protocol
through the worker's own code: ``worker._authenticate`` (the sealed hello), the real
``Heartbeat`` thread with the session's per-beat look (the fault and drain keys of its
generation), the real ``Vote`` at every step boundary, the end-of-generation watch (the
real ``KeyWatch`` on the key, or with a machine's agent its ``ended`` line), a standby's ``worker._wait_assignment``; with a sleep where a
step's compute would be. It opens as many control-store connections as a worker does.

Every store client of the simulated processes, their agents and the controller is wrapped in
:class:`CountingStore`, so the bench counts the store operations each side sends; the
same count of a real world-8 job (``real_world8``) says whether a simulated rank's traffic
is a real worker's.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from pitstop import protocol
from pitstop.launch.controller import Controller, LaunchSpec
from pitstop.launch.node_agent import NodeAgent
from pitstop.pg.fence import Fence
from pitstop.protocol import Channel, Verdict
from pitstop.runtime import keys, worker
from pitstop.runtime.config import RuntimeConfig
from pitstop.runtime.local import ENV_AGENT_SOCK, LineReader, LocalLink, LocalVote
from pitstop.runtime.vote import Vote
from pitstop.store import ENV_STORE, connect, is_etcd

log = logging.getLogger(__name__)

#: Store operations, by the name of the client method.
OPS = ("set", "get", "add", "check", "wait", "compare_set", "delete_key", "multi_get", "multi_set",
       "num_keys", "append")


#: What a counted client is used for: the iteration boundary is ``step`` (a rank's main
#: connection once the process has joined) and ``vote`` (its machine's agent's add and wait
#: for the step); the rest is background: ``join`` (hello, assignment), ``heartbeat`` (the
#: beat thread: beats, reassertions, the per-beat look), ``watch`` (the end-of-generation
#: watch), ``agent`` (a machine's agent loop), ``controller``.
PURPOSES = ("step", "vote", "join", "heartbeat", "watch", "agent", "controller")
#: The purposes counted as the step's cost.
STEP_PURPOSES = ("step", "vote")


class OpCounts:
    """Store operations sent by one process's wrapped clients, by purpose and kind (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: collections.Counter = collections.Counter()

    def add(self, purpose: str, op: str) -> None:
        with self._lock:
            self.ops[f"{purpose}.{op}"] += 1

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self.ops)


class CountingStore:
    """A store client that counts each operation it forwards (only pitstop's Python code calls
    it: never handed to c10d, which needs a real ``dist.Store``)."""

    def __init__(self, inner: Any, counts: OpCounts, purpose: str) -> None:
        self._inner = inner
        self._counts = counts
        self.purpose = purpose

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in OPS:
            return attr

        def counted(*a, **kw):
            self._counts.add(self.purpose, name)
            return attr(*a, **kw)

        return counted


def open_store(spec: str, counts: OpCounts, purpose: str, timeout_s: float = 300.0) -> CountingStore:
    return CountingStore(connect(spec, timeout=timedelta(seconds=timeout_s), mirrored=True), counts, purpose)


# ----------------------------------------------------------------------------- simulated ranks
class Killed(Exception):
    pass


class Timeline:
    """What the ranks of one process saw, for the orchestrator: per (generation, step) the
    last arrival and the last verdict held; per generation, when the last stayer was told
    of its end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps: Dict[str, List[float]] = {}
        self.told: Dict[str, List[float]] = {}
        self.errors: List[str] = []

    def vote(self, gen: int, step: int, t_arrive: float, t_verdict: float) -> None:
        k = f"{gen}/{step}"
        with self._lock:
            got = self.steps.get(k)
            if got is None:
                self.steps[k] = [t_arrive, t_verdict, 1]
            else:
                got[0], got[1], got[2] = max(got[0], t_arrive), max(got[1], t_verdict), got[2] + 1

    def tell(self, gen: int, t: float) -> None:
        with self._lock:
            got = self.told.setdefault(str(gen), [t, 0])
            got[0], got[1] = max(got[0], t), got[1] + 1

    def error(self, text: str) -> None:
        with self._lock:
            if len(self.errors) < 50:
                self.errors.append(text)

    def to_json(self) -> Dict[str, Any]:
        with self._lock:
            return {"steps": {k: list(v) for k, v in self.steps.items()},
                    "told": {k: list(v) for k, v in self.told.items()}, "errors": list(self.errors)}


class _Pool:
    """The spare connections a worker keeps for its threads (duck-typed ``ConnectionPool``:
    ``take`` opens a new one when none is spare)."""

    def __init__(self, conns: List[Any], open_one: Callable[[], Any]) -> None:
        self.store = None
        self.conns = conns
        self._open = open_one

    def __len__(self) -> int:
        return len(self.conns)

    def take(self):
        return self.conns.pop() if self.conns else self._open()

    def give(self, conn) -> None:
        self.conns.append(conn)


def _idle_class() -> None:
    """This thread (and the threads it starts: its heartbeat, its line's reader) runs only when
    no ordinary thread of this host wants the CPU (``SCHED_IDLE``).

    A simulated rank stands for a process on another computer; the controller and the machines'
    agents are what the bench measures. With thousands of rank threads runnable at once (every
    stayer waking at a generation's end), ``nice`` did not keep them off the controller or their
    own agents: nice is a weight per thread, and 4,096 threads at nice 10 outweigh one at 0 (at
    4,096 ranks, 8 machines the bench never touched were declared silent for 5.2 s)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux, or not allowed: the ranks compete as before
        pass


class SimRank:
    """One simulated worker or standby (see the module docstring), run as a thread."""

    def __init__(self, name: str, env: Dict[str, str], counts: OpCounts, timeline: Timeline,
                 on_exit: Callable[["SimRank", str], None], step_s: float, steps: int, pid: int,
                 reader: Optional[LineReader] = None) -> None:
        self.name, self.env, self.counts, self.timeline = name, env, counts, timeline
        self.reader = reader
        """The process's one reader of its ranks' lines to their agents (a worker has its own)."""
        self.on_exit = on_exit
        self.step_s, self.steps = step_s, steps
        self.pid = pid
        self.killed = threading.Event()
        self.role: Optional[int] = None
        self.gen = int(env.get(worker.ENV_GENERATION, 0))
        self.hb: Optional[worker.Heartbeat] = None
        self.local: Optional[LocalLink] = None
        self.watch: Optional[worker.KeyWatch] = None
        self.ended = threading.Event()
        self._told: set = set()
        self._told_lock = threading.Lock()
        self.exit: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name=f"sim-{name}", daemon=True)

    def start(self) -> "SimRank":
        self._thread.start()
        return self

    def kill(self) -> None:
        """As a SIGKILL: no store operation after this one (the thread, if it is blocked in one,
        finds the mark when it returns)."""
        if self.killed.is_set():
            return
        self.killed.set()
        self.ended.set()  # wakes a rank waiting for its generation's end: it finds the mark
        for t in (self.hb, self.watch):
            if t is not None:
                t.stop()
        if self.local is not None:  # a dead process's sockets close: its agent sees it at once
            self.local.close()
        self._exit("signal SIGKILL")

    def _exit(self, how: str) -> None:
        if self.exit is None:
            self.exit = how
            self.on_exit(self, how)

    def _check(self) -> None:
        if self.killed.is_set():
            raise Killed()

    def _run(self) -> None:
        _idle_class()
        try:
            self._main()
        except Killed:
            return
        except Exception as exc:  # noqa: BLE001 - reported as the process's exit
            if not self.killed.is_set():
                self.timeline.error(f"{self.name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
                log.exception("%s failed", self.name)
                self._exit("exit 1")
            return
        finally:
            for t in (self.hb, self.watch):
                if t is not None:
                    t.stop()
        self._exit("0")

    def _look(self, ch: Channel) -> None:
        """The session's per-beat look: the fault and the drain of this generation."""
        if self.killed.is_set():
            return
        gen = self.gen
        info = ch.read(keys.fault(gen), protocol.FAULT)
        ch.read(keys.drain(gen), protocol.DRAIN)
        with self._told_lock:
            if info is None or gen in self._told:
                return
            self._told.add(gen)
        self.timeline.tell(gen, time.time())
        if gen == self.gen:
            self.ended.set()

    def _main(self) -> None:
        env = self.env
        spec = env[ENV_STORE]
        cfg = RuntimeConfig.from_env(env)
        token = env[protocol.ENV_TOKEN]
        world = int(env["WORLD_SIZE"])
        standby = env.get(worker.ENV_STANDBY) == "1"
        store = open_store(spec, self.counts, "join")
        ch = Channel(store, token, lambda k, r: log.warning("[%s] refused %s: %s", self.name, k, r))
        self._check()
        if env.get(ENV_AGENT_SOCK):  # as worker.join: the line to the machine's agent first
            self.local = LocalLink(env[ENV_AGENT_SOCK], int(env[worker.ENV_SLOT]),
                                   None if standby else int(env["RANK"]), self.gen, token, reader=self.reader)
        local = self.local
        slot = worker._authenticate(ch, standby, None if standby else int(env["RANK"]),
                                    slot=int(env[worker.ENV_SLOT]), host=env.get("PITSTOP_NODE_HOST"), pid=self.pid,
                                    said=None if local is None else (lambda: local.send("said")))
        self._check()
        # as worker.join: with the agent's line (and a TCPStore) the heartbeat shares the process's
        # connection and the pool keeps no spare; without it, a connection of its own and four spares
        shared = self.local is not None and not is_etcd(spec)
        hb_conn = CountingStore(store._inner, self.counts, "heartbeat") if shared else \
            open_store(spec, self.counts, "heartbeat")
        self.hb = worker.Heartbeat(slot, cfg.heartbeat_interval_s, ch, hb_conn, self.local).start()
        pool = _Pool([open_store(spec, self.counts, "watch") for _ in range(worker.spare_connections(shared))],
                     lambda: open_store(spec, self.counts, "watch"))
        step = 1
        if standby:
            a = worker._wait_assignment(ch, slot, world, pool)
            self._check()
            if a is None:
                return
            self.role, self.gen = a["role"], a["generation"]
            step = int(a.get("step") or 1)
            if self.local is not None:
                self.local.send(f"role {self.role} {self.gen}")
        else:
            self.role = int(env["RANK"])
            if self.role == 0:
                # tensor parallel inside a machine, data parallel across: a lost machine's shards
                # have their buddy copies on other machines
                ch.put(keys.LAYOUT, {"world_size": world, "tp": int(env.get("LOCAL_WORLD_SIZE", 1)), "pp": 1, "cp": 1, "ep": 1, "etp": None,
                                     "order": "tp-cp-ep-dp-pp", "shard_kind": "dp"})
        self.hb.watchers.append(self._look)  # a session's watchers: a standby has none until it has a role
        if self.local is not None:  # as watch.Watcher: the machine's agent waits on ended(g) and tells us
            hb = self.hb
            self.local.on_ended(lambda _g: self._look(hb.channel))
        else:
            self.watch = worker.KeyWatch(f"ended-{self.name}", lambda: keys.ended(self.gen), self._look, ch,
                                         protocol.STAMP, pool.take()).start()
        store.purpose = "step"  # joined: from here on the main connection serves the step boundary
        vote = (LocalVote(ch, store, world, Fence(), cfg.collective_timeout_s * 2, self.local) if self.local is not None
                else Vote(ch, store, world, Fence(), cfg.collective_timeout_s * 2))
        while step <= self.steps:
            self._check()
            time.sleep(self.step_s)
            self._check()
            t0 = time.time()
            v = vote(self.gen, step, self.role, False)
            self._check()
            self.timeline.vote(self.gen, step, t0, time.time())
            if Verdict.commits(v):
                step += 1
                continue
            # discarded: the controller announces what replaces the failed role (the watch wakes us)
            deadline = time.monotonic() + cfg.collective_timeout_s * 2
            while not self.ended.wait(1.0):  # set by the watch (or by a kill): a thousand ranks
                self._check()                # polling every 50 ms starved the process's agents
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step {step} of g{self.gen} discarded ({v[:80]}), but no fault announced")
            # as Recovery.wait_fault: read until this connection has it (on etcd each client reads
            # its own mirror, which may trail the one whose look woke this thread)
            info = ch.read(keys.fault(self.gen), protocol.FAULT)
            while info is None and time.monotonic() < deadline:
                self._check()
                time.sleep(0.01)
                info = ch.read(keys.fault(self.gen), protocol.FAULT)
            if info is None or info.get("fallback"):
                raise RuntimeError(f"g{self.gen}: a fallback restart ({info}): not simulated")
            self.ended.clear()
            self.gen, step = int(info["generation"]), int(info["step"])


#: A simulated process's pid is this plus its slot: never a real pid (Linux's pid_max is 2**22).
SIM_PID_BASE = 1_000_000_000


class SimProc:
    """What the agent holds of a simulated process (the fields of ``launch.agent.Proc`` it reads)."""

    def __init__(self, name: str, pid: int, env: Dict[str, str]) -> None:
        self.name, self.pid, self.env = name, pid, env
        self.exit: Optional[str] = None
        self.rank: Optional[SimRank] = None

    @property
    def running(self) -> bool:
        return self.exit is None


class SimAgent:
    """A machine's process starter whose processes are :class:`SimRank` threads."""

    def __init__(self, node: int, counts: OpCounts, timeline: Timeline, step_s: float, steps: int,
                 rank_heartbeat_interval: Optional[float] = None, reader: Optional[LineReader] = None,
                 rank_heartbeat_timeout: Optional[float] = None) -> None:
        self.node = node
        self.reader = reader
        self.rank_heartbeat_timeout = rank_heartbeat_timeout
        self.rank_heartbeat_interval = rank_heartbeat_interval
        self.counts, self.timeline = counts, timeline
        self.step_s, self.steps = step_s, steps
        self.procs: Dict[str, SimProc] = {}
        self._exited: List[SimProc] = []
        self._lock = threading.Lock()
        self._rfd, self._wfd = os.pipe()  # an exit writes a byte: wait_exit polls it with the link
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)

    def start(self, name: str, argv, env: Dict[str, str]) -> SimProc:  # noqa: ARG002 - no program is run
        # a pid of its own (the roster tells processes apart by host and pid): the slot, past any real pid
        if self.rank_heartbeat_interval is not None:  # its beat to this machine's agent (scale.Row)
            env = {**env, "PITSTOP_HEARTBEAT_INTERVAL_S": str(self.rank_heartbeat_interval)}
        if self.rank_heartbeat_timeout is not None:  # a rank's own settings check the two are ordered
            env = {**env, "PITSTOP_HEARTBEAT_TIMEOUT_S": str(self.rank_heartbeat_timeout)}
        p = SimProc(name, SIM_PID_BASE + int(env[worker.ENV_SLOT]), env)
        self.procs[name] = p

        def exited(_r: SimRank, how: str, p=p) -> None:
            with self._lock:
                self._exited.append((p, how))
            try:
                os.write(self._wfd, b"x")
            except BlockingIOError:  # the pipe is full: it is readable anyway
                pass

        p.rank = SimRank(name, env, self.counts, self.timeline, exited, self.step_s, self.steps, p.pid,
                         self.reader).start()
        return p

    def poll(self) -> List[SimProc]:
        with self._lock:
            out, self._exited = self._exited, []
        for p, how in out:
            p.exit = how
        return [p for p, _ in out]

    def wait_exit(self, timeout: float, fds=()) -> None:
        """Until a simulated process exits, one of ``fds`` can be read, or ``timeout``."""
        p = select.poll()
        p.register(self._rfd, select.POLLIN)
        for fd in fds:
            p.register(fd, select.POLLIN)
        if p.poll(max(0, int(timeout * 1000))):
            try:
                os.read(self._rfd, 4096)
            except BlockingIOError:
                pass

    def dying(self) -> List[SimProc]:
        return []

    def kill(self, p: SimProc, sig: int = signal.SIGKILL) -> None:  # noqa: ARG002 - any signal kills
        if p.rank is not None:
            p.rank.kill()

    def ranks(self) -> List[SimRank]:
        return [p.rank for p in self.procs.values() if p.rank is not None]

    def log_tail(self, p: SimProc, n: int = 30) -> str:  # noqa: ARG002
        return f"----- [{p.name}] simulated"

    def log_paths(self, p: SimProc) -> Dict[str, str]:
        return {"stdout": f"(simulated) {p.name}", "stderr": f"(simulated) {p.name}"}

    def close(self) -> None:
        for p in self.procs.values():
            if p.rank is not None:
                p.rank.kill()


# ----------------------------------------------------------------------------- processes
def _proc_stats(pid: int = 0) -> Dict[str, Any]:
    """CPU seconds, resident bytes and open descriptors of a process (this one by default)."""
    pid = pid or os.getpid()
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        after = stat[stat.rindex(")") + 2:].split()
        cpu = (int(after[11]) + int(after[12])) / os.sysconf("SC_CLK_TCK")
        rss = int(after[21]) * os.sysconf("SC_PAGE_SIZE")
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return {}
    return {"cpu_s": cpu, "rss_bytes": rss, "fds": fds}


def _report_loop(path: Path, what: Callable[[], Dict[str, Any]], stop: threading.Event, every_s: float = 0.5) -> None:
    tmp = path.with_suffix(".tmp")
    while True:
        try:
            tmp.write_text(json.dumps({"time": time.time(), **what(), **_proc_stats()}))
            tmp.replace(path)
        except OSError:
            pass
        if stop.wait(every_s):
            return


def _raise_fd_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class ScaleController(Controller):
    """The real controller, with its store client counted and no head agent of its own (the
    harness runs machine 0 among the others)."""

    def __init__(self, spec: LaunchSpec, counts: OpCounts) -> None:
        super().__init__(spec)
        self.store = CountingStore(self.store, counts, "controller")
        self.ch.store = self.store
        self.loop_ms: List[float] = []
        self._loop_start: Optional[float] = None
        self._thread_id = threading.get_ident()  # constructed on the thread that runs the loop
        self._loops_lock = threading.Lock()

    def _start_head_agent(self):
        return None

    def _idle(self, seconds: float) -> None:
        now = time.perf_counter()
        if self._loop_start is not None:
            with self._loops_lock:
                self.loop_ms.append((now - self._loop_start) * 1e3)
        super()._idle(seconds)
        self._loop_start = time.perf_counter()

    def sample_slow(self, every_s: float = 0.02, slow_s: float = 0.1) -> None:
        """Where a long loop spends its time: every ``every_s``, while the loop has run for more
        than ``slow_s``, the controller thread's innermost pitstop frames are counted (a sampling
        profile of the slow loops only, which a p99 alone does not explain)."""
        self.slow_stacks: collections.Counter = collections.Counter()
        main = self._thread_id

        def run() -> None:
            while True:
                time.sleep(every_s)
                t = self._loop_start
                if t is None or time.perf_counter() - t < slow_s:
                    continue
                frame = sys._current_frames().get(main)
                names = []
                while frame is not None and len(names) < 4:
                    f = frame.f_code.co_filename
                    if "/pitstop/" in f and "/bench/" not in f:
                        names.append(f"{f.rsplit('/pitstop/', 1)[1]}:{frame.f_code.co_name}")
                    frame = frame.f_back
                with self._loops_lock:
                    self.slow_stacks[" < ".join(names)] += 1

        threading.Thread(target=run, name="slow-loop-sampler", daemon=True).start()

    def slow(self) -> Dict[str, int]:
        """The samples so far, by stack (the bench takes the difference over its window)."""
        with self._loops_lock:
            return dict(getattr(self, "slow_stacks", {}))

    def loops(self) -> Dict[str, Any]:
        """The work of each loop since the last call (ms, idle excluded): count, p50, p99, max."""
        with self._loops_lock:
            got, self.loop_ms = sorted(self.loop_ms), []
        if not got:
            return {"n": 0}
        return {"n": len(got), "p50": got[len(got) // 2], "p99": got[min(len(got) - 1, int(len(got) * 0.99))],
                "max": got[-1]}


def controller_main(args) -> int:
    _raise_fd_limit()
    counts = OpCounts()
    cfg = RuntimeConfig.from_env({"PITSTOP_HEARTBEAT_INTERVAL_S": str(args.heartbeat_interval),
                                  "PITSTOP_HEARTBEAT_TIMEOUT_S": str(args.heartbeat_timeout),
                                  "PITSTOP_COLLECTIVE_TIMEOUT_S": str(args.collective_timeout)})
    spec = LaunchSpec(["simulated"], args.nproc, standby=args.standby, nnodes=args.nnodes,
                      rdzv_endpoint=args.endpoint, run_dir=Path(args.run_dir), config=cfg,
                      rdzv_backend=args.backend, max_restarts=0)
    c = ScaleController(spec, counts)
    stop = threading.Event()
    loops: List[Dict[str, Any]] = []

    c.sample_slow()

    def report() -> Dict[str, Any]:
        loops.append({"t": time.time(), **c.loops()})
        del loops[:-600]
        return {"ops": counts.snapshot(), "loops": loops, "slow_loop_samples": c.slow()}

    threading.Thread(target=_report_loop, args=(Path(args.run_dir) / "scale" / "controller.json", report, stop),
                     daemon=True).start()
    try:
        return c.run()
    finally:
        stop.set()


def host_main(args) -> int:
    """Machines ``args.nodes`` in this process, each a NodeAgent thread running SimRanks.

    These processes stand for other computers, so they yield the CPU to the controller and its
    store (``nice`` 10): at 4,096 ranks the controller's loop, starved by thousands of runnable
    simulated threads, once took 4.9 s for 0.065 CPU s/s of work. A longer switch interval
    (20 ms, not 5) keeps the hundreds of threads that wait for this process's GIL from waking
    every 5 ms to ask for it (the load average passed 3,000)."""
    _raise_fd_limit()
    try:
        os.nice(10)
    except OSError:
        pass
    sys.setswitchinterval(0.02)
    counts, timeline = OpCounts(), Timeline()
    token = os.environ[protocol.ENV_TOKEN]
    os.environ[ENV_STORE] = args.store  # what a worker's own checks read (store.reachable after an error)
    nodes = [int(k) for k in args.nodes.split(",")]
    agents: Dict[int, NodeAgent] = {}
    sims: Dict[int, SimAgent] = {}
    reader = LineReader()  # one thread reads every simulated rank's line to its agent
    for k in nodes:
        sims[k] = SimAgent(k, counts, timeline, args.step_s, args.steps, args.rank_heartbeat_interval, reader,
                           args.rank_heartbeat_timeout)
        addr = args.addr or f"127.0.{(k + 2) // 250}.{(k + 2) % 250 + 1}"
        na = NodeAgent(k, addr, args.nproc, [], Path(args.run_dir), args.store, token,
                       args.heartbeat_interval, agent=sims[k],
                       heartbeat_timeout_s=args.rank_heartbeat_timeout or args.heartbeat_timeout,
                       open_store=lambda: open_store(args.store, counts, "vote"),
                       open_watch_store=lambda: open_store(args.store, counts, "watch"))
        na.store = CountingStore(na.store, counts, "agent")
        na.ch.store = na.store
        agents[k] = na
    stop = threading.Event()

    def report() -> Dict[str, Any]:
        ranks = [r for s in sims.values() for r in s.ranks()]
        return {"ops": counts.snapshot(), "timeline": timeline.to_json(), "nodes": nodes,
                "ranks": sum(1 for r in ranks if r.exit is None)}

    out = Path(args.run_dir) / "scale" / f"host-{nodes[0]}.json"
    threading.Thread(target=_report_loop, args=(out, report, stop), daemon=True).start()

    def commands() -> None:  # from the orchestrator: "kill <role>" (the fault injector's stamp first)
        for line in sys.stdin:
            words = line.split()
            if len(words) == 2 and words[0] == "kill":
                role = int(words[1])
                for s in sims.values():
                    for r in s.ranks():
                        if r.role == role and r.exit is None:
                            ch = Channel(agents[s.node].store, token)
                            ch.put(keys.FAULT_FIRED, {"time": time.time()}, own=False)
                            r.kill()

    threading.Thread(target=commands, daemon=True).start()
    threads = [threading.Thread(target=na.run, name=f"agent-{k}", daemon=True) for k, na in agents.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pitstop-scale-sim")
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("controller")
    c.add_argument("--run-dir", required=True)
    c.add_argument("--nnodes", required=True)
    c.add_argument("--nproc", type=int, default=8)
    c.add_argument("--standby", type=int, default=1)
    c.add_argument("--endpoint", default="127.0.0.1:0")
    c.add_argument("--backend", default="c10d")
    h = sub.add_parser("host")
    h.add_argument("--run-dir", required=True)
    h.add_argument("--store", required=True)
    h.add_argument("--nodes", required=True)
    h.add_argument("--nproc", type=int, default=8)
    h.add_argument("--addr", default=None)
    h.add_argument("--step-s", type=float, default=0.2)
    h.add_argument("--steps", type=int, default=10 ** 6)
    h.add_argument("--rank-heartbeat-interval", type=float, default=None,
                   help="a simulated rank's beat to its agent (default: --heartbeat-interval)")
    h.add_argument("--rank-heartbeat-timeout", type=float, default=None,
                   help="how long an agent lets a rank stay silent (default: --heartbeat-timeout)")
    for q in (c, h):
        q.add_argument("--heartbeat-interval", type=float, default=0.5)
        q.add_argument("--heartbeat-timeout", type=float, default=5.0)
        q.add_argument("--collective-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"scale-{args.what} %(asctime)s %(message)s")
    (Path(args.run_dir) / "scale").mkdir(parents=True, exist_ok=True)
    return controller_main(args) if args.what == "controller" else host_main(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
