"""How a process becomes a member of a pitstop job: authenticate, get a role, join the world.

A worker started by the agent already knows its role (``RANK``). A standby
(``PITSTOP_STANDBY=1``) proves the job token, then waits, warm, until the
controller assigns it a role. Without a controller (a plain ``torchrun``) this is
just ``init_world`` and nothing else runs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, List, Optional

import torch.distributed as dist

from pitstop.errors import AuthError, PitstopError
from pitstop.launch.jobtoken import mac, token_from_env
from pitstop.pg import init_world
from pitstop.runtime import keys
from pitstop.runtime.config import RuntimeConfig
from pitstop.store import ENV_STORE, connect_from_env, parse_endpoint

log = logging.getLogger("pitstop.worker")

ENV_CONTROLLER = "PITSTOP_CONTROLLER"   # "1" when a pitstop controller runs the job
ENV_STANDBY = "PITSTOP_STANDBY"
ENV_GENERATION = "PITSTOP_GENERATION"
ENV_EPOCH = "PITSTOP_EPOCH"
ENV_RESUME = "PITSTOP_RESUME_STEP"      # set on a checkpoint restart


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

    @property
    def controlled(self) -> bool:
        return self.store is not None

    @property
    def joiner(self) -> bool:
        return self.mode in ("recover", "drain")


_CURRENT: Optional[Membership] = None


def current() -> Optional[Membership]:
    return _CURRENT


class Heartbeat:
    """A daemon thread that bumps this process's heartbeat counter and runs watchers.

    It has its own store connection (a store client is not shared across threads).
    A process stopped with SIGSTOP stops beating, which is how a hang is seen.
    """

    def __init__(self, slot: int, interval_s: float) -> None:
        host, port = parse_endpoint(os.environ[ENV_STORE])
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self.slot = slot
        self.interval_s = interval_s
        self.watchers: List[Callable[[dist.Store], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pitstop-heartbeat-{slot}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(keys.heartbeat(self.slot), 1)
                for w in list(self.watchers):
                    w(self.store)
            except Exception as exc:  # noqa: BLE001 - the controller went away; nothing to beat for
                log.debug("heartbeat %d: %s", self.slot, exc)
                return
            self._stop.wait(self.interval_s)


def _authenticate(store: dist.Store, standby: bool, rank: Optional[int]) -> int:
    """Prove the job token to the controller; returns this process's slot."""
    slot = store.add(keys.JOIN_COUNT, 1)
    store.set(keys.join(slot, "hello"), json.dumps({
        "pid": os.getpid(), "host": socket.gethostname(), "standby": standby, "rank": rank,
    }))
    store.wait([keys.join(slot, "nonce")], timedelta(seconds=60))
    nonce = store.get(keys.join(slot, "nonce"))
    store.set(keys.join(slot, "mac"), mac(token_from_env(), nonce, str(slot)))
    store.wait([keys.join(slot, "verdict")], timedelta(seconds=60))
    verdict = store.get(keys.join(slot, "verdict")).decode()
    if verdict != "ok":
        raise AuthError(f"the controller refused this process (pid {os.getpid()}, slot {slot}): {verdict}")
    return slot


def _wait_assignment(store: dist.Store, slot: int) -> Optional[dict]:
    """Block until the controller gives this standby a role (None: the job is over)."""
    while True:
        if store.check([keys.assign(slot)]):
            return json.loads(store.get(keys.assign(slot)))
        if store.check([keys.DONE]):
            return None
        time.sleep(0.02)


def _setup_logging() -> None:
    """pitstop's log lines go to stderr, rank-prefixed by their callers ([g3 r5 step 120])."""
    lg = logging.getLogger("pitstop")
    if not lg.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("pitstop %(asctime)s %(message)s"))
        lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False


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
    cfg = config if config is not None else RuntimeConfig.from_env()
    world = int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    from pitstop.emulation.runtime import EmulationConfig

    emu = EmulationConfig.from_env()
    if emu is not None:  # `pitstop emulate`: a real rank among virtual ones
        from pitstop.emulation import runtime as emulation

        rank = int(os.environ["RANK"])
        emulation.join(emu, rank)
        _CURRENT = Membership(rank, world, 0, "emulate", config=cfg)
        return _CURRENT
    if os.environ.get(ENV_CONTROLLER) != "1":
        rank = int(os.environ["RANK"])
        init_world(connect_from_env(), rank, world, timeout)
        _CURRENT = Membership(rank, world, int(os.environ.get(ENV_GENERATION, 0)), "worker", config=cfg)
        return _CURRENT
    store = connect_from_env(timeout=timedelta(seconds=max(300.0, cfg.collective_timeout_s)))
    standby = os.environ.get(ENV_STANDBY) == "1"
    slot = _authenticate(store, standby, None if standby else int(os.environ["RANK"]))
    hb = Heartbeat(slot, cfg.heartbeat_interval_s).start()
    epoch = int(os.environ.get(ENV_EPOCH, 0))
    if standby:
        if warmup is not None and cfg.warmup:
            from pitstop.runtime import sandbox

            def interrupted() -> bool:
                return store.check([keys.assign(slot)]) or store.check([keys.DONE])

            sandbox.warm_up(store, slot, warmup, interrupted=interrupted, timeout_s=cfg.collective_timeout_s * 5)
        log.info("[standby %d] warm and waiting for a role", slot)
        assignment = _wait_assignment(store, slot)
        if assignment is None:
            log.info("[standby %d] the job is over; leaving", slot)
            os._exit(0)
        role, gen, mode = assignment["role"], assignment["generation"], assignment["mode"]
        os.environ["RANK"] = str(role)
    else:
        assignment = {}
        role, gen = int(os.environ["RANK"]), int(os.environ.get(ENV_GENERATION, 0))
        mode = "restart" if os.environ.get(ENV_RESUME) else "worker"
    _CURRENT = Membership(role, world, gen, mode, slot, epoch, store, cfg, assignment, hb)
    init_world(store, role, world, timeout, epoch=epoch, detached=_CURRENT.joiner)
    if _CURRENT.joiner:  # builds its role without talking to anyone until the session takes its state
        from pitstop.pg import FENCE

        FENCE.local = True
    return _CURRENT


def require_current() -> Membership:
    if _CURRENT is None:
        raise PitstopError("this process has not joined a pitstop job: call pitstop.runtime.worker.join() first")
    return _CURRENT
