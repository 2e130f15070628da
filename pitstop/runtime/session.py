"""The worker side of pitstop: one call per iteration boundary keeps a training loop alive.

::

    session = Session(model, optimizer, make_data)
    for step in session.steps(last=args.steps):
        out = train_step(args, model, optimizer, session.data)
        for s, o in session.commit(step, out):   # the iteration boundary
            log(s, o)                            # only committed steps are reported

``commit`` votes through the control store. When every rank arrived, the step is
committed: its state becomes the rollback point and the buddy copy. When a rank
died during the step, the stayers roll back, rebuild only the delta groups with the
joiner, hand it its state (buddy copy + a parameter all-gather), and ``steps``
yields the same step again.

With ``commit_interval`` K > 1 only every K-th boundary votes (see
:meth:`~pitstop.runtime.config.RuntimeConfig.votes_at`); the ones between cost nothing and
return no step: their outputs are held and handed back, in order, by the vote that commits
them. A failure discards the window since the last vote, and ``steps`` yields its first
step again. A value computed in a discarded window is never reported: a peer's broken
group can feed a healthy rank garbage, so no rank can vouch for a step on its own::

    K = 4:   step 5    6    7    8 (vote)
    commit:  []        []   []   [(5, o5), (6, o6), (7, o7), (8, o8)]     committed
    commit:  []   x    []   []   []     -> steps() yields 5 again        discarded

The session composes pieces, each handed what it uses (see :mod:`pitstop.runtime.host`)::

    Session: the loop, the boundary, the step window, the start, the swap to a generation
      ring      BuddyRing   rollback point and the data-parallel peer's copy
      vote      Vote        the verdict of every rank on a step
      recovery  Recovery    a dead peer: fail fast, roll back, rebuild the delta, state
      drain     Drain       a planned leave: phase 1 in the background, the switch
      watcher   Watcher     the heartbeat's look and the end-of-generation watch

A timeline of one discarded step (K = 1)::

    step s:   fwd  bwd  reduce  opt  |boundary|           the kill lands here
    stayers:  ----------xxxxxxx------|poisoned| rollback, delta rebuild, state -> joiner
    joiner:                          |  built groups + model | recv shard | redo s
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from pitstop import pg as pgmod
from pitstop import protocol
from pitstop.logtag import tag
from pitstop.protocol import Verdict
from pitstop import memory
from pitstop.errors import PitstopError, RecoveryError
from pitstop.runtime import keys, reports, sandbox, state, worker
from pitstop.runtime.buddy import BuddyRing
from pitstop.runtime.drain import Drain
from pitstop.runtime.framework import Framework, first_trainable, wrap
from pitstop.runtime.faults import Fault
from pitstop.runtime.pipeline import Flight, Pipeline
from pitstop.runtime.recovery import Recovery
from pitstop.runtime.swap import find_groups, swap_groups
from pitstop.runtime.vote import Vote
from pitstop.runtime.watch import Watcher
from pitstop.runtime.worker import Membership, require_current

log = logging.getLogger(__name__)


class Session:
    """pitstop's hook into one training process (see the module docstring).

    It is handed its dependencies: the framework adapter (``framework``), the group registry
    (``registry``, by default the one the adapter installed), the fault fence (``fence``, by
    default the registry's) and the process's membership (``membership``, by default the one
    :func:`pitstop.runtime.worker.join` made). It composes its pieces from them."""

    def __init__(self, model: Sequence[Any], optimizer, make_data: Callable[[int], Iterator], *,
                 checkpoint_dir: Optional[str] = None, framework: Optional[Framework] = None,
                 registry: Any = None, fence: Optional[pgmod.Fence] = None, membership: Optional[Membership] = None,
                 attach_world_at_first_step: bool = False, switch_at_next_step: bool = False,
                 async_commit: Optional[bool] = None) -> None:
        self.m: Membership = membership if membership is not None else require_current()
        if framework is None:
            raise PitstopError("Session(framework=None): the session is handed its library's adapter; make it "
                               "through pitstop.integrations.megatron.session or pitstop.integrations.deepspeed")
        self.fw: Framework = framework
        self.model = list(model)
        self.optimizer = optimizer
        self.make_data = make_data
        self.registry = registry if registry is not None else self.fw.registry()
        if self.registry is None:
            raise PitstopError(f"pitstop's groups are not installed: build them through pitstop.integrations.{self.fw.name}")
        self.layout = self.registry.layout
        self.rank = self.m.role
        self.gen = self.registry.generation
        self.fence: pgmod.Fence = fence if fence is not None else (getattr(self.registry, "fence", None) or pgmod.FENCE)
        self.cfg = self.m.config
        self.checkpoint_dir = checkpoint_dir or self.cfg.save_dir or None
        self.data: Optional[Iterator] = None
        self.step = 0
        self.first_step = 1
        self._committed: Optional[bool] = None
        self.groups_lock = threading.Lock()
        """Held while the groups change (a rollback, a switch): the heartbeat's fail-fast stays out."""
        self.ring = BuddyRing(self.rank, self.cfg, self.fw, self.model, optimizer, self.registry, self.fence)
        self.recovery = Recovery(self)
        self.drain = Drain(self, switch_at_next_step)
        self.vote = self._new_vote(self.m.channel, self.m.store) if self.controlled else None
        self.hook_s = 0.0
        """Seconds spent in :meth:`commit` on committed steps (the steady-state overhead)."""
        self.boundary_s: Deque[Tuple[int, float]] = collections.deque(maxlen=4096)
        """(step, seconds in :meth:`commit`) of the last 4,096 boundaries, in order: the steady-state
        cost, apart from one-offs (step 1's record, a recovery). Bounded: a job runs for weeks."""
        self.steps_committed = 0
        self.stale_refs: List[Any] = []
        """References to retired groups found after the last swap (should be none)."""
        self.iter_s: List[float] = []
        """This rank's committed iterations, in seconds (loop body, without the boundary)."""
        self._t_step = 0.0
        self._step_wait_seen = 0.0
        self._votes_landed: List[int] = []
        self._last = 0
        self._provisional = 0
        """Steps since the last vote (``commit_interval`` > 1): run, not yet committed."""
        self._held: List[Tuple[int, Any]] = []
        """Their (step, report) pairs, handed back by the vote that commits them."""
        self._redeliver: List[Tuple[int, Any]] = []
        """A joiner's: the steps its role's previous process made final at its last vote, handed
        back again at this process's first commit (that process may have died before it
        logged them: at least once across a failure, exactly once across a drain)."""
        self._reports_ok = True
        self._poison_told = False
        self._redo_at: Optional[int] = None
        self._new_gen = self.m.joiner
        """The next committed step is this process's first in a new generation: report its time."""
        self.attach_world_at_first_step = attach_world_at_first_step
        """The loop starts later than the session (Megatron-LM's ``train`` after its set-up world
        collectives): the script calls :meth:`loop_begins` at its first step, and until then a
        joiner answers world operations from rank 0's record and rank 0 goes on recording."""
        self._world_attach: Optional[Tuple[int, int]] = None
        """A joiner's (operation count, epoch) to join the world's stream at, once the loop begins."""
        faults = Fault.from_env() if (self.m.mode == "worker" and self.m.epoch == 0) else []
        self.faults = [f for f in faults if f.rank == self.rank]
        self._fire: Optional[Callable[[str], None]] = None
        if self.faults:
            self._arm_faults()
        self.pipe: Optional[Pipeline] = self._pipeline(self.cfg.async_commit if async_commit is None else async_commit)
        """The asynchronous commit (``async_commit``), or None: each boundary waits for its vote."""
        self.watcher = Watcher(self, self.recovery, self.drain).start()

    def _pipeline(self, wanted: bool) -> Optional[Pipeline]:
        if not (wanted and self.controlled) or sandbox.active() is not None:  # (a warmup's step is thrown away)
            return None
        exchange = self.cfg.buddy and len(self.ring.group()[0]) > 1
        if exchange and self.ring.private_ring() is None:
            self.info("the boundary votes synchronously: the shard group %s has no communicator of the buddy "
                      "ring's own (a composite group)", self.fw.shard_kind)
            return None
        # through the machine's agent the vote's thread only touches the store to settle a poisoned
        # step: it shares the process's connection (a TCPStore client serialises its operations)
        conn = self.m.store if self.m.local is not None and not _is_etcd_store() else self.m.take_connection()
        if conn is None:  # never fall back alone: every rank must vote the same way at every step
            import os

            from pitstop.store import ENV_STORE, connect

            try:
                conn = connect(os.environ[ENV_STORE])
            except Exception as exc:  # noqa: BLE001 - any failure to connect
                raise PitstopError(f"{self.prefix()} async_commit: no spare store connection for the vote's thread, "
                                   f"and opening one failed: {exc}") from exc
        vote = self._new_vote(self.ch.sibling(conn), conn)
        pipe = Pipeline(self.ring, vote, self.rank, exchange)
        pipe.hold_step(self.fw.state_writers(self.model, self.optimizer))
        return pipe

    def _new_vote(self, ch, store) -> Vote:
        """The vote over ``ch``: through this machine's agent when it offers a line (its arrival
        counted with its machine's, :mod:`pitstop.runtime.local`), else straight to the store."""
        if self.m.local is not None:
            from pitstop.runtime.local import LocalVote

            return LocalVote(ch, store, self.layout.world_size, self.fence, self.cfg.collective_timeout_s * 2,
                             self.m.local)
        return Vote(ch, store, self.layout.world_size, self.fence, self.cfg.collective_timeout_s * 2)

    # ------------------------------------------------------------------ what the pieces read
    @property
    def buddy(self) -> Optional[state.Snapshot]:
        """The data-parallel peer's copy this rank holds (the ring's)."""
        return self.ring.buddy

    @property
    def buddy_s(self) -> float:
        """Seconds spent exchanging buddy copies."""
        return self.ring.seconds

    @property
    def background_cpu_s(self) -> float:
        """CPU seconds the asynchronous commit's thread spent (pack, exchange, vote): work off
        the boundary, but on this process's cores all the same."""
        return self.pipe.cpu_s if self.pipe is not None else 0.0

    @property
    def discarded(self) -> bool:
        """Whether the last :meth:`commit` discarded its step (the loop yields it, or an earlier
        one, again). Not the same as an empty return: a step between votes, or one whose vote
        is still in flight, returns nothing yet and goes on."""
        return self._committed is False

    # ------------------------------------------------------------------ helpers
    def prefix(self) -> str:
        return tag(self.gen, self.rank, self.step)

    def info(self, msg: str, *args) -> None:
        log.info("%s " + msg, self.prefix(), *args)

    @property
    def controlled(self) -> bool:
        return self.m.controlled

    @property
    def store(self) -> dist.Store:
        return self.m.store

    @property
    def ch(self) -> protocol.Channel:
        """The authenticated control channel (every message sealed and verified)."""
        return self.m.channel

    def _hold_for_warm(self) -> None:
        """Wait (bounded) until every standby has replayed the record this step produced."""
        t0 = time.perf_counter()
        warm = self.ch.wait(keys.WARM_ALL, protocol.FLAG, timeout_s=self.cfg.hold_for_warm_s, period_s=0.05)
        self.info("held %.2fs for the standbys' warmup (%s)", time.perf_counter() - t0,
                   "done" if warm is not None else "timed out; going on")

    def _report_iteration(self, iter_s: float) -> None:
        """This rank's time for the first step of a generation, and its steady time before it."""
        import statistics

        recent = self.iter_s[-8:]
        steady = statistics.median(recent) if recent else None
        self.ch.put(keys.timing(self.gen, f"it{self.rank}"), {
            "first_iter_s": round(iter_s, 4), "steady_iter_s": None if steady is None else round(steady, 4),
            "joiner": self.m.joiner and self.steps_committed == 0})

    def report(self, gen: int, who: str, **timings: float) -> None:
        self.ch.put(keys.timing(gen, who), {k: round(v, 4) for k, v in timings.items()})

    # ------------------------------------------------------------------ the loop
    def steps(self, last: int) -> Iterator[int]:
        """Yield step numbers from where this process starts up to ``last``; a step
        that a failure discarded is yielded again."""
        self._start()
        if not self.attach_world_at_first_step:
            self.loop_begins()
        self._last = last
        step = self.first_step
        while step <= last:
            if self.pipe is not None:  # the script has logged what the last boundary handed back
                self.pipe.release()
            self.drain.switch_if_due()
            self.step = step
            self._committed = None
            if self._provisional == 0:  # a new vote window; inside one, a poisoned fence stays poisoned
                self.fence.reset()
            self.fence.armed = self.controlled
            self._t_step = time.perf_counter()
            yield step
            if self._committed is None:
                raise PitstopError(f"{self.prefix()} the loop body must call session.commit({step})")
            if self._committed:
                step += 1
            elif self._redo_at is not None:  # the discarded window starts here (the step itself when K = 1)
                step, self._redo_at = self._redo_at, None
        self.drain.switch_if_due()  # a drain after the last step: the joiner finishes the role
        self.fence.armed = False

    def loop_begins(self) -> None:
        """The set-up is over: a joiner replays nothing later, and joins the world's operations
        where its state was taken. :meth:`steps` calls it, unless the session was made with
        ``attach_world_at_first_step`` (then the script does, at its first step)."""
        if self.controlled:
            pgmod.world_group().stop_recording()
        if self._world_attach is not None:
            seq, epoch = self._world_attach
            self._world_attach = None
            pgmod.world_group().attach(seq, epoch)
        self._t_step = time.perf_counter()

    def attach_world(self, seq: int) -> None:
        if self.attach_world_at_first_step:
            self._world_attach = (seq, self.gen)
        else:
            pgmod.world_group().attach(seq, self.gen)

    def commit(self, step: Optional[int] = None, report: Any = None) -> List[Tuple[int, Any]]:
        """The iteration boundary. Returns the steps it made final, each with the ``report``
        given at its own boundary (e.g. its loss), oldest first:

        - ``[(step, report)]`` when this step is committed (every step at ``commit_interval`` 1);
        - the held window plus this step at a vote (``commit_interval`` > 1);
        - ``[]`` between votes, and when the step was discarded (``steps`` then yields the
          first discarded step again, after recovery).

        With ``async_commit`` a boundary returns what the *previous* vote made final, and a step's
        own report comes back one boundary later (the last step votes at once, so nothing is
        left behind). Whether this step was discarded is :attr:`discarded`."""
        step = self.step if step is None else step
        if not self.controlled:
            iter_s = time.perf_counter() - self._t_step
            self.iter_s.append(iter_s)
            self.steps_committed += 1
            if self.m.on_boundary is not None:  # `pitstop emulate`: the emulator's hook
                self.m.on_boundary(iter_s, lambda: state.snapshot_nbytes(self.optimizer))
            memory.boundary()
            self._committed = True
            return [(step, report)]
        try:
            t0 = time.perf_counter()
            final = self._boundary(step, report)
            held = 0.0
            if self.pipe is not None:  # the optimizer's wait for the pack is the boundary's cost too
                held, self._step_wait_seen = self.pipe.step_wait_s - self._step_wait_seen, self.pipe.step_wait_s
                self.hook_s += held
            self.boundary_s.append((step, time.perf_counter() - t0 + held))
            return final
        except Exception as exc:
            # the store answers every boundary: if it is gone, the controller died. Stop
            # cleanly (no traceback, exit status 3) instead of failing in whatever touched it
            if not worker.store_reachable():
                worker.controller_lost(self.prefix(), exc)
            raise

    def _boundary(self, step: int, report: Any) -> List[Tuple[int, Any]]:
        t0 = time.perf_counter()
        iter_s = t0 - self._t_step
        if self._new_gen:  # the first step after a roster change: is the joiner up to speed?
            self._report_iteration(iter_s)
        if self.pipe is not None:
            return self._boundary_async(step, report, t0, iter_s)
        if not self.cfg.votes_at(step, self._last):
            return self._pass(step, report, t0, iter_s)
        recording = sandbox.recording()
        final = self._redeliver + self._held + [(step, report)]
        wire = self._wire_reports(final)
        with sandbox.paused():
            pending, received = self.ring.take_and_exchange(step, pgmod.world_group().seq, wire)
        poisoned = self.fence.poisoned
        self.fence.armed = False
        verdict = self.vote(self.gen, step, self.rank, poisoned)
        if recording:  # the record of iteration 1 is complete (kept only if the step was)
            sandbox.finish_recording(self.ch, Verdict.commits(verdict), self.layout)
        if Verdict.commits(verdict):
            self.ring.keep(pending, received)
            self.steps_committed += 1
            self.iter_s.append(iter_s)
            self._new_gen = False
            self._provisional = 0
            self._poison_told = False
            self.hook_s += time.perf_counter() - t0
            self.registry.reap()
            if self.cfg.save_interval and step % self.cfg.save_interval == 0:
                self._save(step, wire)
            if verdict == Verdict.SWITCH:
                self.drain.committed(step)
            if self.cfg.warmup and self.cfg.hold_for_warm_s and self.m.mode == "worker" and self.m.epoch == 0 \
                    and self.steps_committed == 1:
                self._hold_for_warm()
            memory.boundary()
            self._committed = True
            self._held, self._redeliver = [], []
            if self._fire is not None:
                self._fire("committed")
            return final
        self.info("step discarded (%s)", verdict[:120])
        self.recovery.recover(step)
        self._committed = False
        return []

    def _boundary_async(self, step: int, report: Any, t0: float, iter_s: float) -> List[Tuple[int, Any]]:
        """The boundary with the asynchronous commit (:mod:`pitstop.runtime.pipeline`): land the
        vote launched at the last boundary, then capture this step and launch its vote (or hold
        it, between votes). Returns what the landed vote made final."""
        pipe = self.pipe
        self._provisional += 1  # this step ran; it is final once a vote says so
        self.steps_committed += 1
        self.iter_s.append(iter_s)
        self._new_gen = False
        final: List[Tuple[int, Any]] = []
        switch_now = False
        pipe.release()  # (a script whose loop is not steps(): its deferred vote goes now)
        if pipe.flight is not None:
            if self.fence.poisoned and not self._poison_told:
                # a failure in this step: the vote in the air is not in yet if the lost rank never
                # voted, so say so now (a settled vote is not changed), and the controller suspects
                # a silent machine at once (its agent's "poison" line, pitstop.launch.hub) instead of
                # after the heartbeat timeout
                self._poison_told = True
                self.vote.tell_poisoned(self.gen, pipe.flight.step, self.rank)
            self.fence.armed = True  # a wait on a broken ring gives up once the fault is announced
            f = pipe.land()
            self.fence.armed = False
            if not Verdict.commits(f.verdict):
                return self._discard(step, f, [])
            final = self._landed(f)
            switch_now = f.verdict == Verdict.SWITCH_NEXT
        else:
            self.fence.armed = False
        if not (switch_now or self.cfg.votes_at(step, self._last)):
            if self.fence.poisoned and not self._poison_told:  # as _pass: tell the controller now
                self._poison_told = True
                self.vote.tell_poisoned(self.gen, step - self._provisional + 1, self.rank)
            self._held.append((step, report))
            return self._went_on(final, t0)
        redeliver = self._redeliver
        window = redeliver + self._held + [(step, report)]
        self._held, self._redeliver = [], []
        poisoned = self.fence.poisoned
        recording = sandbox.recording()  # (step 1's: the same boundary on every rank)
        # Whether this boundary waits for its own vote must be the same on every rank, so it
        # depends on the step alone. A poisoned rank goes on like the others, as between votes
        # (_pass): were it to recover at once, its healthy peers, a step ahead, would wait for it
        # in that step's collectives while it waits for them in the rollback's.
        now = recording or step == 1 or step >= self._last or \
            (self.cfg.save_interval > 0 and step % self.cfg.save_interval == 0)
        mode = "switch" if switch_now else "now" if now else "ahead"
        # A vote decided at this boundary carries everything the boundary hands back, the steps
        # landed above included: a leaver that switches here exits before its loop logs them (its
        # joiner hands them back), and a checkpoint taken here keeps them for a restart.
        carried = window if mode == "ahead" else final + window
        cap = self.ring.capture(step, pgmod.world_group().seq, self._wire_reports(carried))
        flight = Flight(step, self.gen, carried, self._provisional, cap, poisoned, mode, redeliver)
        if mode == "ahead":  # (never while recording: that is step 1's boundary, which votes now)
            pipe.defer(flight)  # launched when the loop asks for the next step (see Pipeline.deferred)
            return self._went_on(final, t0)
        self.fence.armed = True
        with sandbox.paused():  # the exchange is pitstop's own, not the script's: not in the record
            pipe.launch(flight)
            f = pipe.land()
        self.fence.armed = False
        if recording:  # the record of iteration 1 is complete (kept only if the step was)
            sandbox.finish_recording(self.ch, Verdict.commits(f.verdict), self.layout)
        if not Verdict.commits(f.verdict):
            return self._discard(step, f, final)
        final = self._landed(f)  # (the steps landed above, and this window)
        if self.cfg.save_interval and step % self.cfg.save_interval == 0:
            self._save(step, cap.reports)
        if f.verdict == Verdict.SWITCH:
            self.drain.committed(step)
        if self.cfg.warmup and self.cfg.hold_for_warm_s and self.m.mode == "worker" and self.m.epoch == 0 \
                and step == 1:
            self._hold_for_warm()
        return self._went_on(final, t0)

    def _landed(self, f: Flight) -> List[Tuple[int, Any]]:
        """A vote committed: its state is the rollback point and its peer's the buddy copy."""
        self.ring.keep(f.snap, f.received)
        self._provisional -= f.nsteps
        if self._provisional == 0:
            self._poison_told = False
        self.registry.reap()
        self._votes_landed.append(f.step)
        return f.window

    def _discard(self, step: int, f: Flight, final: List[Tuple[int, Any]]) -> List[Tuple[int, Any]]:
        """A landed vote was poisoned: every step since the last committed one is discarded,
        this one included, and the loop redoes them once recovery is done. ``final``: what the
        vote landed earlier at this boundary made final (the one before a synchronous vote)."""
        self._fire_committed()
        self.info("step %d discarded (%s)", f.step, f.verdict[:120])
        self.recovery.recover(step)
        self._redeliver = f.redeliver + self._redeliver  # not handed back yet: the redone vote carries it
        self._committed = False
        return final

    def _went_on(self, final: List[Tuple[int, Any]], t0: float) -> List[Tuple[int, Any]]:
        self.hook_s += time.perf_counter() - t0
        memory.boundary()
        self._committed = True
        self._fire_committed()
        return final

    def _fire_committed(self) -> None:
        """The fault injector's ``committed`` phase, once the boundary that landed the vote has
        done what follows a commit (the checkpoint of a save step)."""
        steps, self._votes_landed = self._votes_landed, []
        if self._fire is not None:
            for st in steps:
                self._fire("committed", st)

    def _pass(self, step: int, report: Any, t0: float, iter_s: float) -> List[Tuple[int, Any]]:
        """A boundary between votes (``commit_interval`` > 1): no store, no copy, no wait.

        The step is held, not committed: the next vote decides it with the rest of its
        window, and hands back its ``report`` then. A poisoned rank goes on, so that its
        peers on healthy groups never wait for a partner that stopped: every rank runs the
        same collectives up to the vote, the broken groups short-circuit, and the vote
        discards the whole window. It tells the controller at once (an early poisoned
        verdict on the window's first step), which confirms a silent machine sooner."""
        if self.fence.poisoned and not self._poison_told:
            self._poison_told = True
            self.vote.tell_poisoned(self.gen, step - self._provisional, self.rank)
        self._provisional += 1
        self._held.append((step, report))
        self.steps_committed += 1
        self.iter_s.append(iter_s)
        self._new_gen = False
        self.hook_s += time.perf_counter() - t0
        memory.boundary()
        self._committed = True
        return []

    # ------------------------------------------------------------------ boundary pieces
    def _wire_reports(self, final: Sequence[Tuple[int, Any]]) -> Optional[list]:
        if not final or not self._reports_ok:
            return None
        try:
            return reports.encode(final)
        except RecoveryError as exc:  # said once; training goes on, a joiner just hands nothing back
            self._reports_ok = False
            log.warning("%s commit reports are not carried to a joiner: %s", self.prefix(), exc)
            return None

    def take_redelivery(self, read: Callable[[], Optional[List[Tuple[int, Any]]]], where: str) -> None:
        """A joiner, or a restart: the steps its role's previous process made final (``read``
        from the role's state or its checkpoint), which that process may not have logged."""
        try:
            self._redeliver = read() or []
        except RecoveryError as exc:
            log.warning("%s refused the reports carried in %s: %s", self.prefix(), where, exc)
            self._redeliver = []
        if self._redeliver:
            self.info("hands back step(s) %s at its first commit: the role's previous process made them final "
                       "and may not have logged them", [s for s, _ in self._redeliver])

    def _save(self, step: int, wire_reports: Optional[list]) -> None:
        t0 = time.perf_counter()
        if wire_reports:  # first: a restart from this step hands them back (read only once the save is whole)
            reports.write(self.checkpoint_dir, step, self.rank, wire_reports)
        self.fw.save(self.checkpoint_dir, step, self.model, self.optimizer)
        self.info("checkpoint of step %d saved in %.2fs", step, time.perf_counter() - t0)

    # ------------------------------------------------------------------ a new generation (both sides)
    def advance(self, pending) -> Any:
        """Swap in the next generation's groups everywhere: registry, framework objects, library globals."""
        old = {k: self.registry.entry(k) for k in pending.entries}
        report = self.registry.commit(pending)
        mapping: Dict[int, dist.ProcessGroup] = {}
        for k, e in pending.entries.items():
            o = old.get(k)
            if o is None:
                continue
            mapping[id(o.group)] = e.group
            if o.gloo is not None and e.gloo is not None:
                mapping[id(o.gloo)] = e.gloo
        roots = self.fw.swap_roots(self.model, self.optimizer)
        swapped = swap_groups(roots, mapping)
        self.fw.install(self.registry)
        self.fw.new_generation(self.model, self.optimizer)
        # prove it: no reference to a retired group is left where the library looks
        self.stale_refs = find_groups(roots, {k: None for k in mapping})
        if self.stale_refs:
            log.warning("%s %d reference(s) to retired groups survived the swap: %s", self.prefix(),
                        len(self.stale_refs), self.stale_refs[:5])
        self.gen = self.registry.generation
        world = pgmod.world_group()
        world.rewind(world.seq, self.gen)  # this generation's world operations get keys of their own
        self._new_gen = True
        return report, swapped

    # ------------------------------------------------------------------ start
    def _start(self) -> None:
        if not self.controlled:
            self.data = self.make_data(1)
            return
        mode = self.m.mode
        if mode == "recover":
            self.recovery.start_joiner()
        elif mode == "drain":
            self.drain.start_joiner()
        else:
            if mode == "restart":
                import os

                from pitstop.runtime.worker import ENV_RESUME

                loaded = self.fw.load(self.checkpoint_dir, self.model, self.optimizer, int(os.environ[ENV_RESUME]))
                self.first_step = loaded + 1
                self.info("restarted from the checkpoint of step %d", loaded)
                self.take_redelivery(lambda: reports.read(self.checkpoint_dir, loaded, self.rank), "the checkpoint")
            self.data = self.make_data(self.first_step)
            if self.rank == 0 and self.m.epoch == 0 and mode == "worker":  # what the controller plans with
                lay = self.layout
                self.ch.put(keys.LAYOUT, {"world_size": lay.world_size, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp,
                                          "ep": lay.ep, "etp": lay.etp, "order": lay.order,
                                          "shard_kind": self.fw.shard_kind})
            # the first rollback point and buddy copy: the state before the first step
            self.step = self.first_step - 1
            with sandbox.paused():  # pitstop's own exchange is not part of the script's iteration
                self.ring.start(self.first_step - 1, pgmod.world_group().seq)

    def begin_at(self, step: int) -> None:
        """This process's loop starts at ``step`` (a joiner): the step and the data there."""
        self.first_step = step
        self.step = step
        self.data = self.make_data(step)

    def redo_from(self, step: int) -> None:
        """The window from ``step`` on was discarded (recovery rolled back): the data goes back
        there, the steps run since the last vote are forgotten, and the loop yields ``step`` again."""
        self.data = self.make_data(step)
        self.fence.reset()
        self._redo_at = step
        self.steps_committed -= self._provisional  # run between votes, now discarded with the window
        if self._provisional:
            del self.iter_s[-self._provisional:]
        self._provisional = 0
        self._held = []
        self._poison_told = False

    def restore(self, snap: state.Snapshot) -> None:
        """Write a snapshot into this rank (rollback, or a joiner taking its role)."""
        self.fw.prepare_rollback(self.model, self.optimizer)
        extra = state.restore(self.optimizer, snap)
        self.fw.set_extra_state(self.model, self.optimizer, extra)

    # ------------------------------------------------------------------ fault injection
    def _arm_faults(self) -> None:
        module, points = self.fw.fault_points(self.model, self.optimizer)

        def fire(phase: str, step: Optional[int] = None) -> None:
            at = self.step if step is None else step  # "committed" is a landed vote's step
            for f in self.faults:
                if at == f.step and phase == f.phase:
                    self.ch.put(keys.FAULT_FIRED, {"time": time.time()}, own=False)
                    self.info("fault injector: signal %s in phase %s", f.sig, phase)
                    f.fire()

        self._fire = fire
        module.register_forward_pre_hook(lambda *_: fire("forward"))
        p = first_trainable(module)
        p.register_hook(lambda g: (fire("backward"), g)[1])
        for phase, targets in points.items():
            for obj, name in targets:
                wrap(obj, name, lambda phase=phase: fire(phase))


def _is_etcd_store() -> bool:
    import os

    from pitstop.store import ENV_STORE, is_etcd

    return is_etcd(os.environ.get(ENV_STORE, ""))
