"""A planned drain, one side of :class:`pitstop.runtime.session.Session`.

An operator drains a role (or a host's roles): the leaver keeps training while a standby
builds the role, then both switch at one iteration boundary::

    phase 1 (training goes on)   joiner: groups, model, optimizer, data
                                 stayers: the next generation's delta groups (background)
    phase 2 (one boundary)       leaver --handoff pair--> joiner: snapshot, buddy, buffers
                                 everyone: swap to generation g+1; the leaver exits

:class:`Drain` is one piece of the session (:mod:`pitstop.runtime.host`): it owns the drain
in progress (its background thread, the groups or the hand-off pair it built) and a switch
that waits for the loop's next step; the training objects, the ring and the generation are
the session's, reached through the :class:`Host` protocol.
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
from pitstop.runtime.host import Host

log = logging.getLogger(__name__)


class Drain:
    """The session's planned side: phase 1 in the background, the switch at a boundary."""

    def __init__(self, host: Host, switch_at_next_step: bool = False) -> None:
        self.s = host
        self.current: Optional[Dict[str, Any]] = None
        """The drain in progress: its announcement, generation, thread, and what phase 1 built."""
        self._lock = threading.Lock()
        self.switch_at_next_step = switch_at_next_step
        """The switch waits for the loop to ask for its next step, instead of happening inside
        the boundary. For a loop that does world operations of its own between steps
        (Megatron-LM logs, times and checks after ``train_step``): the leaver does them too, and
        hands over where the joiner's loop begins, so all ranks count the same world operations."""
        self.due: Optional[int] = None
        """The committed step after which a deferred switch happens."""

    def look(self, ch: protocol.Channel, gen: int) -> None:
        """The watcher thread's look: start phase 1 of a drain announced for ``gen``."""
        if self.current is None:
            self.take(ch, gen)

    def committed(self, step: int) -> None:
        """The vote on ``step`` said switch: now, or when the loop asks for its next step."""
        if self.switch_at_next_step:
            self.due = step
        else:
            self.switch(step)

    def take(self, ch: protocol.Channel, gen: int) -> None:
        """Read generation ``gen``'s drain announcement, if there is one, and start phase 1 for
        it (once, whichever thread asks first: the heartbeat's watcher, or the switch)."""
        with self._lock:
            if self.current is not None:
                return
            info = ch.read(keys.drain(gen), protocol.DRAIN)
            if info is None:
                return
            try:
                roles = protocol.role_list(info, self.s.layout.world_size)
                if not roles or info["generation"] != gen + 1:
                    raise ValueError(f"roles {roles}, generation {info['generation']}: expected at least one "
                                     f"role and generation {gen + 1}")
            except ValueError as exc:
                ch.refuse(keys.drain(gen), str(exc))
                return
            d = {"info": {**info, "roles": roles}, "gen": gen}
            d["thread"] = threading.Thread(target=self._prepare, args=(d,), name="pitstop-drain-prepare",
                                           daemon=True)
            self.current = d
            d["thread"].start()

    def _prepare(self, d: Dict[str, Any]) -> None:
        """Phase 1 (background thread): build the next generation's groups, or the hand-off pair."""
        s = self.s
        try:
            info, gen = d["info"], d["gen"]
            roles = info["roles"]
            plan = plan_replace(s.layout, tuple(roles), gen, gen + 1)
            if s.rank in roles:
                d["handoff"] = _handoff_pair(gen, s.rank, 0, s.cfg, s.m.take_connection())
            elif s.rank in plan.ranks_involved:
                d["pending"] = s.registry.prepare(roles)
            else:
                return
            conn = s.m.take_connection() or _client()  # this thread's own connection
            ch = s.ch.sibling(conn)
            if ch.add(keys.drain_nready(gen), 1) == len(plan.ranks_involved) + len(roles):
                ch.put(keys.drain_ready(gen), {"set": True})
            if s.m.connections is not None:
                s.m.connections.give(conn)
        except Exception as exc:  # noqa: BLE001 - reported at the switch
            d["error"] = exc
            log.exception("%s drain preparation failed", s.prefix())

    def switch_if_due(self) -> None:
        """The deferred switch (``switch_at_next_step``): the loop asked for its next step.

        Every rank did the loop's between-step world operations since the vote; the rollback
        point's operation count moves up to here on every rank, so the joiner (which joins the
        world at its loop's start) and a later rollback agree with the stayers. The leaver
        re-takes its state: it is the state at hand-off, whatever the loop did since the vote."""
        if self.due is None:
            return
        s, ring = self.s, self.s.ring
        step, self.due = self.due, None
        seq = pgmod.world_group().seq
        if self.current is None:
            self.take(s.ch, s.gen)
        d = self.current
        if d is not None and s.rank in d["info"]["roles"]:
            ring.snap = ring.take(step, seq)
        elif ring.snap is not None:
            ring.snap.world_seq = seq
        self.switch(step)

    def switch(self, step: int) -> None:
        """Phase 2, at the boundary after ``step``: the leaver hands over and leaves.

        A rank outside the delta may get here before its watcher read the announcement: the
        drain is ready once the delta and the joiner are, and the watcher reads at heartbeat
        pace. It reads it now (it has nothing to build: its prepare returns at once). Seen in
        ``make demo`` under load: rank 1 got the switch verdict first and stopped."""
        s, ring = self.s, self.s.ring
        if self.current is None:
            self.take(s.ch, s.gen)
        d = self.current
        if d is None or d["gen"] != s.gen:
            raise RecoveryError(f"{s.prefix()} switch verdict without a prepared drain")
        d["thread"].join()
        if "error" in d:
            raise RecoveryError(f"{s.prefix()} drain preparation failed: {d['error']}") from d["error"]
        roles = d["info"]["roles"]
        t0 = time.perf_counter()
        if s.rank in roles:
            pair = d["handoff"]
            state.send_snapshot_raw(pair, ring.snap, 1)
            state.pg_send(pair, torch.tensor([1 if ring.buddy is not None else 0]), 1)
            if ring.buddy is not None:
                state.send_snapshot_raw(pair, ring.buddy, 1)
            for buf in s.fw.param_buffers(s.model, s.optimizer):
                state.pg_send(pair, buf, 1)
            s.report(s.gen + 1, "leaver", send_s=time.perf_counter() - t0, ready=time.time())
            s.info("drained: state handed to the joiner; leaving")
            logging.shutdown()
            import os
            import sys

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        with s.groups_lock:
            pending = d.get("pending") or s.registry.prepare(roles)
            report, swapped = s.advance(pending)
            s.fw.after_handover(s.model, s.optimizer)
        self.current = None
        s.report(s.gen, f"r{s.rank}", switch_s=time.perf_counter() - t0, ready=time.time(),
                 rebuilt=len(report.rebuilt), kept=len(report.kept), swapped=swapped, stale=len(s.stale_refs))

    def start_joiner(self) -> None:
        """A joiner for a draining role: phase 1 done (groups, model), wait for the switch, take the state."""
        s = self.s
        a = s.m.assignment
        old_gen = int(a["from_generation"])
        roles = protocol.role_list(a, s.layout.world_size) if a.get("roles") else [s.rank]
        s.registry.attach()
        s.fence.local = False
        pair = _handoff_pair(old_gen, s.rank, 1, s.cfg, s.m.take_connection())
        plan = plan_replace(s.layout, tuple(roles), old_gen, old_gen + 1)
        ch = s.ch
        if ch.add(keys.drain_nready(old_gen), 1) == len(plan.ranks_involved) + len(roles):
            ch.put(keys.drain_ready(old_gen), {"set": True})
        t_prepared = time.time()
        sw = ch.wait(keys.drain_switch(old_gen), protocol.DRAIN_SWITCH, timeout_s=86400.0)
        step_s, t_switch = str(sw["step"]), sw["time"]
        t0 = time.perf_counter()
        snap = state.recv_snapshot_raw(pair, 0)
        has_buddy = torch.zeros(1, dtype=torch.int64)
        state.pg_recv(pair, has_buddy, 0)
        buddy = state.recv_snapshot_raw(pair, 0) if int(has_buddy) else None
        # restored before the parameters arrive: a rollback may free gathered parameters
        # (DeepSpeed ZeRO-3 releases them to their partitions), which the leaver's then refill
        s.restore(snap)
        for buf in s.fw.param_buffers(s.model, s.optimizer):
            state.pg_recv(pair, buf, 0)
        s.fw.after_handover(s.model, s.optimizer)
        s.take_redelivery(lambda: reports.of_snapshot(snap), "the role's state")
        s.ring.adopt(snap, buddy)
        s.attach_world(snap.world_seq)
        s.begin_at(int(step_s) + 1)
        now = time.time()
        s.report(s.gen, "joiner", prepared=t_prepared, switch_at=float(t_switch), recv_s=time.perf_counter() - t0,
                 ready=now, pause_s=now - float(t_switch))
        s.info("took over role %d after step %s (pause %.3fs)", s.rank, step_s, now - float(t_switch))


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
