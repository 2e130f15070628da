"""The controller's side of a planned drain: requests, phase 1, the switch.

::

    pitstop drain --rank R | --host H   -> ctl/drain/request (sealed)
    Drains.check: read each request, queue its roles (a host onto a standby machine as one
        move), start the next drain when no change is under way
    Drains.start (phase 1): pick warm standbys, announce the drain of generation g,
        assign the joiners; everyone builds generation g+1's delta in the background
    Drains.progress: "ready" when every rank prepared; at the switch the stayers
        reported, the roster becomes g+1 and the change is pending until its first commit

A piece of :class:`pitstop.launch.controller.Controller`: it owns the drains' state (the
requests seen, the queue, the moves waiting for a standby, the drain under way), and acts
on the controller's roster, members, pool and events, which it is handed as ``c``.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from pitstop import protocol
from pitstop.runtime import keys


class Drains:
    """Planned drains, one at a time (see the module docstring)."""

    def __init__(self, controller: Any) -> None:
        self.c = controller
        self.seen = 0
        """Drain requests read so far (the request counter's value)."""
        self.queue: List[tuple] = []
        """(roles, standby machine or None): one move each, in request order."""
        self.waiting: set = set()
        """Moves that wait for a warm standby (told once each)."""
        self.current: Optional[Dict[str, Any]] = None
        """The drain under way: roles, generation, slots, leavers, times."""

    def state(self) -> Dict[str, Any]:
        """What the controller persists of the drains (keys as before the split)."""
        d = self.current
        return {"drain_seen": self.seen, "drain_queue": [[list(r), v] for r, v in self.queue],
                "drain_waiting": [list(t) for t in self.waiting],
                "draining": None if d is None else {
                    **d, "slots": [[r, sl] for r, sl in d["slots"].items()],
                    "leavers": [[r, sl] for r, sl in d["leavers"].items()],
                    "old": [[r, v] for r, v in d["old"].items()],
                    "new": [[r, v] for r, v in d["new"].items()]}}

    def take_state(self, st: Dict[str, Any]) -> None:
        """The persisted drains of a controller that restarts (see :meth:`state`)."""
        self.seen = st["drain_seen"]
        self.queue = [(list(r), v) for r, v in st["drain_queue"]]
        self.waiting = {tuple(t) for t in st["drain_waiting"]}
        d = st["draining"]
        self.current = None if d is None else {**d, **{k: {int(r): v for r, v in d[k]}
                                                       for k in ("slots", "leavers", "old", "new")}}

    def check(self) -> None:
        c = self.c
        n = c.ch.add(keys.DRAIN_REQUEST, 0)
        while self.seen < n:
            self.seen += 1
            req = c.ch.read(keys.drain_payload(self.seen), protocol.DRAIN_REQUEST)
            if req is None:  # refused (logged) or never written
                continue
            roles = self.roles_for(req)
            via = c._standby_machine(len(roles)) if req.get("host") is not None and roles else None
            c.events.write("drain-request", request=req, roles=roles, standby_machine=via)
            if via is not None:  # a whole machine onto a standby machine: one two-phase move
                self.queue.append((roles, via))
            else:
                self.queue.extend(([r], None) for r in roles)
        if (self.current is None and self.queue and c.roster is not None and not c.pending
                and not c.lost):
            self.start(*self.queue.pop(0))
        if self.current is not None:
            self.progress()

    def roles_for(self, req: Dict[str, Any]) -> List[int]:
        c = self.c
        if req.get("rank") is not None:
            r = req["rank"]
            if not 0 <= r < c.spec.world_size:
                c.events.write("drain-refused", reason=f"rank {r} does not exist (world {c.spec.world_size})")
                return []
            return [r]
        host = req.get("host")
        roles = [r for r, p in enumerate(c.roster.roles) if p.host == host] if c.roster else []
        if not roles:
            c.events.write("drain-refused", reason=f"no role runs on host {host!r}")
        return roles

    def start(self, roles: List[int], via: Optional[int] = None) -> None:
        """Phase 1 of a drain of ``roles`` (one rank, or a whole machine's onto a standby machine)."""
        c = self.c
        if via is not None and sum(1 for s in c.pool if c.members[s].node == via) < len(roles):
            via = None  # the standby machine is gone: per-role moves onto any standby
            self.queue[:0] = [([r], None) for r in roles[1:]]
            roles = roles[:1]
        if len(c.pool) < len(roles):  # wait for the pool to refill rather than refuse
            key = tuple(roles)
            if key not in self.waiting:
                self.waiting.add(key)
                c.events.write("drain-waiting", role=roles[0], roles=roles,
                               reason="no warm standby yet; waiting for the pool to refill")
            self.queue.insert(0, (roles, via))
            return
        self.waiting.discard(tuple(roles))
        g = c.roster.generation
        slots = {r: c._pick_standby(via) for r in sorted(roles)}
        joiners = {r: c.members[s].info for r, s in slots.items()}
        c.ch.put(keys.drain(g), {"role": roles[0], "roles": sorted(roles), "generation": g + 1,
                                 "joiner": joiners[roles[0]].describe()})
        c._ended(g)
        for r, slot in slots.items():
            c.ch.put(keys.assign(slot), {"role": r, "roles": sorted(roles), "generation": g + 1, "mode": "drain",
                                         "from_generation": g})
        self.current = {"role": roles[0], "roles": sorted(roles), "gen": g, "slots": slots,
                        "leavers": {r: c.role_slots[r] for r in roles}, "t0": time.time(),
                        "old": {r: c.roster.roles[r].describe() for r in roles},
                        "new": {r: j.describe() for r, j in joiners.items()},
                        "warm": all(c._warm(s) for s in slots.values())}
        c.events.write("drain-prepare", role=roles[0], roles=sorted(roles), generation=g,
                       joiner=joiners[roles[0]].describe(), standby_machine=via)
        c.refill += sum(1 for s in slots.values() if not c.members[s].machine)  # see _failure

    def progress(self) -> None:
        c = self.c
        d = self.current
        g = d["gen"]
        if "ready" not in d and c.ch.read(keys.drain_ready(g), protocol.FLAG) is not None:
            d["ready"] = time.time()
            c.events.write("drain-ready", role=d["role"], roles=d["roles"], prepare_s=round(d["ready"] - d["t0"], 4))
        sw = c.ch.read(keys.drain_switch(g), protocol.DRAIN_SWITCH)
        if sw is not None:
            step_s, t_switch = sw["step"], sw["time"]
            for leaver_slot in d["leavers"].values():
                leaver = c.members[leaver_slot]
                if leaver.proc is not None:
                    c.leavers.add(leaver.proc.name)
            c.roster = c.roster.replace_many({r: c.members[s].info for r, s in d["slots"].items()})
            c.role_slots.update(d["slots"])
            c._write_roster()
            one = len(d["roles"]) == 1
            c.pending.append({"kind": "planned", "role": d["role"], "roles": d["roles"], "generation": g + 1,
                              "step": int(step_s) + 1,
                              "old": d["old"][d["role"]] if one else d["old"],
                              "new": d["new"][d["role"]] if one else d["new"],
                              "requested": d["t0"], "ready_at": d.get("ready"), "warm": d.get("warm"),
                              "switch_at": float(t_switch)})
            self.current = None
