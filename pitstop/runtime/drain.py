"""A planned drain, one side of :class:`pitstop.runtime.session.Session`.

An operator drains a role (or a host's roles): the leaver keeps training while a standby
builds the role, then both switch at one iteration boundary::

    phase 1 (training goes on)   joiner: groups, model, optimizer, data
                                 stayers: the next generation's delta groups (background)
    phase 2 (one boundary)       leaver --handoff pair--> joiner: snapshot, buddy, buffers
                                 everyone: swap to generation g+1; the leaver exits

The state it reads and writes is the session's own (``self``): this mixin is one room of
the session's work, not an object of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from pitstop import pg as pgmod
from pitstop import protocol
from pitstop.errors import RecoveryError
from pitstop.plan import plan_replace
from pitstop.runtime import keys, reports, state

log = logging.getLogger(__name__)


class DrainMixin:
    """The session's planned side: phase 1 in the background, the switch at a boundary."""

    def _take_drain(self, ch: protocol.Channel, gen: int) -> None:
        """Read generation ``gen``'s drain announcement, if there is one, and start phase 1 for
        it (once, whichever thread asks first: the heartbeat's watcher, or the switch)."""
        with self._drain_lock:
            if self._drain is not None:
                return
            info = ch.read(keys.drain(gen), protocol.DRAIN)
            if info is None:
                return
            try:
                roles = protocol.role_list(info, self.layout.world_size)
                if not roles or info["generation"] != gen + 1:
                    raise ValueError(f"roles {roles}, generation {info['generation']}: expected at least one "
                                     f"role and generation {gen + 1}")
            except ValueError as exc:
                ch.refuse(keys.drain(gen), str(exc))
                return
            d = {"info": {**info, "roles": roles}, "gen": gen}
            d["thread"] = threading.Thread(target=self._prepare_drain, args=(d,), name="pitstop-drain-prepare",
                                           daemon=True)
            self._drain = d
            d["thread"].start()

    def _prepare_drain(self, d: Dict[str, Any]) -> None:
        """Phase 1 (background thread): build the next generation's groups, or the hand-off pair."""
        try:
            info, gen = d["info"], d["gen"]
            roles = info["roles"]
            plan = plan_replace(self.layout, tuple(roles), gen, gen + 1)
            if self.rank in roles:
                d["handoff"] = _handoff_pair(gen, self.rank, 0, self.cfg, self.m.take_connection())
            elif self.rank in plan.ranks_involved:
                d["pending"] = self.registry.prepare(roles)
            else:
                return
            conn = self.m.take_connection() or _client()  # this thread's own connection
            ch = self.ch.sibling(conn)
            if ch.add(keys.drain_nready(gen), 1) == len(plan.ranks_involved) + len(roles):
                ch.put(keys.drain_ready(gen), {"set": True})
            if self.m.connections is not None:
                self.m.connections.give(conn)
        except Exception as exc:  # noqa: BLE001 - reported at the switch
            d["error"] = exc
            log.exception("%s drain preparation failed", self.prefix())

    def _switch_if_due(self) -> None:
        """The deferred switch (``switch_at_next_step``): the loop asked for its next step.

        Every rank did the loop's between-step world operations since the vote; the rollback
        point's operation count moves up to here on every rank, so the joiner (which joins the
        world at its loop's start) and a later rollback agree with the stayers. The leaver
        re-takes its state: it is the state at hand-off, whatever the loop did since the vote."""
        if self._switch_due is None:
            return
        step, self._switch_due = self._switch_due, None
        seq = pgmod.world_group().seq
        if self._drain is None:
            self._take_drain(self.ch, self.gen)
        d = self._drain
        if d is not None and self.rank in d["info"]["roles"]:
            self.snap = state.take(self.optimizer, step, seq, out=self._spare,
                                   extra=self.fw.extra_state(self.model, self.optimizer))
        elif self.snap is not None:
            self.snap.world_seq = seq
        self._switch(step)

    def _switch(self, step: int) -> None:
        """Phase 2, at the boundary after ``step``: the leaver hands over and leaves.

        A rank outside the delta may get here before its watcher read the announcement: the
        drain is ready once the delta and the joiner are, and the watcher reads at heartbeat
        pace. It reads it now (it has nothing to build: its prepare returns at once). Seen in
        ``make demo`` under load: rank 1 got the switch verdict first and stopped."""
        if self._drain is None:
            self._take_drain(self.ch, self.gen)
        d = self._drain
        if d is None or d["gen"] != self.gen:
            raise RecoveryError(f"{self.prefix()} switch verdict without a prepared drain")
        d["thread"].join()
        if "error" in d:
            raise RecoveryError(f"{self.prefix()} drain preparation failed: {d['error']}") from d["error"]
        roles = d["info"]["roles"]
        t0 = time.perf_counter()
        if self.rank in roles:
            pair = d["handoff"]
            state.send_snapshot_raw(pair, self.snap, 1)
            state.pg_send(pair, torch.tensor([1 if self.buddy is not None else 0]), 1)
            if self.buddy is not None:
                state.send_snapshot_raw(pair, self.buddy, 1)
            for buf in self.fw.param_buffers(self.model, self.optimizer):
                state.pg_send(pair, buf, 1)
            self._report(self.gen + 1, "leaver", send_s=time.perf_counter() - t0, ready=time.time())
            self._info("drained: state handed to the joiner; leaving")
            logging.shutdown()
            import os
            import sys

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        with self._lock:
            pending = d.get("pending") or self.registry.prepare(roles)
            report, swapped = self._advance(pending)
            self.fw.after_handover(self.model, self.optimizer)
        self._drain = None
        self._report(self.gen, f"r{self.rank}", switch_s=time.perf_counter() - t0, ready=time.time(),
                     rebuilt=len(report.rebuilt), kept=len(report.kept), swapped=swapped, stale=len(self.stale_refs))

    def _start_drain(self) -> None:
        """A joiner for a draining role: phase 1 done (groups, model), wait for the switch, take the state."""
        a = self.m.assignment
        old_gen = int(a["from_generation"])
        roles = protocol.role_list(a, self.layout.world_size) if a.get("roles") else [self.rank]
        self.registry.attach()
        self.fence.local = False
        pair = _handoff_pair(old_gen, self.rank, 1, self.cfg, self.m.take_connection())
        plan = plan_replace(self.layout, tuple(roles), old_gen, old_gen + 1)
        ch = self.ch
        if ch.add(keys.drain_nready(old_gen), 1) == len(plan.ranks_involved) + len(roles):
            ch.put(keys.drain_ready(old_gen), {"set": True})
        t_prepared = time.time()
        sw = ch.wait(keys.drain_switch(old_gen), protocol.DRAIN_SWITCH, timeout_s=86400.0)
        step_s, t_switch = str(sw["step"]), sw["time"]
        t0 = time.perf_counter()
        snap = state.recv_snapshot_raw(pair, 0)
        has_buddy = torch.zeros(1, dtype=torch.int64)
        state.pg_recv(pair, has_buddy, 0)
        self.buddy = state.recv_snapshot_raw(pair, 0) if int(has_buddy) else None
        # restored before the parameters arrive: a rollback may free gathered parameters
        # (DeepSpeed ZeRO-3 releases them to their partitions), which the leaver's then refill
        self._restore(snap)
        for buf in self.fw.param_buffers(self.model, self.optimizer):
            state.pg_recv(pair, buf, 0)
        self.fw.after_handover(self.model, self.optimizer)
        self._take_redelivery(lambda: reports.of_snapshot(snap), "the role's state")
        self.snap = snap
        self._attach_world(snap.world_seq)
        self.first_step = int(step_s) + 1
        self.step = self.first_step
        self.data = self.make_data(self.first_step)
        now = time.time()
        self._report(self.gen, "joiner", prepared=t_prepared, switch_at=float(t_switch), recv_s=time.perf_counter() - t0,
                     ready=now, pause_s=now - float(t_switch))
        self._info("took over role %d after step %s (pause %.3fs)", self.rank, step_s, now - float(t_switch))


def _client() -> dist.Store:
    import os

    from pitstop.store import ENV_STORE, connect

    return connect(os.environ[ENV_STORE], timeout=timedelta(minutes=5))

def _handoff_pair(gen: int, role: int, rank: int, cfg, conn: Optional[dist.Store] = None) -> dist.ProcessGroup:
    """The leaver (0) and the joiner (1) of ``role``'s drain: a two-process gloo pair of their own,
    over ``conn`` (a spare connection to the control store) or a new one."""
    import os

    from pitstop.patches import gloo_address

    from pitstop.store import sealed

    store = dist.PrefixStore(f"pitstop/handoff/g{gen}/r{role}", sealed(conn if conn is not None else _client()))
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    addr = os.environ.get(gloo_address.ENV_ADDR)
    if addr:  # this machine's address, as every other group of the process
        return dist.ProcessGroupGloo(store, rank, 2, gloo_address.options(addr, timeout))
    return dist.ProcessGroupGloo(store, rank, 2, timeout)
