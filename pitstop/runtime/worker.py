"""How a process becomes a member of a pitstop job: authenticate, get a role, join the world.

A worker started by the agent already knows its role (``RANK``). A standby
(``PITSTOP_STANDBY=1``) proves the job token, then waits, warm, until the
controller assigns it a role. Without a controller (a plain ``torchrun``) this is
just ``init_world`` and nothing else runs.
"""

from __future__ import annotations

import logging
import os
import sys
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch.distributed as dist

from pitstop import protocol
from pitstop.errors import AuthError, PitstopError
from pitstop.pg import init_world
from pitstop.protocol import Channel, Refused
from pitstop.runtime import keys
from pitstop.runtime.config import RuntimeConfig
from pitstop import store as store_mod
from pitstop.store import ENV_STORE, ConnectionPool, SharedConnection, connect_from_env

log = logging.getLogger(__name__)

ENV_CONTROLLER = "PITSTOP_CONTROLLER"   # "1" when a pitstop controller runs the job
ENV_STANDBY = "PITSTOP_STANDBY"
ENV_GENERATION = "PITSTOP_GENERATION"
ENV_EPOCH = "PITSTOP_EPOCH"
ENV_RESUME = "PITSTOP_RESUME_STEP"      # set on a checkpoint restart
ENV_SLOT = "PITSTOP_SLOT"               # the slot the controller gave the process it started
ENV_LOG = "PITSTOP_LOG"                 # set by pitstop's launchers: the level of pitstop's stderr handler
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class Membership:
    """This process's place in the job."""

    role: int
    """The global rank it plays."""
    world_size: int
    generation: int
    """The roster generation whose groups it builds first."""
    mode: str
    """``worker`` (started with its role), ``recover`` (replaces a failed role),
    ``drain`` (takes over a draining role) or ``restart`` (a checkpoint restart)."""
    slot: int = 0
    """Its applicant slot: its identity towards the controller."""
    epoch: int = 0
    store: Optional[dist.Store] = None
    config: RuntimeConfig = field(default_factory=RuntimeConfig)
    assignment: dict = field(default_factory=dict)
    heartbeat: Optional["Heartbeat"] = None
    joined_at: float = field(default_factory=time.time)
    channel: Optional[Channel] = None
    """The authenticated view of ``store``: every control message goes through it."""
    local: Optional[Any] = None
    """The line to this machine's agent (:class:`pitstop.runtime.local.LocalLink`) when the agent
    offers one (a job of several machines): the heartbeat and the step's vote go there."""
    connections: Optional[ConnectionPool] = None
    """Spare connections to ``store``, opened off the critical path, for the threads a joiner
    or a drain starts (the end-of-generation watch, a drain's channel and hand-off pair): a
    new connection risks stalling the whole store (:class:`pitstop.store.ConnectionPool`)."""
    on_boundary: Optional[Callable[[float, Callable[[], int]], None]] = None
    """Called at the boundary with the iteration's time and a function that returns this rank's
    state bytes (the emulator's pacing hook; it sizes a predicted replacement's state copy)."""

    @property
    def controlled(self) -> bool:
        return self.store is not None

    def take_connection(self) -> Optional[dist.Store]:
        """A spare connection to the control store, or None when none is left (the caller
        opens its own, as before)."""
        if self.connections is None or not len(self.connections):
            return None
        return self.connections.take()

    @property
    def joiner(self) -> bool:
        return self.mode in ("recover", "drain")


_CURRENT: Optional[Membership] = None

ENV_EMULATE = "PITSTOP_EMULATE"
#: Other ways into a job, registered by higher layers: ``hook(config)`` returns this
#: process's membership if it took the join, else None (:func:`on_join`).
_JOIN_HOOKS: List[Callable[[RuntimeConfig], Optional["Membership"]]] = []


def on_join(hook: Callable[[RuntimeConfig], Optional["Membership"]]) -> None:
    """Let ``hook`` take :func:`join` first (the emulator does, under ``pitstop emulate``)."""
    if hook not in _JOIN_HOOKS:
        _JOIN_HOOKS.append(hook)


def current() -> Optional[Membership]:
    return _CURRENT


#: The exit status of a process that stopped because the control store (the controller) went away.
EXIT_CONTROLLER_LOST = 3


def store_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the job's control store still accepts a connection (a fresh client, so a
    broken connection of this process does not answer for the server)."""
    return store_mod.reachable(os.environ[ENV_STORE], timeout_s)


def controller_lost(who: str, exc: BaseException) -> None:
    """Stop this process cleanly because the control store is gone: one clear log line, no
    traceback, exit status :data:`EXIT_CONTROLLER_LOST`. With the embedded store that means
    the controller died; a relaunch resumes from the last ``--save-interval`` checkpoint."""
    where = os.environ.get(ENV_STORE, "")
    cause = "etcd does not answer" if store_mod.is_etcd(where) else "the controller died"
    log.error("%s the control store %s is gone (%s): %s; stopping (exit %d). A relaunch "
              "resumes from the last checkpoint, if --save-interval made one", who, where,
              str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__, cause, EXIT_CONTROLLER_LOST)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CONTROLLER_LOST)


class _StoreThread:
    """A daemon thread with a store connection of its own (a store client is not shared
    across threads) and a sibling of the process's channel (it shares what the process
    owns). Subclasses write :meth:`_run` and stop when ``_stop`` is set."""

    def __init__(self, name: str, main: Channel, conn: Optional[dist.Store] = None) -> None:
        self.store = conn if conn is not None else \
            store_mod.connect(os.environ[ENV_STORE], timeout=timedelta(seconds=30), mirrored=True)
        self.channel = main.sibling(self.store)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        raise NotImplementedError


class Heartbeat(_StoreThread):
    """A daemon thread that bumps this process's heartbeat counter and runs watchers.

    It has its own store connection, except with a line to the machine's agent and a
    ``TCPStore``: it then beats on the line and its rare look shares the process's connection
    (a ``TCPStore`` client runs one operation at a time under its own lock, so sharing is safe;
    the look runs on a thread of its own so that a long wait of another thread never delays a
    beat).
    A process stopped with SIGSTOP stops beating, which is how a hang is seen.

    If the store itself goes away (the controller died), the process stops: a standby at
    once, a worker after ``grace_s``, which leaves its training thread time to meet the
    loss at its next boundary and stop there itself (:func:`controller_lost`); the grace
    only matters when that thread is stuck, so nothing waits forever.
    """

    #: With a line to the machine's agent (:mod:`pitstop.runtime.local`), how often the thread
    #: still looks at the store itself: reassertions and the watchers, which are the fallback of
    #: the end-of-generation watch (a key watch that wakes within a round trip of the write).
    #: At every beat that look cost each rank 3 store operations a beat, which is what made
    #: the store's load grow with ranks.
    LOCAL_LOOK_S = 30.0

    def __init__(self, slot: int, interval_s: float, main: Channel, conn: Optional[dist.Store] = None,
                 local: Optional[Any] = None) -> None:
        super().__init__(f"pitstop-heartbeat-{slot}", main, conn)  # what the process owns is reasserted at every beat
        self.slot = slot
        self.beats = 0
        self.interval_s = interval_s
        self.watchers: List[Callable[[Channel], None]] = []
        self.grace_s = 0.0
        """How long a worker's training thread gets to stop by itself once the store is gone."""
        self.local = local
        """The line to the machine's agent (:class:`pitstop.runtime.local.LocalLink`): beats go
        there, and the agent tells a silent rank to the controller."""
        # the first look comes within LOCAL_LOOK_S, at a random point: ranks that started together
        # would otherwise look together, thousands of them in the same millisecond, every 30 s
        import random

        self._looked = time.monotonic() - random.uniform(0, self.LOCAL_LOOK_S)
        self._look_thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beats += 1
            if self.local is not None and self.local.send(f"beat {self.beats}"):
                # the look runs on a thread of its own: it shares the process's store connection,
                # whose operations wait for one another, and a training thread blocked in a long
                # store wait (a rendezvous) must not stop the beats
                if time.monotonic() - self._looked >= self.LOCAL_LOOK_S and \
                        (self._look_thread is None or not self._look_thread.is_alive()):
                    self._looked = time.monotonic()
                    self._look_thread = threading.Thread(target=self._look, name=f"pitstop-look-{self.slot}",
                                                         daemon=True)
                    self._look_thread.start()
            elif not self._look(beat=True):
                return
            self._stop.wait(self.interval_s)

    def _look(self, beat: bool = False) -> bool:
        """Beat in the store (``beat``: no line to the agent), reassert what the process owns, run
        the watchers. False once the process should stop looking (its store is gone)."""
        try:
            if beat:
                self.channel.put(keys.heartbeat(self.slot), {"n": self.beats}, own=False)
            self.channel.reassert()
            for w in list(self.watchers):
                w(self.channel)
        except Exception as exc:  # noqa: BLE001 - checked below: a dead store, or a passing error
            if self._stop.is_set():
                return False
            if store_reachable():
                log.warning("heartbeat %d: %s", self.slot, str(exc).splitlines()[0][:200])
            else:
                if self.grace_s > 0 and not self._stop.wait(self.grace_s):
                    log.error("heartbeat %d: the training thread did not stop within %.0fs of the store's loss",
                              self.slot, self.grace_s)
                if not self._stop.is_set():
                    controller_lost(f"[slot {self.slot}]", exc)
                return False
        return True


class KeyWatch(_StoreThread):
    """A daemon thread that blocks on one store key and calls back as soon as it is written.

    The heartbeat's watchers run every ``heartbeat_interval_s`` (0.5 s): a stayer blocked in a
    collective on a dead peer waited up to that long after the controller announced the
    fault before its groups were marked broken (seen in the ZeRO-2 bench: one rank of four
    0.47 s behind the others, the whole delta waiting on it). This thread waits on the key
    itself, as the store's ``wait`` does (TCPStore's server answers it when the key is set;
    etcd's watch stream likewise), so the callback runs within a round trip of the write,
    with no polling traffic. The session watches ``keys.ended(g)``, which the controller
    writes after either of generation ``g``'s ends (a fault or a drain): a wait on the fault
    key alone would sit on a key never written once a drain moved the generation on.

    ``key()`` is asked again after each wait; once the callback has run for a key, the thread
    waits for ``key()`` to change before it waits on the store again. A wait that times out
    costs two warning lines in c10d's log (``socket.cpp: waitForInput ... timed out``), so
    the timeout is long: it only bounds how late a key that moved without being written
    (a restarted controller) is followed.
    """

    #: How long one store wait lasts before ``key()`` is looked at again.
    WAIT_S = 300.0

    def __init__(self, name: str, key: Callable[[], str], callback: Callable[[Channel], None], main: Channel,
                 schema: Optional[protocol.Schema] = None, conn: Optional[dist.Store] = None) -> None:
        super().__init__(f"pitstop-watch-{name}", main, conn)
        self.key = key
        self.schema = schema
        self.callback = callback

    def _run(self) -> None:
        done = None
        while not self._stop.is_set():
            key = self.key()
            if key == done:  # acted on already: wait for the key to move on (a new generation)
                self._stop.wait(0.02)
                continue
            try:
                self.store.wait([key], timedelta(seconds=self.WAIT_S))
            except Exception as exc:  # noqa: BLE001 - a timeout (look at key() again), or the store's loss
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    # the heartbeat thread decides what a lost store means; do not spin meanwhile
                    self._stop.wait(1.0)
                continue
            if self.schema is not None and self.channel.read(key, self.schema, present=True) is None:
                # junk under the key (refused and logged once by the channel): the writer puts its
                # own message back (the controller reasserts what it owns every 0.25 s)
                self._stop.wait(0.05)
                continue
            try:
                self.callback(self.channel)
            except Exception as exc:  # noqa: BLE001 - the heartbeat's watcher covers the same ground
                log.warning("watch on %s: %s", key, str(exc).splitlines()[0][:200])
            done = key


def _log_refused(key: str, reason: str) -> None:
    log.warning("refused %s: %s", key, reason)


def _authenticate(ch: Channel, standby: bool, rank: Optional[int], timeout_s: float = 120.0,
                  slot: Optional[int] = None, host: Optional[str] = None, pid: Optional[int] = None,
                  said: Optional[Callable[[], None]] = None) -> int:
    """Prove the job token to the controller; returns this process's slot.

    A process the controller started knows its slot (``PITSTOP_SLOT``) and says hello
    there; anything else applies under ``ctl/apply/<n>``. The hello is sealed with the
    token, so it proves possession without the token crossing the store. It is sent
    again every second until a verdict comes, so a hello overwritten by junk is not
    lost. A verdict that does not verify is ignored, except a plain refusal, which
    only stops this process. ``said`` is called once the hello is written (the line to the
    machine's agent: the controller reads that hello then, instead of looking at every slot
    that has not said hello). ``slot``, ``host`` and ``pid`` default to this process's own
    (the environment's); the scale harness's simulated ranks, many to a process, pass theirs."""
    hello = {"pid": pid or os.getpid(), "host": host or os.environ.get("PITSTOP_NODE_HOST") or socket.gethostname(),
             "standby": standby, "rank": rank}
    if slot is None and os.environ.get(ENV_SLOT):
        slot = int(os.environ[ENV_SLOT])
    if slot is not None:
        hk, vk = keys.join(slot, "hello"), keys.join(slot, "verdict")
    else:
        slot = -1
        i = ch.store.add(keys.APPLY_COUNT, 1)
        hk, vk = keys.apply(i, "hello"), keys.apply(i, "verdict")
    deadline = time.monotonic() + timeout_s
    last_hello = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - last_hello > 1.0:
            ch.put(hk, hello, own=False)
            last_hello = time.monotonic()
            if said is not None:  # the agent tells the controller which hello to read
                said()
                said = None
        # a wait on the verdict, not a poll: polled every 20 ms, 8,192 processes starting together
        # asked the one store 400,000 times a second
        left = min(last_hello + 1.0, deadline) - time.monotonic()
        try:
            ch.store.wait([vk], timedelta(seconds=max(0.05, left)))
        except Exception:  # noqa: BLE001 - not yet (a timeout): say hello again; a lost store fails the put
            continue
        raw = ch.store.get(vk)
        try:
            v = protocol.open_(ch.token, vk, raw, protocol.JOIN_VERDICT)
        except Refused as exc:
            if raw.startswith(b"refused:"):
                raise AuthError(f"the controller refused this process (pid {hello['pid']}, {hk}): "
                                f"{raw.decode(errors='replace')[:300]}") from None
            ch.refuse(vk, exc.reason, raw)
            time.sleep(0.02)  # junk under the verdict: the controller writes its own back
        else:
            if not v["ok"]:
                raise AuthError(f"the controller refused this process (pid {hello['pid']}, {hk}): refused: {v.get('reason')}")
            return int(v.get("slot", slot))
    raise AuthError(f"no verdict on {vk} within {timeout_s:.0f}s (pid {hello['pid']}): is the controller alive?")


#: How often a standby whose key watch is running still reads its assignment and the job's end
#: itself: 4 store operations a look. At 0.1 s that was 40 a second for every standby.
STANDBY_LOOK_S = 2.0


def _wait_assignment(ch: Channel, slot: int, world: int, pool: Optional[ConnectionPool] = None) -> Optional[dict]:
    """Block until the controller gives this standby a role (None: the job is over).

    With a connection of its own from ``pool``, a :class:`KeyWatch` blocks on the
    assignment key and wakes this loop within a round trip of the controller's write
    (polling alone found it 10 ms late on average, on the replacement's critical path);
    the loop still looks every :data:`STANDBY_LOOK_S`, for the end of the job and as the fallback."""
    woke = threading.Event()
    watch, conn = None, None
    if pool is not None:
        conn = pool.take()
        if conn is pool.store:  # a store that cannot clone: a blocking wait would hold everyone's client
            conn = None
        else:
            watch = KeyWatch(f"assign-{slot}", lambda: keys.assign(slot), lambda _ch: woke.set(), ch,
                             protocol.ASSIGN, conn).start()
    a = None
    try:
        while True:
            a = ch.read(keys.assign(slot), protocol.ASSIGN)
            if a is not None:
                if a["role"] < world:
                    return a
                ch.refuse(keys.assign(slot), f"role {a['role']} does not exist in a world of {world}")
            if ch.read(keys.DONE, protocol.FLAG) is not None:
                return None
            if watch is None:
                time.sleep(0.02)
            else:  # the watch wakes this loop at the write; the look is the fallback (and the job's end)
                woke.wait(STANDBY_LOOK_S)
                woke.clear()
    finally:
        if watch is not None:
            watch.stop()
            # it saw the key, so it leaves its store wait within a loop; then the connection is free
            if (woke.is_set() or a is not None) and watch.join(0.5):
                pool.give(conn)


def _setup_logging() -> None:
    """pitstop's log lines go to stderr, rank-prefixed by their callers ([g3 r5 step 120]),
    when the process that started this one asked for it: ``pitstop launch`` and ``pitstop
    emulate`` set :data:`ENV_LOG` for their workers. Without it the library configures no
    handler: a script started by hand, or by torchrun, logs as its own logging set-up says."""
    level = os.environ.get(ENV_LOG, "")
    if not level:
        return
    if level.lower() not in LOG_LEVELS:
        raise PitstopError(f"{ENV_LOG}={level!r}: expected one of {', '.join(LOG_LEVELS)}")
    lg = logging.getLogger("pitstop")
    if not lg.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("pitstop %(asctime)s %(message)s"))
        lg.addHandler(h)
        lg.propagate = False
    lg.setLevel(level.upper())


def _die_with_agent() -> None:
    """Started by a machine's agent: die when it dies, as a machine's processes do.

    torch's elastic multiprocessing starts each child in a session of its own, so a
    SIGKILL of the agent's process group would leave the children running;
    ``PR_SET_PDEATHSIG`` makes the kernel SIGKILL this process when the agent goes."""
    agent = os.environ.get("PITSTOP_AGENT_PID")
    if not agent or not agent.isdigit():
        return
    import ctypes
    import signal as _signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(_signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != int(agent):  # the agent died before the line above
        os._exit(1)


def _freeze_heap() -> None:
    """A standby, done with its imports and warmup: collect once, then move every object left
    into the collector's permanent generation (``gc.freeze``), so that a full collection on
    the joiner's critical path scans only what the role builds. DeepSpeed's ZeRO-3 engine
    calls ``gc.collect()`` while it builds (``zero.utils.defragment``): 0.20 s of a 0.27-0.30 s
    build in a process that holds torch and DeepSpeed, 0.137 s for the whole build after a
    freeze (cProfile, one process, CPU). Paid here, while the standby waits: the collection
    before the freeze is the same 0.2 s. What is frozen was alive at that point and stays
    alive; cycles among those objects that die later are never collected, a loss bounded by
    what was frozen (imports and module state; the torn-down sandbox is collected first)."""
    import gc

    gc.collect()
    gc.freeze()


#: Spare control-store connections each controlled process opens when it joins
#: (:attr:`Membership.connections`): a joiner's end-of-generation watch, a drain's
#: channel thread and hand-off pair, and the asynchronous vote's thread.
THREAD_CONNECTIONS = 4


def spare_connections(shared: bool) -> int:
    """How many spare connections a controlled process opens when it joins.

    With a line to its machine's agent and a ``TCPStore`` (``shared``) none: its heartbeat
    shares the process's connection, the agent waits on the end of each generation for it,
    and its vote goes through the agent. What is left to a spare is a drain's threads, which
    open their own when none is spare (a drain's channel thread and hand-off pair already
    opened 2 of their 3). A rank then holds 1 store connection: at 8,192 ranks on 1,026
    machines the store's server holds about 13,500 descriptors, not 21,700, under the 20,000
    a process may open here. Without the agent's line: :data:`THREAD_CONNECTIONS`."""
    return 0 if shared else THREAD_CONNECTIONS


def _open_spare_connections(store, slot: int):
    """A standby opens the store connection its communicators' rendezvous share while it
    waits, not once it has a role: each new connection costs the store's server a reverse
    DNS lookup, which stalls every client of the job for the resolver's timeout when its
    answer is lost (see :class:`pitstop.store.ConnectionPool`, :class:`SharedConnection`)."""
    t0 = time.perf_counter()
    spare = SharedConnection(store)
    n = spare.reserve(1)
    log.info("[standby %d] %d store connection opened for its communicators in %.3fs", slot, n,
             time.perf_counter() - t0)
    return spare


def _local_link(ch: Channel, standby: bool):
    """The line to this machine's agent, when it offers one (``PITSTOP_AGENT_SOCK``, set by a
    machine's agent for the processes it starts with a slot), else None."""
    from pitstop.runtime.local import ENV_AGENT_SOCK, LocalLink

    name, slot = os.environ.get(ENV_AGENT_SOCK), os.environ.get(ENV_SLOT)
    if not name or not slot:
        return None
    return LocalLink(name, int(slot), None if standby else int(os.environ["RANK"]),
                     int(os.environ.get(ENV_GENERATION, 0)), ch.token)


def join(config: Optional[RuntimeConfig] = None, warmup: Optional[Callable[[], dict]] = None) -> Membership:
    """Become a member of the job described by the environment, and initialise torch.distributed.

    Returns the membership; a standby returns only once it has a role. A standby
    that is dismissed at the end of the job exits the process with status 0.
    ``warmup`` is the script's set-up plus one training step: while it waits, a
    standby runs it once per pipeline stage kind inside the sandbox
    (:mod:`pitstop.runtime.sandbox`). ``config`` overrides the environment's settings.
    """
    global _CURRENT
    _setup_logging()
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
    _die_with_agent()
    from pitstop.patches import gloo_address

    gloo_address.apply()  # a machine's agent set PITSTOP_GLOO_ADDR: gloo listens on the machine's address
    cfg = config if config is not None else RuntimeConfig.from_env()
    world = int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    for hook in _JOIN_HOOKS:  # `pitstop emulate`: a real rank among virtual ones
        m = hook(cfg)
        if m is not None:
            _CURRENT = m
            return _CURRENT
    if os.environ.get(ENV_EMULATE):
        raise PitstopError(f"{ENV_EMULATE} is set (`pitstop emulate`), but nothing took the emulated join: join "
                           "through pitstop.integrations (megatron.init_distributed, deepspeed.initialize), "
                           "which plug the emulator in")
    if os.environ.get(ENV_CONTROLLER) != "1":
        rank = int(os.environ["RANK"])
        init_world(connect_from_env(), rank, world, timeout)
        _CURRENT = Membership(rank, world, int(os.environ.get(ENV_GENERATION, 0)), "worker", config=cfg)
        return _CURRENT
    token = protocol.take_token_from_env()  # the script's own children do not inherit it
    # on etcd: reads and waits from a watched copy (the step vote waits on it every step)
    store = connect_from_env(timeout=timedelta(seconds=max(300.0, cfg.collective_timeout_s)), mirrored=True)
    ch = Channel(store, token, _log_refused)
    standby = os.environ.get(ENV_STANDBY) == "1"
    # The heartbeat's connection opens before the hello: the controller counts this process's
    # silence from its admission, and a new connection can take the resolver's timeout (5 s)
    # when the client's reverse lookup of its own address goes unanswered (c10d names both
    # ends of a new socket; seen as a worker declared hung, silent 5.0 s, before its first
    # beat). Opened first, the first beat follows the verdict within one store round trip.
    local = _local_link(ch, standby)
    shared = local is not None and not store_mod.is_etcd(os.environ[ENV_STORE])
    # With a line to the agent, the heartbeat beats there and looks at the store every 30 s: it
    # shares this process's connection (a TCPStore client runs one operation at a time, under
    # its own lock), and the pool keeps no spare (spare_connections says why). A rank then
    # holds 1 store connection, not 6.
    hb_conn = store if shared else store_mod.connect(os.environ[ENV_STORE], timeout=timedelta(seconds=30), mirrored=True)
    slot = _authenticate(ch, standby, None if standby else int(os.environ["RANK"]),
                         said=None if local is None else (lambda: local.send("said")))
    hb = Heartbeat(slot, cfg.heartbeat_interval_s, ch, hb_conn, local).start()
    raw = ConnectionPool(store)
    raw.reserve(spare_connections(shared))
    epoch = int(os.environ.get(ENV_EPOCH, 0))
    if standby:
        if warmup is not None and cfg.warmup:
            from pitstop.runtime import sandbox

            def interrupted() -> bool:
                return (ch.read(keys.assign(slot), protocol.ASSIGN) is not None
                        or ch.read(keys.DONE, protocol.FLAG) is not None)

            sandbox.warm_up(ch, slot, warmup, interrupted=interrupted, timeout_s=cfg.collective_timeout_s * 5)
        _freeze_heap()
        spare = _open_spare_connections(store, slot)
        log.info("[standby %d] warm and waiting for a role", slot)
        try:
            assignment = _wait_assignment(ch, slot, world, raw)
        except Exception as exc:  # noqa: BLE001 - the store gone is a clean stop; anything else propagates
            if not store_reachable():
                controller_lost(f"[standby {slot}]", exc)
            raise
        if assignment is None:
            log.info("[standby %d] the job is over; leaving", slot)
            os._exit(0)
        role, gen, mode = assignment["role"], assignment["generation"], assignment["mode"]
        os.environ["RANK"] = str(role)
        if local is not None:  # it votes from now on: its agent counts it in its machine's arrivals
            local.send(f"role {role} {gen}")
    else:
        assignment, spare = {}, None
        role, gen = int(os.environ["RANK"]), int(os.environ.get(ENV_GENERATION, 0))
        mode = "restart" if os.environ.get(ENV_RESUME) else "worker"
    hb.grace_s = cfg.collective_timeout_s + 5.0  # a worker's training thread stops by itself at its boundary
    _CURRENT = Membership(role, world, gen, mode, slot, epoch, store, cfg, assignment, hb, channel=ch, connections=raw,
                          local=local)
    # the world group's values and every communicator's rendezvous (gloo addresses) are sealed
    store_mod.JOB_TOKEN = ch.token
    init_world(store, role, world, timeout, epoch=epoch, detached=_CURRENT.joiner, spare=spare)
    if _CURRENT.joiner:  # builds its role without talking to anyone until the session takes its state
        from pitstop.pg import FENCE

        FENCE.local = True
    return _CURRENT


def defers_groups() -> bool:
    """Whether this process's groups are built in the background: a joiner, whose fence is
    local until its session takes the state (:meth:`pitstop.groups.GroupRegistry.build`)."""
    from pitstop.pg import FENCE

    return _CURRENT is not None and _CURRENT.joiner and FENCE.local


def ring_kind(shard_kind: str) -> Optional[str]:
    """The kind whose communicators get a private twin for the buddy ring (``ring_kind`` of
    :class:`pitstop.groups.GroupRegistry`): the shard kind, in a controlled process whose
    boundary exchanges the buddy copy in the background (``async_commit``), else None."""
    m = _CURRENT
    if m is None or not m.controlled or not (m.config.async_commit and m.config.buddy):
        return None
    return shard_kind


def require_current() -> Membership:
    if _CURRENT is None:
        raise PitstopError("this process has not joined a pitstop job: call pitstop.runtime.worker.join() first")
    return _CURRENT
