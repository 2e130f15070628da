"""The controller's side of a planned drain: requests, phase 1, the switch.

::

    pitstop drain --rank R | --host H   -> ctl/drain/request (sealed)
    _check_drain_requests: read each request, queue its roles (a host onto a standby
        machine as one move), start the next drain when no change is under way
    _start_drain (phase 1): pick warm standbys, announce the drain of generation g,
        assign the joiners; everyone builds generation g+1's delta in the background
    _drain_progress: "ready" when every rank prepared; at the switch the stayers
        reported, the roster becomes g+1 and the change is pending until its first commit

A room of :class:`pitstop.launch.controller.Controller`, which holds the state these
methods read (roster, members, pool, drain queue, events).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from pitstop import protocol
from pitstop.runtime import keys


class DrainMixin:
    """Planned drains, one at a time (see the module docstring)."""

    def _check_drain_requests(self) -> None:
        n = self.ch.add(keys.DRAIN_REQUEST, 0)
        while self.drain_seen < n:
            self.drain_seen += 1
            req = self.ch.read(keys.drain_payload(self.drain_seen), protocol.DRAIN_REQUEST)
            if req is None:  # refused (logged) or never written
                continue
            roles = self._roles_for(req)
            via = self._standby_machine(len(roles)) if req.get("host") is not None and roles else None
            self.events.write("drain-request", request=req, roles=roles, standby_machine=via)
            if via is not None:  # a whole machine onto a standby machine: one two-phase move
                self.drain_queue.append((roles, via))
            else:
                self.drain_queue.extend(([r], None) for r in roles)
        if (self.draining is None and self.drain_queue and self.roster is not None and not self.pending
                and not self.lost):
            self._start_drain(*self.drain_queue.pop(0))
        if self.draining is not None:
            self._drain_progress()

    def _roles_for(self, req: Dict[str, Any]) -> List[int]:
        if req.get("rank") is not None:
            r = req["rank"]
            if not 0 <= r < self.spec.world_size:
                self.events.write("drain-refused", reason=f"rank {r} does not exist (world {self.spec.world_size})")
                return []
            return [r]
        host = req.get("host")
        roles = [r for r, p in enumerate(self.roster.roles) if p.host == host] if self.roster else []
        if not roles:
            self.events.write("drain-refused", reason=f"no role runs on host {host!r}")
        return roles

    def _start_drain(self, roles: List[int], via: Optional[int] = None) -> None:
        """Phase 1 of a drain of ``roles`` (one rank, or a whole machine's onto a standby machine)."""
        if via is not None and sum(1 for s in self.pool if self.members[s].node == via) < len(roles):
            via = None  # the standby machine is gone: per-role moves onto any standby
            self.drain_queue[:0] = [([r], None) for r in roles[1:]]
            roles = roles[:1]
        if len(self.pool) < len(roles):  # wait for the pool to refill rather than refuse
            key = tuple(roles)
            if key not in self.drain_waiting:
                self.drain_waiting.add(key)
                self.events.write("drain-waiting", role=roles[0], roles=roles,
                                  reason="no warm standby yet; waiting for the pool to refill")
            self.drain_queue.insert(0, (roles, via))
            return
        self.drain_waiting.discard(tuple(roles))
        g = self.roster.generation
        slots = {r: self._pick_standby(via) for r in sorted(roles)}
        joiners = {r: self.members[s].info for r, s in slots.items()}
        self.ch.put(keys.drain(g), {"role": roles[0], "roles": sorted(roles), "generation": g + 1,
                                    "joiner": joiners[roles[0]].describe()})
        self._ended(g)
        for r, slot in slots.items():
            self.ch.put(keys.assign(slot), {"role": r, "roles": sorted(roles), "generation": g + 1, "mode": "drain",
                                            "from_generation": g})
        self.draining = {"role": roles[0], "roles": sorted(roles), "gen": g, "slots": slots,
                         "leavers": {r: self.role_slots[r] for r in roles}, "t0": time.time(),
                         "old": {r: self.roster.roles[r].describe() for r in roles},
                         "new": {r: j.describe() for r, j in joiners.items()},
                         "warm": all(self._warm(s) for s in slots.values())}
        self.events.write("drain-prepare", role=roles[0], roles=sorted(roles), generation=g,
                          joiner=joiners[roles[0]].describe(), standby_machine=via)
        self.refill += sum(1 for s in slots.values() if not self.members[s].machine)  # see _failure

    def _drain_progress(self) -> None:
        d = self.draining
        g = d["gen"]
        if "ready" not in d and self.ch.read(keys.drain_ready(g), protocol.FLAG) is not None:
            d["ready"] = time.time()
            self.events.write("drain-ready", role=d["role"], roles=d["roles"], prepare_s=round(d["ready"] - d["t0"], 4))
        sw = self.ch.read(keys.drain_switch(g), protocol.DRAIN_SWITCH)
        if sw is not None:
            step_s, t_switch = sw["step"], sw["time"]
            for leaver_slot in d["leavers"].values():
                leaver = self.members[leaver_slot]
                if leaver.proc is not None:
                    self.leavers.add(leaver.proc.name)
            self.roster = self.roster.replace_many({r: self.members[s].info for r, s in d["slots"].items()})
            self.role_slots.update(d["slots"])
            self._write_roster()
            one = len(d["roles"]) == 1
            self.pending.append({"kind": "planned", "role": d["role"], "roles": d["roles"], "generation": g + 1,
                                 "step": int(step_s) + 1,
                                 "old": d["old"][d["role"]] if one else d["old"],
                                 "new": d["new"][d["role"]] if one else d["new"],
                                 "requested": d["t0"], "ready_at": d.get("ready"), "warm": d.get("warm"),
                                 "switch_at": float(t_switch)})
            self.draining = None
