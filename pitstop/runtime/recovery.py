"""Unplanned recovery, one side of :class:`pitstop.runtime.session.Session`.

A rank died during a step: every stayer rolls back to the last committed step, rebuilds
only the delta groups with the joiner (a warmed standby that took the role), and the
joiner takes its state from the buddy copies::

    controller:  lost -> settle -> fault(g) {roles, generation g+1, step}, assign(slot)
    stayer:      poisoned vote | rollback | prepare(roles) -> delta groups | send state
    joiner:      assigned | groups exist (empty) + model, optimizer, data | attach | recv state

A fault that names no standby (``fallback``) means the controller restarts every process
from the last checkpoint: the rank waits to be stopped (:meth:`RecoveryMixin._await_restart`).
The state it reads and writes is the session's own (``self``): this mixin is one room of
the session's work, not an object of its own.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional

from pitstop import pg as pgmod
from pitstop import protocol
from pitstop.errors import RecoveryError
from pitstop.plan import plan_replace
from pitstop.runtime import keys, reports, state, worker

log = logging.getLogger(__name__)


class RecoveryMixin:
    """The session's unplanned side: fail fast on a dead peer, roll back, rebuild the delta,
    hand the joiner its state (stayer) or take it (joiner)."""

    def _abandon_delta(self, gen: int, roles: List[int]) -> None:
        """Fail fast: mark this rank's groups that hold a failed role broken, so a
        collective blocked on them returns now rather than at the timeout."""
        if not self._lock.acquire(blocking=False):  # recovery runs: it owns the groups now
            return
        try:
            if self.gen != gen or self._aborted_gen >= gen or self.rank in roles:
                return
            self._aborted_gen = gen
            kinds = plan_replace(self.layout, tuple(roles), gen, gen + 1).rebuilt_kinds(self.rank)
            epoch = pgmod.world_group().epoch  # recovery rewinds it to generation gen + 1
            groups = [g for k in kinds if (e := self.registry.entry(k)) for g in (e.group, e.gloo)
                      if isinstance(g, pgmod.GuardedGroup)]
        finally:
            self._lock.release()
        for g in groups:
            g.mark_broken()
        pgmod.world_group().mark_broken(epoch)  # the world holds every role: its operation in flight is lost too

    def _fault_info(self, ch: protocol.Channel, gen: int) -> Optional[dict]:
        """The controller's verified word on generation ``gen``'s failure, or None."""
        info = ch.read(keys.fault(gen), protocol.FAULT)
        if info is None or info.get("fallback"):
            return info
        try:
            roles = protocol.role_list(info, self.layout.world_size)
            if not roles or info.get("generation") != gen + 1:
                raise ValueError(f"roles {roles}, generation {info.get('generation')}: expected at least one role "
                                 f"and generation {gen + 1}")
        except ValueError as exc:
            ch.refuse(keys.fault(gen), str(exc))
            return None
        return {**info, "roles": roles}

    def _wait_fault(self) -> dict:
        """The fault of this generation. The vote is often settled poisoned by the controller
        just before it writes the fault: the end-of-generation watch wakes this wait then,
        the 10 ms look is the fallback."""
        deadline = time.monotonic() + self.cfg.collective_timeout_s * 2
        while time.monotonic() < deadline:
            info = self._fault_info(self.ch, self.gen)
            if info is not None:
                self._fault_seen.clear()
                return info
            self._fault_seen.wait(0.01)
            self._fault_seen.clear()
        raise RecoveryError(f"{self.prefix()} the step was discarded but no fault of generation {self.gen} "
                            f"came within {self.cfg.collective_timeout_s * 2:.0f}s")

    #: How long past the collective timeout a rank waits to be stopped once the controller
    #: announced a checkpoint restart (:meth:`_await_restart`).
    RESTART_GRACE_S = 30.0

    def _await_restart(self, resume_step) -> None:
        """Wait to be stopped: the controller announced that it restarts every process from the
        checkpoint of ``resume_step`` (no standby was left), so this rank has nothing left to
        do. It watches the control store over its own connection (a fresh one would cost the
        store's server a reverse DNS lookup, see :class:`pitstop.store.ConnectionPool`): a store
        gone means the controller died, and the rank leaves as :func:`worker.controller_lost`
        says. A rank still alive after the collective timeout plus :attr:`RESTART_GRACE_S` was
        forgotten by the restart, and fails loudly instead of hanging."""
        limit = self.cfg.collective_timeout_s + self.RESTART_GRACE_S
        deadline = time.monotonic() + limit
        probe = getattr(self.store, "reachable", None)  # etcd: a mirrored store answers check locally
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                if probe is not None:
                    if not probe():
                        raise RecoveryError("etcd does not answer a status request")
                else:
                    self.store.check([keys.DONE])
            except Exception as exc:  # noqa: BLE001 - any failure of the store's own client
                worker.controller_lost(self.prefix(), exc)
        raise RecoveryError(f"{self.prefix()} the controller announced a checkpoint restart from step {resume_step} "
                            f"but did not stop this rank within {limit:.0f}s")

    def _recover(self, step: int) -> None:
        t_seen = time.time()
        info = self._wait_fault()
        if info.get("fallback"):
            self._info("no standby left: the controller restarts the job from the checkpoint of step %s", info.get("resume_step"))
            self._await_restart(info.get("resume_step"))
        roles, new_gen = info["roles"], info["generation"]
        redo = int(info.get("step", step))  # the first discarded step: the window's first (K > 1) or this one
        if self.snap is None or self.snap.step != redo - 1:
            raise RecoveryError(f"{self.prefix()} the controller discards from step {redo}, this rank's rollback point "
                                f"is step {None if self.snap is None else self.snap.step}")
        discarded = step - redo + 1
        t0 = time.perf_counter()
        self._aborted_gen = self.gen
        with self._lock:
            self._restore(self.snap)
            # the world's operation count goes back with the state: each rank may have stopped
            # at a different world operation in the aborted step (see StoreWorldGroup.rewind)
            pgmod.world_group().rewind(self.snap.world_seq, new_gen)
            t_roll = time.perf_counter()
            report, swapped = self._advance(self.registry.prepare(roles))
            if self.gen != new_gen:
                raise RecoveryError(f"{self.prefix()} advanced to generation {self.gen}, the controller announced {new_gen}")
            t_groups = time.perf_counter()
        ranks, group = self._shard_group()
        for role in roles:  # the same order on every rank; each joiner receives from next, then previous
            if role not in ranks or len(ranks) == 1:
                continue
            nxt, prv = self._ring(ranks, role)
            if self.rank == nxt:
                if self.buddy is None or self.buddy.step != redo - 1:
                    raise RecoveryError(
                        f"{self.prefix()} holds the buddy copy of role {role} for step "
                        f"{None if self.buddy is None else self.buddy.step}, needs step {redo - 1}"
                    )
                state.send_snapshot(self.buddy, role, group)
            if self.rank == prv and self.cfg.buddy:
                state.send_snapshot(self.snap, role, group)
        t_state = time.perf_counter()
        self.fw.resync_params(self.model, self.optimizer)
        self.data = self.make_data(redo)
        self.fence.reset()
        self._redo_from = redo
        self.steps_committed -= self._provisional  # run between votes, now discarded with the window
        if self._provisional:
            del self.iter_s[-self._provisional:]
        self._provisional = 0
        self._held = []
        self._poison_told = False
        t_end = time.perf_counter()
        self._report(self.gen, f"r{self.rank}", seen=t_seen, rollback_s=t_roll - t0, groups_s=t_groups - t_roll,
                     state_s=t_end - t_groups, transfer_s=t_state - t_groups, ready=time.time(),
                     rebuilt=len(report.rebuilt), kept=len(report.kept), swapped=swapped, stale=len(self.stale_refs))
        self._info("recovered: role(s) %s now played by joiners; %d groups rebuilt, %d kept, %d references swapped; "
                   "%d step(s) from step %d are redone", ",".join(map(str, roles)), len(report.rebuilt), len(report.kept),
                   swapped, discarded, redo)

    def _start_recover(self) -> None:
        """A joiner for a failed role: shard from the buddy, parameters from the all-gather."""
        a = self.m.assignment
        role, step = self.rank, int(a["step"])
        built_s = time.time() - self.m.joined_at  # assignment to here: world, groups (empty), model, optimizer, data
        waited = self.registry.attach()  # the communicators built in the background meanwhile
        self.fence.local = False
        t0 = time.perf_counter()
        ranks, group = self._shard_group()
        nxt, prv = self._ring(ranks, role)
        snap = state.recv_snapshot(nxt, group)
        self.buddy = state.recv_snapshot(prv, group) if self.cfg.buddy else None
        self._restore(snap)
        self._take_redelivery(lambda: reports.of_snapshot(snap), "the role's state")
        self.snap = snap
        self._attach_world(snap.world_seq)
        t_state = time.perf_counter()
        self.fw.resync_params(self.model, self.optimizer)
        self.first_step = step
        self.step = step
        self.data = self.make_data(step)
        self._report(self.gen, "joiner", joined=self.m.joined_at, built_s=built_s, attach_wait_s=waited,
                     recv_s=t_state - t0, state_s=time.perf_counter() - t0, ready=time.time())
        self._info("joined as role %d at step %d (state from buddy r%d)", role, step, nxt)
