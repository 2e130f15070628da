"""Unplanned recovery, one side of :class:`pitstop.runtime.session.Session`.

A rank died during a step: every stayer rolls back to the last committed step, rebuilds
only the delta groups with the joiner (a warmed standby that took the role), and the
joiner takes its state from the buddy copies::

    controller:  lost -> settle -> fault(g) {roles, generation g+1, step}, assign(slot)
    stayer:      poisoned vote | rollback | prepare(roles) -> delta groups | send state
    joiner:      assigned | groups exist (empty) + model, optimizer, data | attach | recv state

A fault that names no standby (``fallback``) means the controller restarts every process
from the last checkpoint: the rank waits to be stopped (:meth:`Recovery.await_restart`).

:class:`Recovery` is one piece of the session (:mod:`pitstop.runtime.host`): it owns the
generation it aborted and the wake-up of a fault's announcement; the training objects, the
ring and the step window are the session's, reached through the :class:`Host` protocol.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional

from pitstop import pg as pgmod
from pitstop import protocol
from pitstop.errors import RecoveryError
from pitstop.plan import plan_replace
from pitstop.runtime import keys, reports, worker
from pitstop.runtime.host import Host

log = logging.getLogger(__name__)


class Recovery:
    """The session's unplanned side: fail fast on a dead peer, roll back, rebuild the delta,
    hand the joiner its state (stayer) or take it (joiner)."""

    def __init__(self, host: Host) -> None:
        self.s = host
        self.aborted_gen = -1
        """The last generation whose failure this rank acted on (fail-fast or rollback)."""
        self.fault_seen = threading.Event()
        """Set by the watchers when a fault is announced: wakes :meth:`wait_fault` at once."""

    def look(self, ch: protocol.Channel, gen: int) -> None:
        """The watcher thread's look: a fault announced for ``gen`` wakes the waiting rank, and
        its groups that hold a failed role are marked broken."""
        if self.aborted_gen >= gen:
            return
        info = self.fault_info(ch, gen)
        if info is not None:
            self.fault_seen.set()
            if info.get("roles"):  # (a fallback names none)
                self.abandon_delta(gen, info["roles"])

    def abandon_delta(self, gen: int, roles: List[int]) -> None:
        """Fail fast: mark this rank's groups that hold a failed role broken, so a
        collective blocked on them returns now rather than at the timeout."""
        s = self.s
        if not s.groups_lock.acquire(blocking=False):  # recovery runs: it owns the groups now
            return
        try:
            if s.gen != gen or self.aborted_gen >= gen or s.rank in roles:
                return
            self.aborted_gen = gen
            kinds = plan_replace(s.layout, tuple(roles), gen, gen + 1).rebuilt_kinds(s.rank)
            epoch = pgmod.world_group().epoch  # recovery rewinds it to generation gen + 1
            groups = [g for k in kinds if (e := s.registry.entry(k)) for g in (e.group, e.gloo, e.ring)
                      if isinstance(g, pgmod.GuardedGroup)]
        finally:
            s.groups_lock.release()
        for g in groups:
            g.mark_broken()
        pgmod.world_group().mark_broken(epoch)  # the world holds every role: its operation in flight is lost too

    def fault_info(self, ch: protocol.Channel, gen: int) -> Optional[dict]:
        """The controller's verified word on generation ``gen``'s failure, or None."""
        info = ch.read(keys.fault(gen), protocol.FAULT)
        if info is None or info.get("fallback"):
            return info
        try:
            roles = protocol.role_list(info, self.s.layout.world_size)
            if not roles or info.get("generation") != gen + 1:
                raise ValueError(f"roles {roles}, generation {info.get('generation')}: expected at least one role "
                                 f"and generation {gen + 1}")
        except ValueError as exc:
            ch.refuse(keys.fault(gen), str(exc))
            return None
        return {**info, "roles": roles}

    def wait_fault(self) -> dict:
        """The fault of this generation. The vote is often settled poisoned by the controller
        just before it writes the fault: the end-of-generation watch wakes this wait then,
        the 10 ms look is the fallback."""
        s = self.s
        deadline = time.monotonic() + s.cfg.collective_timeout_s * 2
        while time.monotonic() < deadline:
            info = self.fault_info(s.ch, s.gen)
            if info is not None:
                self.fault_seen.clear()
                return info
            self.fault_seen.wait(0.01)
            self.fault_seen.clear()
        raise RecoveryError(f"{s.prefix()} the step was discarded but no fault of generation {s.gen} "
                            f"came within {s.cfg.collective_timeout_s * 2:.0f}s")

    #: How long past the collective timeout a rank waits to be stopped once the controller
    #: announced a checkpoint restart (:meth:`await_restart`).
    RESTART_GRACE_S = 30.0

    def await_restart(self, resume_step) -> None:
        """Wait to be stopped: the controller announced that it restarts every process from the
        checkpoint of ``resume_step`` (no standby was left), so this rank has nothing left to
        do. It watches the control store over its own connection (a fresh one would cost the
        store's server a reverse DNS lookup, see :class:`pitstop.store.ConnectionPool`): a store
        gone means the controller died, and the rank leaves as :func:`worker.controller_lost`
        says. A rank still alive after the collective timeout plus :attr:`RESTART_GRACE_S` was
        forgotten by the restart, and fails loudly instead of hanging."""
        s = self.s
        limit = s.cfg.collective_timeout_s + self.RESTART_GRACE_S
        deadline = time.monotonic() + limit
        probe = getattr(s.store, "reachable", None)  # etcd: a mirrored store answers check locally
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                if probe is not None:
                    if not probe():
                        raise RecoveryError("etcd does not answer a status request")
                else:
                    s.store.check([keys.DONE])
            except Exception as exc:  # noqa: BLE001 - any failure of the store's own client
                worker.controller_lost(s.prefix(), exc)
        raise RecoveryError(f"{s.prefix()} the controller announced a checkpoint restart from step {resume_step} "
                            f"but did not stop this rank within {limit:.0f}s")

    def recover(self, step: int) -> None:
        """A stayer whose vote on ``step`` was discarded: roll back to the last vote, rebuild the
        delta groups with the joiners, hand them their state, and have the loop redo the window."""
        s, ring = self.s, self.s.ring
        t_seen = time.time()
        info = self.wait_fault()
        if info.get("fallback"):
            s.info("no standby left: the controller restarts the job from the checkpoint of step %s", info.get("resume_step"))
            self.await_restart(info.get("resume_step"))
        roles, new_gen = info["roles"], info["generation"]
        redo = int(info.get("step", step))  # the first discarded step: the window's first (K > 1) or this one
        snap = ring.snap
        if snap is None or snap.step != redo - 1:
            raise RecoveryError(f"{s.prefix()} the controller discards from step {redo}, this rank's rollback point "
                                f"is step {None if snap is None else snap.step}")
        discarded = step - redo + 1
        t0 = time.perf_counter()
        self.aborted_gen = s.gen
        with s.groups_lock:
            s.restore(snap)
            # the world's operation count goes back with the state: each rank may have stopped
            # at a different world operation in the aborted step (see StoreWorldGroup.rewind)
            pgmod.world_group().rewind(snap.world_seq, new_gen)
            t_roll = time.perf_counter()
            report, swapped = s.advance(s.registry.prepare(roles))
            if s.gen != new_gen:
                raise RecoveryError(f"{s.prefix()} advanced to generation {s.gen}, the controller announced {new_gen}")
            t_groups = time.perf_counter()
        try:
            ring.hand_to_joiners(roles, redo - 1)
        except RecoveryError as exc:
            raise RecoveryError(f"{s.prefix()} {exc}") from None
        t_state = time.perf_counter()
        s.fw.resync_params(s.model, s.optimizer)
        s.redo_from(redo)
        t_end = time.perf_counter()
        s.report(s.gen, f"r{s.rank}", seen=t_seen, rollback_s=t_roll - t0, groups_s=t_groups - t_roll,
                 state_s=t_end - t_groups, transfer_s=t_state - t_groups, ready=time.time(), discarded=discarded,
                 rebuilt=len(report.rebuilt), kept=len(report.kept), swapped=swapped, stale=len(s.stale_refs))
        s.info("recovered: role(s) %s now played by joiners; %d groups rebuilt, %d kept, %d references swapped; "
               "%d step(s) from step %d are redone", ",".join(map(str, roles)), len(report.rebuilt), len(report.kept),
               swapped, discarded, redo)

    def start_joiner(self) -> None:
        """A joiner for a failed role: shard from the buddy, parameters from the all-gather."""
        s, ring = self.s, self.s.ring
        a = s.m.assignment
        role, step = s.rank, int(a["step"])
        built_s = time.time() - s.m.joined_at  # assignment to here: world, groups (empty), model, optimizer, data
        waited = s.registry.attach()  # the communicators built in the background meanwhile
        s.fence.local = False
        t0 = time.perf_counter()
        snap, nxt = ring.receive()
        s.restore(snap)
        s.take_redelivery(lambda: reports.of_snapshot(snap), "the role's state")
        ring.adopt(snap, ring.buddy)
        s.attach_world(snap.world_seq)
        t_state = time.perf_counter()
        s.fw.resync_params(s.model, s.optimizer)
        s.begin_at(step)
        s.report(s.gen, "joiner", joined=s.m.joined_at, built_s=built_s, attach_wait_s=waited,
                 recv_s=t_state - t0, state_s=time.perf_counter() - t0, ready=time.time())
        s.info("joined as role %d at step %d (state from buddy r%d)", role, step, nxt)
