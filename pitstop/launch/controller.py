"""The controller: hosts the control store, owns the roster and the event log, drives both data flows.

::

    pitstop launch ──> Controller ── TCPStore (embedded, loopback by default)
                          │  roster g0 -> g1 -> ...      events.jsonl, roster.json
                          └─ Agent (this machine) ── workers r0..rN-1, standbys

Unplanned: a worker exits (or stops beating and is killed) -> pick a standby ->
roster g+1 -> announce the fault in the store (stayers roll back and rebuild the
delta) -> assign the role to the standby. Planned (``pitstop drain``): assign the
joiner, let everyone prepare in the background, switch at the next boundary.
With no standby left: an explicit, logged checkpoint restart; never a hang.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from pitstop import protocol
from pitstop.errors import PitstopError
from pitstop.launch.agent import Agent, Proc
from pitstop.launch.changes import change_event
from pitstop.launch.drain import Drains
from pitstop.launch.events import CHECKPOINTS, CONTROLLER, ROSTER, EventLog, write_private
from pitstop.launch.nodes import Nodes
from pitstop.launch.remote import Lookout, RemoteAgents
from pitstop.launch.restart import Restarts
from pitstop.launch.local import worker_env
from pitstop.protocol import ENV_TOKEN, Channel, Refused, Verdict, new_token
from pitstop.roster import ProcessInfo, Roster
from pitstop.runtime import keys
from pitstop.runtime.config import RuntimeConfig
from pitstop.runtime.worker import ENV_CONTROLLER, ENV_EPOCH, ENV_GENERATION, ENV_SLOT, ENV_STANDBY
from pitstop.store import connect, etcd_spec, host_store, parse_endpoint

log = logging.getLogger(__name__)


@dataclass
class LaunchSpec:
    """What ``pitstop launch`` was asked to run."""

    argv: List[str]
    """The training script and its arguments."""
    nproc_per_node: int
    standby: int = 0
    nnodes: Any = 1
    """Machines: an int, or ``"MIN:MAX"`` (MAX - MIN standby machines); parsed into :class:`Nodes`."""
    rdzv_endpoint: Optional[str] = None
    run_dir: Path = Path("runs/latest")
    config: RuntimeConfig = field(default_factory=RuntimeConfig)
    env: Dict[str, str] = field(default_factory=dict)
    """Extra environment for every process (e.g. ``PITSTOP_FAULT``)."""
    local_addr: Optional[str] = None
    """This machine's address (its gloo groups listen there); default: the store's host."""
    rdzv_backend: str = "c10d"
    """``c10d``: the controller hosts a ``TCPStore`` (its death ends the job); ``etcd``: the
    control plane lives in the etcd at ``rdzv_endpoint`` and outlives the controller."""
    max_restarts: int = 3
    """Full restarts (from the checkpoint, or from scratch) before the job is given up, as
    torchrun's flag of that name: a cause that repeats (a script that always fails at step
    N) ends the job with its reason instead of restarting it forever. Replacements by a
    standby and drains are not restarts and are not counted."""

    def __post_init__(self) -> None:
        if self.rdzv_backend not in BACKENDS:
            raise PitstopError(f"--rdzv-backend {self.rdzv_backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.rdzv_backend == "etcd" and not self.rdzv_endpoint:
            raise PitstopError("--rdzv-backend etcd: give --rdzv-endpoint HOST:PORT, the address of an etcd "
                               "client URL (etcd's default port is 2379)")
        if self.rdzv_backend == "etcd":
            etcd_spec(self.rdzv_endpoint, "check")  # a port etcd can listen on, or an error naming it
        if self.nproc_per_node < 1:
            raise PitstopError(f"--nproc-per-node({self.nproc_per_node}) must be >= 1")
        if self.standby < 0:
            raise PitstopError(f"--standby({self.standby}) must be >= 0")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise PitstopError(f"--max-restarts({self.max_restarts!r}) must be an integer >= 0")
        self.nodes = self.nnodes if isinstance(self.nnodes, Nodes) else Nodes.parse(str(self.nnodes))
        if not self.argv:
            raise PitstopError("no training script given: pitstop launch [options] -- SCRIPT ARGS...")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nodes.min

    @property
    def multi_node(self) -> bool:
        return self.nodes.max > 1

    @property
    def agents_apart(self) -> bool:
        """Every machine's processes are run by an agent process of its own: with several
        machines, and with etcd, where the head's agent must outlive the controller."""
        return self.multi_node or self.rdzv_backend == "etcd"

    def to_json(self) -> Dict[str, Any]:
        """What ``--resume`` needs to run this job's controller again."""
        return {"argv": self.argv, "nproc_per_node": self.nproc_per_node, "standby": self.standby,
                "nnodes": str(self.nnodes), "rdzv_endpoint": self.rdzv_endpoint, "run_dir": str(self.run_dir),
                "config": self.config.to_env(), "env": self.env, "local_addr": self.local_addr,
                "rdzv_backend": self.rdzv_backend, "max_restarts": self.max_restarts}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "LaunchSpec":
        return cls(list(d["argv"]), int(d["nproc_per_node"]), int(d["standby"]), d["nnodes"], d["rdzv_endpoint"],
                   Path(d["run_dir"]), RuntimeConfig.from_env(d["config"]), dict(d["env"]), d.get("local_addr"),
                   d.get("rdzv_backend", "c10d"), int(d.get("max_restarts", 3)))


#: ``--rdzv-backend`` values (torchrun's spelling).
BACKENDS = ("c10d", "etcd")
#: The launch's spec, for ``pitstop launch --resume`` (and a restarted controller).
LAUNCH_FILE = "launch.json"
ENV_JOB = "PITSTOP_JOB_ID"


@dataclass
class Member:
    slot: int
    proc: Optional[Proc]
    info: ProcessInfo
    standby: bool
    node: int = 0
    """The machine (agent) the process runs on."""
    machine: bool = False
    """One of a standby machine's standbys (not refilled: a machine is not ours to restart)."""
    beats: int = -1
    last_beat: float = field(default_factory=time.monotonic)


def starting_wait(admitted: int, starting: int, needed: int, waited_s: float, limit_s: float) -> str:
    """Does a failure that needs ``needed`` standbys wait for standbys still starting?

    ``"no"``: enough are admitted, or too few are admitted and coming together; ``"wait"``:
    enough would be there once the ``starting`` ones said hello, and the wait is under
    ``limit_s``; ``"waited"``: they were awaited ``limit_s`` and did not come. Under load a
    standby process can take longer to start than the workers take to reach the step that
    fails: seen on 2 busy cores, a job lost rank 2 in step 2 with both of its standbys still
    importing, and ended 'failed' although two standbys were on their way."""
    if admitted >= needed or admitted + starting < needed:
        return "no"
    return "waited" if waited_s > limit_s else "wait"


class Controller:
    """Runs one job to its end (see the module docstring)."""

    def __init__(self, spec: LaunchSpec, resume: bool = False) -> None:
        self.spec = spec
        self.cfg = spec.config
        self.run_dir = Path(spec.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.resume = resume
        self.job = ""
        if spec.rdzv_backend == "etcd":  # the store outlives this process: its supervisor chose job and token
            self.job = os.environ.get(ENV_JOB, "")
            if not self.job:
                raise PitstopError(f"an etcd-backed controller needs {ENV_JOB} (set by pitstop launch)")
            self.store_spec = etcd_spec(spec.rdzv_endpoint, self.job)
            self.store = connect(self.store_spec, mirrored=True)
            self.host, self.port = spec.local_addr or "127.0.0.1", None
        else:
            host, port = parse_endpoint(spec.rdzv_endpoint) if spec.rdzv_endpoint else ("127.0.0.1", 0)
            self.store = host_store(host, port)
            self.host, self.port = host, self.store.port
            self.store_spec = f"{host}:{self.port}"
        self.token = new_token()
        if spec.multi_node or spec.rdzv_backend == "etcd":
            # every machine's agent must hold the same secret (and a restarted controller too):
            # it comes from the environment
            self.token = os.environ.get(ENV_TOKEN, "")
            if len(self.token) < 32:
                raise PitstopError(f"--nnodes {spec.nodes.min}:{spec.nodes.max}: set {ENV_TOKEN} to the same secret "
                                   f"of at least 32 characters on every machine (e.g. `export {ENV_TOKEN}=$(openssl "
                                   "rand -hex 32)` before srun)")
        self.events = EventLog(self.run_dir)
        self.ch = Channel(self.store, self.token, self._refused)
        self.next_slot = 1
        self.expected: Dict[int, Dict[str, Any]] = {}  # slot -> what the agent started there, until it says hello
        self.apply_next = 1
        self.applicants: Dict[int, float] = {}        # unsolicited applicant -> when it was seen
        self.committed: Optional[tuple] = None        # (generation, step, time) of the last verified commit
        self.lost: Dict[int, tuple] = {}               # role -> (proc, reason, seen): gathered for settle_s, then one failure
        self.lost_at = 0.0
        self.settled_after = 0.0                      # how long the last failure's settle window lasted
        self.refill = 0                                # standbys to start once the change under way is over
        self.lost_detected = 0.0
        self.lost_waiting = False                      # a failure waits for standbys still starting
        self._lookout = Lookout()                      # process heartbeats: silence unseen is not counted
        self.agent: Any = (RemoteAgents(self.ch, self.run_dir, spec.nodes.max, self.cfg.heartbeat_timeout_s,
                                        self._node_lost, confirm_s=self.confirm_s(), probe_s=self.probe_s(),
                                        link_host=self.host, on_refused=self._refused)
                           if spec.agents_apart else Agent(self.run_dir))
        self.poison_seen: Optional[tuple] = None      # kept in the saved state for older controllers' state
        self.members: Dict[int, Member] = {}          # by slot
        self.roster: Optional[Roster] = None
        self.role_slots: Dict[int, int] = {}          # role -> slot
        self.pool: List[int] = []                     # standby slots, in join order
        self.epoch = 0
        self.generation = 0
        self.next_join = 1
        self.pending: List[Dict[str, Any]] = []       # changes waiting for their first step after
        self.restarts = Restarts(self)                # the checkpoint fallback and the full restart
        self.drains = Drains(self)                    # planned drains: requests, queue, the one under way
        self.leavers: set = set()
        self.stopping: set = set()                    # names of processes stopped on purpose
        self.sb_count = 0
        self.finished: set = set()
        self.exit_code: Optional[int] = None
        self.recorded: set = set()                    # role classes whose warmup record was published
        self.warm_seen: set = set()                   # standby slots whose warmup report was logged
        self._warm_check = 0.0
        self.warm_all = False
        self.standbys_taken = 0
        # mode 0600: it holds the job token, which `pitstop drain` needs to sign its request
        write_private(self.run_dir / CONTROLLER, json.dumps({"host": self.host, "port": self.port, "pid": os.getpid(),
                                                             "token": self.token, "store": self.store_spec,
                                                             "job": self.job}))
        self._persisted = ""
        self._persist_at = 0.0
        self._last_look: Dict[str, float] = {}
        self._disown_at: List[tuple] = []             # (when, key): owned only that long (_admit)

    def _refused(self, key: str, reason: str) -> None:
        log.warning("refused %s: %s", key, reason)
        self.events.write("refused", key=key, reason=reason)

    # ------------------------------------------------------------------ processes
    def _env(self, rank: int, extra: Dict[str, str]) -> Dict[str, str]:
        env = worker_env(rank, self.spec.world_size, rank % self.spec.nproc_per_node, self.host, self.port,
                         store=self.store_spec if self.port is None else None)
        env["LOCAL_WORLD_SIZE"] = str(self.spec.nproc_per_node)
        env.update(self.cfg.to_env())
        if not self.cfg.save_dir:
            env["PITSTOP_SAVE_DIR"] = str(self.run_dir / CHECKPOINTS)
        env.update({ENV_CONTROLLER: "1", ENV_TOKEN: self.token, "PITSTOP_RUN_DIR": str(self.run_dir),
                    ENV_EPOCH: str(self.epoch), ENV_GENERATION: str(self.generation)})
        env.update(self.spec.env)
        env.update(extra)
        return env

    def _new_slot(self) -> int:
        self.next_slot += 1
        return self.next_slot - 1

    def _spawn(self, name: str, env: Dict[str, str], node: int):
        if self.spec.agents_apart:
            return self.agent.start(name, env, node)
        return self.agent.start(name, self.spec.argv, env)

    def _start_worker(self, rank: int, extra: Optional[Dict[str, str]] = None, node: Optional[int] = None) -> Proc:
        name = f"w{rank}" + (f"-e{self.epoch}" if self.epoch else "")
        slot = self._new_slot()
        if node is None:
            node = self.spec.nodes.node_of(rank, self.spec.nproc_per_node)
        p = self._spawn(name, self._env(rank, {**(extra or {}), ENV_SLOT: str(slot)}), node)
        self.expected[slot] = {"proc": p, "standby": False, "rank": rank, "node": node}
        return p

    def _start_standby(self, node: int = 0, local_rank: int = 0, machine: bool = False) -> Proc:
        """A standby process: on the head (refilled when used), or one of a standby machine's."""
        self.sb_count += 1
        slot = self._new_slot()
        env = self._env(0, {ENV_STANDBY: "1", "RANK": "-1", ENV_SLOT: str(slot), "LOCAL_RANK": str(local_rank)})
        env.pop("PITSTOP_FAULT", None)
        p = self._spawn(f"sb{self.sb_count}" + (f"-n{node}" if machine else ""), env, node)
        self.expected[slot] = {"proc": p, "standby": True, "rank": None, "node": node, "machine": machine}
        return p

    def _start_head_agent(self):
        return start_head_agent(self.spec, self.token, self.store_spec, self.host)

    def confirm_s(self) -> float:
        """The agent silence that confirms a machine's loss once a failure has been reported:
        four agent heartbeats, at least 1 s (never more than the heartbeat timeout)."""
        return min(self.cfg.heartbeat_timeout_s, max(4 * self.cfg.heartbeat_interval_s, 1.0))

    def probe_s(self) -> float:
        """How long a machine's agent has to answer a probe once a failure has been reported:
        one heartbeat interval, at least 0.5 s (a live agent answers on its next 20 ms loop)."""
        return min(self.confirm_s(), max(self.cfg.heartbeat_interval_s, 0.5))

    def _node_lost(self, node: int, silent_s: float) -> None:
        self.events.write("machine-lost", node=node, silent_s=round(silent_s, 2),
                          after_reported_failure=self.agent.suspecting(), cause=self.agent.nodes[node].cause,
                          roles=sorted(r for r, s in self.role_slots.items() if self.members[s].node == node))

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        # with etcd the head's agent is the supervisor's (it outlives this process)
        head_agent = self._start_head_agent() if self.spec.multi_node and self.spec.rdzv_backend != "etcd" else None
        if self.resume:
            self._restore()
        else:
            self.events.write("launch", world_size=self.spec.world_size, standby=self.spec.standby,
                              store=self.store_spec, argv=self.spec.argv)
            for r in range(self.spec.world_size):
                self._start_worker(r)
            for _ in range(self.spec.standby):
                self._start_standby()
            for k in range(self.spec.nodes.min, self.spec.nodes.max):  # standby machines
                for i in range(self.spec.nproc_per_node):
                    self._start_standby(node=k, local_rank=i, machine=True)
        try:
            while self.exit_code is None:
                if self._due("reassert", self.REASSERT_S):  # junk over the controller's own messages
                    while self._disown_at and self._disown_at[0][0] <= time.monotonic():
                        self.ch.disown(self._disown_at.pop(0)[1])
                    self.ch.reassert()
                if self.spec.agents_apart:
                    # the agents speak for their ranks: a poisoned step comes as a link line
                    # (launch.hub), so the last commit is only needed while a change waits for it
                    if self._due("commit", self.LOOK_S if self.pending else self.IDLE_LOOK_S):
                        self._read_committed()
                elif self._due("commit", self.LOOK_S):
                    self._read_committed()
                if self.spec.agents_apart and self.expected:
                    # the agents say whose hello was written; every slot is looked at once a second,
                    # for a process that could not say so (looking at all of them every 50 ms was
                    # O(processes) operations per look while thousands started)
                    told = self.agent.take_hellos()
                    if self._due("admit", self.IDLE_LOOK_S):
                        self._admit()
                    elif told:
                        self._admit(told)
                elif self.expected and self._due("admit", self.LOOK_S):
                    self._admit()
                elif not self.expected and self._due("applicants", self.IDLE_LOOK_S):
                    self._applicants()
                self._settle()
                for p in self.agent.poll():
                    self._on_exit(p)
                for p, silent in self.agent.take_hung() if self.spec.agents_apart else ():
                    self._hung(p, silent)
                self._settle()  # a loss seen just now may be all there is to gather (see _settle)
                # with machines' agents, each watches its own processes' beats (launch.hub) and
                # reports a silent one: the store holds no per-process heartbeat to read
                if not self.spec.agents_apart and self._due("heartbeats", self.heartbeat_look_s()):
                    self._check_heartbeats()
                busy = self.drains.current is not None or bool(self.drains.queue)
                if self._due("drains", self.LOOK_S if busy else self.DRAIN_LOOK_S):
                    self.drains.check()
                self._progress()
                self._refill()
                self._watch_warmup()
                self._persist()
                self._idle(0.01)
        finally:
            self.ch.put(keys.DONE, {"set": True})
            time.sleep(0.2)
            self.agent.close()
            if head_agent is not None:  # it sees ctl/done and stops its processes
                try:
                    head_agent.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    head_agent.kill()
        return self.exit_code

    #: How often the loop looks at what only changes with a step or a request (the last commit,
    #: a poisoned step, hellos, drain requests): each look is a store round trip or two, and the
    #: loop turns every 10 ms, so looking at every turn was ~400 operations a second on the one
    #: store, whatever the job did. 50 ms is a fifth of a heartbeat interval.
    LOOK_S = 0.05
    #: The same for what nobody waits on: the last commit while no change needs it (with machines'
    #: agents), applicants that were never started by an agent.
    IDLE_LOOK_S = 1.0
    #: How often the warmup records and the standbys' warmup reports are looked for (two store
    #: operations per standby that has not reported; one started without a warmup never does).
    WARM_LOOK_S = 1.0
    #: How often a drain request (``pitstop drain``, a person's or a health check's) is looked for.
    DRAIN_LOOK_S = 0.25
    #: How often the controller's own messages are checked for junk written over them.
    REASSERT_S = 0.25
    #: How long an admitted process's verdict is kept against junk: it reads it within a store
    #: round trip (it waits on it), and one that misses it says hello again every second. Kept
    #: for good, every process's verdict cost two store operations at every reassertion.
    VERDICT_OWNED_S = 10.0

    def heartbeat_look_s(self) -> float:
        """How often every process's heartbeat is read (two store operations each): a quarter of
        a heartbeat interval, at most 0.25 s; reading them at every 10 ms turn cost 200
        operations per process per second."""
        return min(0.25, self.cfg.heartbeat_interval_s / 4)

    def _due(self, what: str, period_s: float) -> bool:
        """Whether ``what`` is due (its period passed since it last was); marks it done."""
        now = time.monotonic()
        if now - self._last_look.get(what, -1e9) < period_s:
            return False
        self._last_look[what] = now
        return True

    # ------------------------------------------------------------------ re-attaching (etcd)
    def _state(self) -> Dict[str, Any]:
        """Everything this controller knows that is not in the store already, as JSON: what a
        restarted controller needs to go on (:meth:`_restore`). Processes are named, never
        held: the agents hold them."""
        def member(m: Member) -> Dict[str, Any]:
            return {"slot": m.slot, "proc": m.proc.name if m.proc is not None else None, "host": m.info.host,
                    "pid": m.info.pid, "standby": m.standby, "node": m.node, "machine": m.machine}

        return {
            "next_slot": self.next_slot, "apply_next": self.apply_next, "epoch": self.epoch,
            "generation": self.generation, "next_join": self.next_join,
            "sb_count": self.sb_count, "standbys_taken": self.standbys_taken, "warm_all": self.warm_all,
            # not the last commit: it moves every step, and the store holds it (ctl/committed)
            "poison_seen": list(self.poison_seen) if self.poison_seen else None,
            "expected": [{"slot": sl, "proc": e["proc"].name, "standby": e["standby"], "rank": e["rank"],
                          "node": e.get("node", 0), "machine": e.get("machine", False)} for sl, e in self.expected.items()],
            "members": [member(m) for m in self.members.values()],
            "roster": json.loads(self.roster.to_json()) if self.roster is not None else None,
            "role_slots": [[r, sl] for r, sl in self.role_slots.items()], "pool": list(self.pool),
            "pending": self.pending, "refill": self.refill, **self.drains.state(),
            "leavers": sorted(self.leavers), "stopping": sorted(self.stopping), "finished": sorted(self.finished),
            "recorded": sorted(self.recorded), "warm_seen": sorted(self.warm_seen),
            "lost": [[r, p.name, why] for r, (p, why, _) in self.lost.items()],
            "agents": self.agent.state(),
        }

    def _persist(self) -> None:
        """Write :meth:`_state` to the store when it changed (at most every 0.1 s): with etcd, a
        restarted controller re-attaches from it. A no-op with the embedded store, which
        dies with this process anyway."""
        if self.spec.rdzv_backend != "etcd":
            return
        now = time.monotonic()
        if now - self._persist_at < 0.1:
            return
        self._persist_at = now
        text = json.dumps(self._state(), sort_keys=True)
        if text != self._persisted:
            # chunked (:meth:`pitstop.protocol.Channel.put_big`): at ~1,100 ranks the state passes
            # the 256 KiB message limit, and etcd refuses a request over 1.5 MiB. Not owned: the
            # reader checks the digest, and reasserting every chunk four times a second would cost
            # O(ranks) bytes forever; junk over it is refused by name at --resume.
            self.ch.put_big(keys.CONTROLLER_STATE, json.loads(text), own=False)
            self._persisted = text

    def _restore(self) -> None:
        """Re-attach: take the state the previous controller left in etcd, and the agents' view.
        The workers, standbys and agents never stopped; what happened meanwhile (exits,
        hellos, commits, drain requests) is in the store and is read on the next loop."""
        st = self.ch.read_big(keys.CONTROLLER_STATE, protocol.CONTROLLER_STATE)
        if st is None:
            raise PitstopError(f"--resume: the store {self.store_spec} holds no controller state for this job "
                               "(the job ended, or another job's run directory was given)")
        try:
            self._take_state(st)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise PitstopError(f"--resume: the controller state in {self.store_spec} is not one this version "
                               f"can take over ({type(exc).__name__}: {exc})") from None
        self.events.write("controller-resumed", pid=os.getpid(), generation=self.roster.generation if self.roster else None,
                          committed=list(self.committed) if self.committed else None,
                          members=len(self.members), standbys=len(self.pool))
        log.info("re-attached: generation %s, %d processes, %d standbys", self.roster.generation if self.roster else None,
                 len(self.members), len(self.pool))

    def _take_state(self, st: Dict[str, Any]) -> None:
        unrecorded = self.agent.restore(st["agents"])
        procs = self.agent.procs
        self.next_slot, self.apply_next, self.epoch = st["next_slot"], st["apply_next"], st["epoch"]
        self.generation, self.next_join = st["generation"], st["next_join"]
        self.sb_count, self.standbys_taken, self.warm_all = st["sb_count"], st["standbys_taken"], st["warm_all"]
        self.committed = None
        self._read_committed()
        self.poison_seen = tuple(st["poison_seen"]) if st["poison_seen"] else None
        self.expected = {e["slot"]: {"proc": procs[e["proc"]], "standby": e["standby"], "rank": e["rank"],
                                     "node": e["node"], "machine": e["machine"]} for e in st["expected"]}
        self.members = {m["slot"]: Member(m["slot"], procs.get(m["proc"]) if m["proc"] else None,
                                          ProcessInfo(m["host"], m["pid"]), m["standby"], node=m["node"],
                                          machine=m["machine"]) for m in st["members"]}
        self.roster = Roster.from_json(json.dumps(st["roster"])) if st["roster"] is not None else None
        self.role_slots = {int(r): int(sl) for r, sl in st["role_slots"]}
        self.pool = [int(x) for x in st["pool"]]
        self.refill = int(st.get("refill", 0))
        self.pending = list(st["pending"])
        self.drains.take_state(st)
        self.leavers, self.stopping = set(st["leavers"]), set(st["stopping"])
        self.finished, self.recorded, self.warm_seen = set(st["finished"]), set(st["recorded"]), set(st["warm_seen"])
        self.lost = {int(r): (procs[name], why, time.time()) for r, name, why in st["lost"]}
        self.lost_at = time.monotonic()
        for node, cmd in unrecorded:  # started after the last saved state: adopt, so its hello is admitted
            env = cmd.get("env") or {}
            slot, standby = int(env[ENV_SLOT]), env.get(ENV_STANDBY) == "1"
            self.expected[slot] = {"proc": procs[cmd["name"]], "standby": standby,
                                   "rank": None if standby else int(env["RANK"]), "node": node,
                                   "machine": standby and "-n" in cmd["name"]}
            self.next_slot = max(self.next_slot, slot + 1)
            if standby and cmd["name"].startswith("sb"):
                self.sb_count = max(self.sb_count, int(cmd["name"][2:].split("-")[0]))
            self.events.write("adopted", name=cmd["name"], slot=slot, node=node)

    # ------------------------------------------------------------------ admission
    def _admit(self, only: Optional[set] = None) -> None:
        """Admit every process the agent started whose sealed hello arrived; refuse applicants.

        Slots are independent: one that never says hello blocks nobody. A hello that does
        not verify is refused (logged) and the slot keeps waiting for a good one, which the
        real process re-sends every second. ``only``: look at these slots alone."""
        for slot, exp in list(self.expected.items()):
            if only is not None and slot not in only:
                continue
            hello = self.ch.read(keys.join(slot, "hello"), protocol.HELLO)
            if hello is None:
                continue
            if hello["standby"] != exp["standby"] or (not exp["standby"] and hello["rank"] != exp["rank"]):
                self.ch.refuse(keys.join(slot, "hello"), f"claims standby={hello['standby']} rank={hello['rank']}, "
                                                         f"but was started as standby={exp['standby']} rank={exp['rank']}")
                continue
            del self.expected[slot]
            self.ch.put(keys.join(slot, "verdict"), {"ok": True, "slot": slot})
            self._disown_at.append((time.monotonic() + self.VERDICT_OWNED_S, keys.join(slot, "verdict")))
            pid = exp["proc"].pid if exp["proc"].pid is not None else hello["pid"]  # a remote agent's child
            m = Member(slot, exp["proc"], ProcessInfo(hello["host"], pid), exp["standby"], node=exp.get("node", 0),
                       machine=exp.get("machine", False))
            self.members[slot] = m
            if m.standby:
                self.pool.append(slot)
                if self.roster is not None:
                    self.roster = Roster(self.roster.generation, self.roster.roles, self.roster.standbys + (m.info,))
                    self._write_roster()
            else:
                self.role_slots[exp["rank"]] = slot
                if len(self.role_slots) == self.spec.world_size and self.roster is None:
                    self.roster = Roster(
                        self.generation,
                        tuple(self.members[self.role_slots[r]].info for r in range(self.spec.world_size)),
                        tuple(self.members[s].info for s in self.pool),
                    )
                    self._write_roster()
                    self.events.write("roster", generation=self.generation, roles=self.spec.world_size,
                                      standbys=len(self.pool))
        self._applicants()

    def _applicants(self) -> None:
        """Processes the agent did not start apply under ``ctl/apply/<n>``; each is refused with a reason.

        The counter is public (a process without the token must be able to hear why it is
        refused), so it is read, never incremented, here: junk in it is refused and reset."""
        now = time.monotonic()
        if self.store.check([keys.APPLY_COUNT]):
            raw = self.store.get(keys.APPLY_COUNT)
            try:
                n = int(raw)
                if not 0 <= n < 2 ** 31:
                    raise ValueError(n)
            except ValueError:
                self.ch.refuse(keys.APPLY_COUNT, f"not a counter: {raw[:40]!r}", raw)
                self.store.set(keys.APPLY_COUNT, str(self.apply_next - 1))
                n = self.apply_next - 1
            for i in range(self.apply_next, min(n, self.apply_next + 64) + 1):  # at most 64 new a round
                self.applicants[i] = now
                self.apply_next = i + 1
        for i, seen in list(self.applicants.items()):
            hk, vk = keys.apply(i, "hello"), keys.apply(i, "verdict")
            if not self.store.check([hk]):
                if now - seen > 30:
                    del self.applicants[i]
                    self.ch.refuse(hk, "no hello within 30s of taking the slot")
                continue
            del self.applicants[i]
            raw = self.store.get(hk)
            try:
                hello = protocol.open_(self.token, hk, raw, protocol.HELLO)
            except Refused as exc:
                self.ch.refuse(hk, exc.reason, raw)
                self.store.set(vk, f"refused: {exc.reason}"[:500])  # plain text: it cannot check a MAC anyway
                continue
            reason = "pitstop admits only the processes its agents start (use --standby N)"
            self.events.write("refused", key=hk, reason=reason, pid=hello["pid"], host=hello["host"])
            self.ch.put(vk, {"ok": False, "reason": reason})

    def _write_roster(self) -> None:
        text = self.roster.to_json()
        # chunked: 8,192 roles are ~560 KB, past the 256 KiB message limit. Not owned: run_dir's
        # roster.json is what `pitstop status` reads; the store's copy is for other readers, who
        # check its digest (read_big)
        self.ch.put_big(keys.ROSTER, json.loads(text), own=False)
        tmp = self.run_dir / (ROSTER + ".tmp")
        tmp.write_text(text)
        tmp.replace(self.run_dir / ROSTER)

    def _slot_of_proc(self, p: Proc) -> Optional[int]:
        for s, m in self.members.items():
            if m.proc is p:
                return s
        return None

    def _role_of_slot(self, slot: int) -> Optional[int]:
        for r, s in self.role_slots.items():
            if s == slot:
                return r
        return None

    # ------------------------------------------------------------------ exits and hangs
    def _on_exit(self, p: Proc) -> None:
        for s, exp in list(self.expected.items()):  # died before its hello was admitted
            if exp["proc"] is p and exp["standby"]:
                del self.expected[s]
                self.events.write("standby-lost", slot=s, pid=p.pid, exit=p.exit, log=self.agent.log_paths(p)["stderr"])
                if self.exit_code is None and not exp.get("machine"):
                    self._start_standby()
                return
            if exp["proc"] is p:
                del self.expected[s]
        slot = self._slot_of_proc(p)
        role = self._role_of_slot(slot) if slot is not None else None
        if slot is not None and slot in self.pool:
            self.pool.remove(slot)
            self._drop_standby(slot)
            self.events.write("standby-lost", slot=slot, pid=p.pid, exit=p.exit, log=self.agent.log_paths(p)["stderr"])
            if self.exit_code is None and not self.members[slot].machine:
                self._start_standby()
            return
        if p.name in self.leavers:
            self.events.write("leaver-exit", pid=p.pid, exit=p.exit)
            return
        if p.name in self.stopping:  # stopped on purpose (a standby machine turned training machine)
            return
        d = self.drains.current
        if role is None and d is not None and slot in d["slots"].values():
            # a drain's joiner died before its switch: the stayers' background build waits on it
            self._overlap(f"a joiner of the drain of role(s) {d['roles']} ({p.name}, pid {p.pid}) "
                          f"exited ({p.exit}) before its switch")
            return
        if role is None:
            if p.exit != "0" and slot is None and p.name.startswith("w"):
                # died before it even joined: nothing to take over from
                self.events.write("failed", reason=f"{p.name} exited ({p.exit}) before joining", log=self.agent.log_paths(p)["stderr"])
                print(self.agent.log_tail(p), flush=True)
                self.exit_code = 1
            return
        if p.exit == "0":
            self.finished.add(role)
            if len(self.finished) == self.spec.world_size:
                self._progress()
                for ch in list(self.pending):  # a switch at the very last boundary has no step after it
                    self.pending.remove(ch)
                    self._complete(ch, None)
                self.events.write("done", generation=self.roster.generation if self.roster else None)
                self.exit_code = 0
            return
        self._lost(role, p, f"process {p.pid} {p.exit}")

    def _drop_standby(self, slot: int) -> None:
        if self.roster is not None:
            info = self.members[slot].info
            self.roster = Roster(self.roster.generation, self.roster.roles, tuple(s for s in self.roster.standbys if s != info))
            self._write_roster()

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        blind = self._lookout.look(now)  # silence the controller did not see is not counted
        for m in list(self.members.values()):
            if m.proc is None or not m.proc.running:
                continue
            m.last_beat = min(now, m.last_beat + blind) if blind > 0 and m.last_beat <= now else m.last_beat
            hb = self.ch.read(keys.heartbeat(m.slot), protocol.HEARTBEAT)
            beats = m.beats if hb is None else hb["n"]
            if beats < m.beats:
                self.ch.refuse(keys.heartbeat(m.slot), f"replayed: beat {beats} after beat {m.beats}")
            elif beats > m.beats:
                if m.beats < 0:  # its first beat: it read its verdict (it beats only once admitted)
                    self.ch.disown(keys.join(m.slot, "verdict"))
                m.beats, m.last_beat = beats, now
            elif now - m.last_beat > self.cfg.heartbeat_timeout_s:
                self.events.write("hung", slot=m.slot, pid=m.proc.pid, silent_s=round(now - m.last_beat, 2),
                                  role=self._role_of_slot(m.slot))
                self.agent.kill(m.proc, signal.SIGKILL)  # its exit is handled as a failure
                m.last_beat = now + 3600

    def _hung(self, p: Any, silent: float) -> None:
        """A machine's agent reports one of its processes silent for the heartbeat timeout: as
        :meth:`_check_heartbeats` does for this machine's, it is killed, and its exit handled as
        a failure."""
        slot = self._slot_of_proc(p)
        if slot is None or not p.running:
            return
        self.events.write("hung", slot=slot, pid=p.pid, silent_s=round(silent, 2), role=self._role_of_slot(slot),
                          seen_by="agent")
        self.agent.kill(p, signal.SIGKILL)

    # ------------------------------------------------------------------ unplanned
    #: Processes lost within this many seconds of the first are one failure (a machine's
    #: ranks die within milliseconds of each other): one fault, one delta, one generation.
    #: Across machines each exit is seen by its machine's agent (its own poll, then a report
    #: through the store, then this loop's read): 0.15 s. On one machine this controller
    #: polls its own children every 10 ms loop, so processes killed together are seen one or
    #: two loops apart: 0.05 s (``settle_skew_s`` in the ``failure`` event says how far apart
    #: they were). The window is spent by the whole job, so it is kept no longer than that,
    #: and on one machine it ends as soon as no other child is dying (:meth:`_gathered`;
    #: ``settled_s`` in the event says how long it lasted).
    SETTLE_S = 0.15
    SETTLE_LOCAL_S = 0.05
    #: The shortest window on one machine: a process that has just taken its SIGKILL off the
    #: pending set is in ``do_exit`` (``PF_EXITING``) within microseconds, unless it is
    #: preempted in between; one loop's pause covers that on a loaded machine.
    SETTLE_MIN_S = 0.01

    @property
    def settle_s(self) -> float:
        return self.SETTLE_S if self.spec.agents_apart else self.SETTLE_LOCAL_S

    def _lost(self, role: int, p: Proc, reason: str) -> None:
        """A role's process is gone. Gather what else goes down with it, then act once."""
        if self._in_change():
            self._overlap(f"role {role} lost ({reason}) while the change to generation "
                          f"{self.pending[0]['generation'] if self.pending else '?'} was under way")
            return
        if not self.lost:
            self.lost_at = time.monotonic()
            self.lost_detected = time.time()
        self.lost[role] = (p, reason, time.time())

    def _in_change(self) -> bool:
        """A replacement or drain whose new generation has not committed a step yet."""
        # a drain builds generation g+1 too: a replacement now would build the same generation's
        # groups under the same store prefix, so a failure during a drain is an overlap as well
        return any(ch["kind"] in ("unplanned", "planned") for ch in self.pending) or self.drains.current is not None

    #: How long a failure waits for standbys that were started but have not said hello yet.
    STARTING_STANDBY_WAIT_S = 60.0

    def _idle(self, seconds: float) -> None:
        """The loop's pause: on this machine it ends early when a child exits (pidfds)."""
        wait = getattr(self.agent, "wait_exit", None)
        if wait is None:
            time.sleep(seconds)
        else:
            wait(seconds)

    def _gathered(self) -> bool:
        """Whether the lost processes are all that this failure takes, before ``settle_s``.

        Only on one machine, where this controller sees its children itself: a SIGKILL of
        several (a process group, the OOM killer's sweep) marks each of them dying in the
        kernel at once (:func:`pitstop.launch.agent.exiting`), so once no other child is
        dying nothing more of this event can come, and waiting out the window would only
        add it to the downtime. A child still dying holds the window open (up to
        ``settle_s``). Across machines an exit is known only through its agent's report,
        so the full window stands."""
        dying = getattr(self.agent, "dying", None)
        if self.spec.agents_apart or dying is None or time.monotonic() - self.lost_at < self.SETTLE_MIN_S:
            return False
        return not dying()

    def _settle(self) -> None:
        if self.lost and (time.monotonic() - self.lost_at >= self.settle_s or self._gathered()):
            if self._standbys_starting(len(self.lost)):
                return
            lost, self.lost = self.lost, {}
            self.lost_waiting = False
            self.settled_after = time.monotonic() - self.lost_at
            self._failure(lost, self.lost_detected)

    def _standbys_starting(self, n: int) -> bool:
        """Fewer than ``n`` standbys admitted, but enough of them started and still running: the
        failure waits (bounded) for their hello instead of falling back (:func:`starting_wait`)."""
        starting = sum(1 for e in self.expected.values() if e["standby"] and getattr(e["proc"], "running", True))
        waited = time.monotonic() - self.lost_at
        verdict = starting_wait(len(self.pool), starting, n, waited, self.STARTING_STANDBY_WAIT_S)
        if verdict == "waited":
            self.events.write("failure-waited", roles=sorted(self.lost), waited_s=round(waited, 2),
                              reason=f"{starting} standby(s) started but not admitted within "
                                     f"{self.STARTING_STANDBY_WAIT_S:.0f} s")
        elif verdict == "wait" and not self.lost_waiting:
            self.lost_waiting = True
            self.events.write("failure-waiting", roles=sorted(self.lost), standbys=len(self.pool),
                              starting=starting, reason="waiting for standbys that are still starting")
        return verdict == "wait"

    def _failure(self, lost: Dict[int, tuple], t_detect: float) -> None:
        roles = sorted(lost)
        reason = "; ".join(f"role {r}: {lost[r][1]}" for r in roles)
        # lost before every role said hello (a process that died or went silent at start-up):
        # no roster yet, so no step either, and the restart below starts the job over
        g = self.roster.generation if self.roster is not None else self.generation
        stamp = self.ch.read(keys.FAULT_FIRED, protocol.STAMP)
        fired = None if stamp is None else float(stamp["time"])
        self.store.delete_key(keys.FAULT_FIRED)
        self._read_committed()
        if self.committed is None or self.roster is None:
            # lost before the first step committed: the others may be stuck in a world
            # operation of their set-up, and there is no state to keep. Start over. (No
            # roster means no step either: a commit read then is a stale one.)
            self.events.write("failure", role=roles[0], roles=roles, reason=reason, step=0, generation=g)
            self.restarts.restart_all(None, roles[0], reason, t_detect, fired)
            return
        step = self._resolve_step(g, {"roles": roles, "generation": g + 1})
        why = self._unrecoverable(roles)
        if why or len(self.pool) < len(roles):
            self.restarts.fallback(roles, reason, step, t_detect, fired,
                           why="; ".join(why) if why else f"{len(roles)} role(s) lost, {len(self.pool)} standby(s) left")
            return
        slots = self._pick_standbys(roles)
        joiners = {r: self.members[s].info for r, s in slots.items()}
        self.ch.put(keys.fault(g), {"roles": roles, "generation": g + 1, "step": step,
                                    "joiners": [joiners[r].describe() for r in roles]})
        self._ended(g)
        for r, slot in slots.items():
            self.ch.put(keys.assign(slot), {"role": r, "roles": roles, "generation": g + 1, "mode": "recover", "step": step})
        t_plan = time.time()
        old = {r: self.roster.roles[r].describe() for r in roles}
        self.roster = self.roster.replace_many(joiners)
        self.role_slots.update(slots)
        self._write_roster()
        seen = [lost[r][2] for r in roles]
        self.events.write("failure", role=roles[0], roles=roles, reason=reason, step=step, generation=g,
                          detect_s=None if fired is None else round(t_detect - fired, 4),
                          detected_at=round(t_detect, 4),
                          settle_s=self.settle_s, settle_skew_s=round(max(seen) - min(seen), 4),
                          settled_s=round(self.settled_after, 4),
                          log=[self.agent.log_paths(lost[r][0])["stderr"] for r in roles] if len(roles) > 1
                          else self.agent.log_paths(lost[roles[0]][0])["stderr"])
        # keep the pool full, so the next failure finds a warm standby too, but start the new ones
        # only once this change is over (_refill): a standby's start-up (imports, the sandbox)
        # takes a core for seconds, and on this machine that core is the replacement's
        self.refill += sum(1 for s in slots.values() if not self.members[s].machine)
        self.pending.append({"kind": "unplanned", "role": roles[0], "roles": roles, "generation": g + 1, "step": step,
                             "old": old[roles[0]] if len(roles) == 1 else old,
                             "new": joiners[roles[0]].describe() if len(roles) == 1 else {r: j.describe() for r, j in joiners.items()},
                             "fired": fired, "detected": t_detect, "planned": t_plan, "reason": reason,
                             "warm": all(self._warm(s) for s in slots.values())})

    def _ended(self, g: int) -> None:
        """Generation ``g`` ends (its fault or drain was just written): the one key every worker's
        watch thread blocks on (:class:`pitstop.runtime.worker.KeyWatch`), for either."""
        self.ch.put(keys.ended(g), {"time": time.time()})

    def _unrecoverable(self, roles: List[int]) -> List[str]:
        """Why peers cannot give these roles their state (empty: they can), from the layout rank 0
        published: no buddy copies are kept at all (``--no-buddy``), a role has no data-parallel
        peer (dp = 1), or its copy's holder was lost with it. A drain needs none of this: its
        state comes from the leaver."""
        if not self.cfg.buddy:
            return [f"role(s) {','.join(map(str, roles))}: no peer keeps a copy of their state (--no-buddy)"]
        lay = self.ch.read(keys.LAYOUT, protocol.LAYOUT)
        if lay is None:
            return []
        from pitstop.layout import ParallelLayout
        from pitstop.plan import unrecoverable

        try:
            layout = ParallelLayout(lay["world_size"], tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], ep=lay["ep"],
                                    etp=lay["etp"], order=lay["order"])
            return unrecoverable(layout, lay["shard_kind"], roles)
        except (PitstopError, ValueError) as exc:
            self.ch.refuse(keys.LAYOUT, f"not a layout pitstop can plan with: {exc}")
            return []

    def _overlap(self, reason: str) -> None:
        """A failure during a change (a joiner, a stayer in the delta rebuild, a drain's joiner):
        the half-built generation cannot be trusted, so every worker restarts from the last
        checkpoint, or from scratch without one. Bitwise either way, and never a hang."""
        resume, _ = self.restarts.latest_checkpoint()
        self.events.write("fallback", mode="checkpoint-restart" if resume is not None else "restart-from-scratch",
                          resume_step=resume, reason=f"overlapping failure: {reason}")
        if self.roster is not None:
            self.ch.put(keys.fault(self.roster.generation), {"fallback": True, "resume_step": resume or 0})
            self._ended(self.roster.generation)
        for ch in list(self.pending):
            self.pending.remove(ch)
            self.events.write("abandoned", change=ch["kind"], role=ch.get("role"), generation=ch["generation"], reason=reason)
        self.drains.current = None
        self.lost = {}
        self.restarts.restart_all(resume, -1, reason, time.time(), None)

    def _resolve_step(self, g: int, fault: Dict[str, Any]) -> int:
        """The first step that the failure discards. Every step of the window after the last
        commit is settled poisoned, atomically (the workers vote at one of them, which one
        depends on ``commit_interval``); a step that the workers committed first moves the
        window past it."""
        first = self._last_committed() + 1
        window = self.cfg.discard_window(first - 1)
        marker = Verdict.fault(fault)
        step = window.start
        while step < window.stop:
            got = self.ch.vote(keys.verdict(g, step), marker)
            if Verdict.commits(got):
                first, window = step + 1, self.cfg.discard_window(step)
            step += 1
        return first

    def _read_committed(self) -> None:
        """Follow the last committed step. A value that does not verify, or goes backwards, is
        refused and the last good one kept (the workers write it again at the next commit)."""
        c = self.ch.read(keys.COMMITTED, protocol.COMMITTED)
        if c is None:
            return
        now = (c["generation"], c["step"], float(c["time"]))
        if self.committed is not None and now[:2] < self.committed[:2]:
            self.ch.refuse(keys.COMMITTED, f"replayed: g{now[0]} step {now[1]} after g{self.committed[0]} step {self.committed[1]}")
            return
        self.committed = now

    def _last_committed(self) -> int:
        return 0 if self.committed is None else self.committed[1]

    # ------------------------------------------------------------------ planned
    def _refill(self) -> None:
        """Start the standbys that replace those a change took, once no change is under way:
        a failure or drain's new generation has committed a step (:meth:`_in_change`)."""
        if self.refill and self.exit_code is None and not self._in_change():
            n, self.refill = self.refill, 0
            for _ in range(n):
                self._start_standby()

    # ------------------------------------------------------------------ warmup
    def _warm(self, slot: int) -> bool:
        """Did this standby finish its sandboxed warmup of every stage kind?"""
        rep = self.ch.read(keys.warm(slot), protocol.WARM)
        return rep is not None and rep["ok"]

    def _pick_standby(self, node: Optional[int] = None) -> int:
        """Take a standby: on ``node`` (its lowest local rank first) when given, else a warmed
        per-process standby, else the longest-waiting one. Standby machines are kept whole
        for machines, unless nothing else is left."""
        if node is not None:
            slot = min(s for s in self.pool if self.members[s].node == node)
        else:
            single = [s for s in self.pool if not self.members[s].machine] or list(self.pool)
            slot = next((s for s in single if self._warm(s)), single[0])
        self.pool.remove(slot)
        self.standbys_taken += 1
        return slot

    def _standby_machine(self, n: int) -> Optional[int]:
        """A standby machine with at least ``n`` standbys in the pool (the lowest node rank), or None."""
        counts: Dict[int, int] = {}
        for s in self.pool:
            if self.members[s].machine:
                counts[self.members[s].node] = counts.get(self.members[s].node, 0) + 1
        fit = sorted(k for k, c in counts.items() if c >= n)
        return fit[0] if fit else None

    def _pick_standbys(self, roles: List[int]) -> Dict[int, int]:
        """Standbys for ``roles`` (sorted). Several roles lost together (a machine) go to one
        standby machine when one can take them all, in local-rank order, so a tensor-parallel
        group that lived inside one machine stays inside one machine."""
        node = self._standby_machine(len(roles)) if len(roles) > 1 else None
        return {r: self._pick_standby(node) for r in sorted(roles)}

    def _watch_warmup(self) -> None:
        """Log the records that workers publish and the warmups that standbys report."""
        now = time.monotonic()
        if now - self._warm_check < self.WARM_LOOK_S:
            return
        self._warm_check = now
        for cls in ("only", "first", "middle", "last"):
            if cls not in self.recorded:
                rec = self.ch.read(keys.record(cls), protocol.RECORD)
                if rec is not None:
                    self.recorded.add(cls)
                    self.events.write("recorded", **rec)
        # standbys only: a worker started with its role never reports a warmup (reading every
        # member's key here cost two store operations per member four times a second, forever)
        for slot in [sl for sl, m in self.members.items() if m.standby and sl not in self.warm_seen]:
            rep = self.ch.read(keys.warm(slot), protocol.WARM)
            if rep is None:
                continue
            self.warm_seen.add(slot)
            self.events.write("warmed", slot=slot, pid=rep["pid"], ok=rep["ok"], stopped=rep["stopped"],
                              rss_bytes=rep["rss_bytes"],
                              classes=[{k: r.get(k) for k in ("cls", "role", "ok", "seconds", "ops", "error", "out",
                                                             "local_checked", "local_equal", "local_mismatch")}
                                       for r in rep["results"] if isinstance(r, dict)])
        # every standby of the first pool, less those a failure or drain took meanwhile (a standby
        # machine's are not refilled), has reported its warmup
        want = self.spec.standby + self.spec.nodes.standby_machines * self.spec.nproc_per_node
        # standbys a drain took are ready when the drain is (its joiners build their roles in phase 1)
        if (not self.warm_all and len(self.pool) + self.standbys_taken >= want
                and all(s in self.warm_seen for s in self.pool)
                and (self.drains.current is None or "ready" in self.drains.current)):
            self.warm_all = True
            self.ch.put(keys.WARM_ALL, {"set": True})

    # ------------------------------------------------------------------ completing events
    def _progress(self) -> None:
        if not self.pending or self.committed is None:
            return
        gen, step, t = self.committed
        for ch in list(self.pending):
            if int(gen) >= ch["generation"] and int(step) >= ch["step"]:
                self.pending.remove(ch)
                self._complete(ch, float(t))

    def _complete(self, ch: Dict[str, Any], t_commit: Optional[float]) -> None:
        """Write the change's event (:func:`pitstop.launch.changes.change_event` does its
        arithmetic); ``t_commit`` is None when the job ended before a step after it."""
        g = ch["generation"]
        timings = {}
        for who in [f"r{r}" for r in range(self.spec.world_size)] + ["joiner", "leaver"]:
            t = self.ch.read(keys.timing(g, who), protocol.TIMING)
            if t is not None:
                timings[who] = t
        iters = {}
        for r in range(self.spec.world_size):
            t = self.ch.read(keys.timing(g, f"it{r}"), protocol.TIMING)
            if t is not None:
                iters[r] = t
        name, ev = change_event(ch, timings, iters, t_commit,
                                None if self.committed is None else int(self.committed[1]))
        self.events.write(name, **ev)


def start_head_agent(spec: LaunchSpec, token: str, store_spec: str, host: str) -> subprocess.Popen:
    """The head machine's agent, a process of its own like every other machine's (node rank 0)."""
    env = dict(os.environ, **{ENV_TOKEN: token})
    cmd = [sys.executable, "-m", "pitstop.launch.node_agent", "--node", "0", "--addr", spec.local_addr or host,
           "--nproc", str(spec.nproc_per_node), "--run-dir", str(spec.run_dir), "--store", store_spec,
           "--heartbeat-interval", str(spec.config.heartbeat_interval_s),
           "--heartbeat-timeout", str(spec.config.heartbeat_timeout_s), "--", *spec.argv]
    log_path = Path(spec.run_dir) / "logs" / "agent-0.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def request_drain(run_dir: Path, rank: Optional[int] = None, host: Optional[str] = None) -> int:
    """Ask the controller of ``run_dir`` to drain a rank or every rank on a host; returns the request number.

    The request is sealed with the job token from ``controller.json`` (mode 0600): only
    the job's owner can drain it."""
    info_path = Path(run_dir) / CONTROLLER
    if not info_path.is_file():
        raise PitstopError(f"no controller found: {info_path} does not exist (is the job running with --run-dir {run_dir}?)")
    try:
        info = json.loads(info_path.read_text())
        where, token = str(info.get("store") or f"{info['host']}:{int(info['port'])}"), str(info["token"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PitstopError(f"{info_path}: expected the controller's JSON with its store and token ({exc})") from None
    from datetime import timedelta

    try:
        store = connect(where, timeout=timedelta(seconds=10))
        store.check(["ctl/done"])
    except Exception as exc:  # noqa: BLE001 - DistNetworkError and friends
        raise PitstopError(
            f"the control store of {run_dir} at {where} does not answer "
            f"(has the job ended?): {str(exc).splitlines()[0]}"
        ) from None
    ch = Channel(store, token)
    n = ch.add(keys.DRAIN_REQUEST + "/n", 1)
    ch.put(keys.drain_payload(n), {"rank": rank, "host": host})
    ch.add(keys.DRAIN_REQUEST, 1)
    return n
