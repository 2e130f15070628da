"""The controller's last resort: a checkpoint restart of the whole job, or the end of it.

::

    a role lost, no standby left (or no peer holds its state)
        -> fallback: the latest checkpoint (pitstop's own, or the script's declared one)
            none      -> "failed", exit 1
            step S    -> announce the fallback, restart_all(S)
    restart_all: past --max-restarts -> "failed"; else stop every process that is not an
        idle standby, place each training machine's ranks (placement: a standby machine may
        take a lost machine's place), start them all at epoch + 1

A piece of :class:`pitstop.launch.controller.Controller`. It keeps no state of its own: a
restart replaces the controller's whole process table (members, roster, epoch), which it is
handed as ``c``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from pitstop import protocol
from pitstop.errors import PitstopError
from pitstop.launch.events import CHECKPOINTS
from pitstop.runtime import keys
from pitstop.runtime.worker import ENV_RESUME

log = logging.getLogger(__name__)


class Restarts:
    """The checkpoint fallback and the full restart (see the module docstring)."""

    def __init__(self, controller: Any) -> None:
        self.c = controller

    def fallback(self, roles: List[int], reason: str, step: int, t_detect: float, fired: Optional[float],
                  why: str = "no standby left") -> None:
        c = self.c
        g = c.roster.generation
        resume, where = self.latest_checkpoint()
        c.events.write("failure", role=roles[0], roles=roles, reason=reason, step=step, generation=g,
                       standbys=len(c.pool))
        if resume is None:
            c.events.write("failed", reason=f"role(s) {','.join(map(str, roles))} lost, {why}, and no checkpoint "
                                             f"(save_interval={c.cfg.save_interval}, {where})")
            c.exit_code = 1
            return
        c.events.write("fallback", mode="checkpoint-restart", resume_step=resume, reason=why)
        c.ch.put(keys.fault(g), {"fallback": True, "resume_step": resume})
        c._ended(g)
        self.restart_all(resume, roles[0], reason, t_detect, fired)

    def latest_checkpoint(self) -> Tuple[Optional[int], str]:
        """The step a checkpoint restart resumes from (None: there is none), and where it looked.

        pitstop's own checkpoints when the job saves them (``--save-interval``); otherwise the
        script's, if world rank 0 declared them (Megatron-LM's ``--save``: the workers reload
        it themselves through Megatron-LM's ``--load``). The declaration comes from the network:
        an absolute directory and a bare file name, or it is refused."""
        c = self.c
        from pitstop.runtime import checkpoint

        if c.cfg.save_interval:
            d = c.cfg.save_dir or str(c.run_dir / CHECKPOINTS)
            return checkpoint.latest_step(d), f"dir {d}"
        ck = c.ch.read(keys.CHECKPOINT, protocol.CHECKPOINT)
        if ck is None:
            return None, "the script declared no checkpoints of its own"
        d, marker = ck["dir"], ck["marker"]
        if not os.path.isabs(d) or not marker or marker in (".", "..") or "/" in marker or "\0" in d + marker:
            c.ch.refuse(keys.CHECKPOINT, f"checkpoint location {d!r}, marker {marker!r}: expected an absolute "
                                         "directory and a file name")
            return None, "the script's checkpoint declaration was refused"
        try:
            return checkpoint.latest_step(d, marker), f"the script's checkpoints in {d}"
        except PitstopError as exc:
            log.warning("the script's checkpoint marker cannot be used: %s", exc)
            return None, f"the script's checkpoints in {d}: {exc}"

    def restart_all(self, resume: Optional[int], role: int, reason: str, t_detect: float, fired: Optional[float]) -> None:
        """Stop every worker and start them all again (from checkpoint ``resume``, or from scratch).
        The job's ``epoch`` counts these restarts; past ``--max-restarts`` the job ends instead."""
        c = self.c
        g = c.roster.generation if c.roster is not None else c.generation
        if c.epoch >= c.spec.max_restarts:
            c.events.write("failed", reason=f"{reason}; not restarted: {c.epoch} restart(s) already "
                                            f"(--max-restarts {c.spec.max_restarts}), the cause repeats")
            log.error("giving up: %s (%d restarts, --max-restarts %d)", reason, c.epoch, c.spec.max_restarts)
            c.exit_code = 1
            return
        if resume is None:
            c.events.write("restart", mode="from-scratch", reason=f"role {role} lost before the first step"
                           if role >= 0 else reason)
        placement: Dict[int, int] = {}
        if c.spec.agents_apart:
            placement, taken, why = self.placement()
            if why:
                c.events.write("failed", reason=f"{reason}; the restart needs {self.training_machines()} "
                                                f"machines: {why}")
                c.exit_code = 1
                return
            for s in taken:  # a standby machine becomes a training machine: its standbys make room
                c.pool.remove(s)
                c.stopping.add(c.members[s].proc.name)
                c.agent.kill(c.members[s].proc)
                del c.members[s]
        # every process but the idle standbys: workers, joiners that took a role, a drain's joiner
        doomed = [m.proc for s, m in c.members.items() if s not in c.pool and m.proc is not None and m.proc.running]
        doomed += [e["proc"] for e in c.expected.values() if not e["standby"] and e["proc"].running]
        for p in doomed:
            c.agent.kill(p)
        deadline = time.monotonic() + 30
        while any(p.running for p in doomed) and time.monotonic() < deadline:
            c.agent.poll()
            time.sleep(0.01)
        for s in [s for s in c.members if s not in c.pool]:
            del c.members[s]
        for s in [s for s, e in c.expected.items() if not e["standby"]]:
            del c.expected[s]
        c.leavers.clear()
        c.role_slots.clear()
        c.finished.clear()
        c.epoch += 1
        c.generation = g + 1
        c.roster = None
        c.store.delete_key(keys.COMMITTED)
        c.committed = None
        for r in range(c.spec.world_size):
            c._start_worker(r, {ENV_RESUME: str(resume), "PITSTOP_FAULT": ""} if resume is not None else {"PITSTOP_FAULT": ""},
                            placement.get(r // c.spec.nproc_per_node))
        c.pending.append({"kind": "restart", "generation": g + 1, "step": (resume or 0) + 1, "fired": fired,
                          "detected": t_detect, "planned": time.time(), "reason": reason, "role": role})

    def training_machines(self) -> int:
        c = self.c
        return c.spec.world_size // c.spec.nproc_per_node

    def placement(self) -> tuple:
        """Where a full restart runs each training machine's ranks: ``({logical machine: machine},
        standby slots to stop, why not)``.

        A logical machine ``L`` holds ranks ``L*nproc .. L*nproc+nproc-1``. It stays on the live
        machine that holds all of its roles now (the standby machine that took them over, say),
        else on machine ``L`` if that is alive, else it moves to a live standby machine whose idle
        standbys are stopped to free its devices. With too few live machines, nothing starts."""
        c = self.c
        nproc, alive = c.spec.nproc_per_node, (lambda k: not c.agent.nodes[k].lost)
        out: Dict[int, int] = {}
        for L in range(self.training_machines()):
            where = {c.members[c.role_slots[r]].node for r in range(L * nproc, (L + 1) * nproc)
                     if r in c.role_slots and c.role_slots[r] in c.members}
            if len(where) == 1 and alive(k := where.pop()) and k not in out.values():
                out[L] = k
        for L in range(self.training_machines()):
            if L not in out and alive(L) and L not in out.values():
                out[L] = L
        spares = [k for k in range(c.spec.nodes.max) if alive(k) and k not in out.values()]
        lost = sorted(k for k in range(c.spec.nodes.max) if not alive(k))
        taken: List[int] = []
        for L in range(self.training_machines()):
            if L in out:
                continue
            if not spares:
                return out, [], (f"machine(s) {lost} are lost and no standby machine is left "
                                 f"({c.spec.nodes.max - len(lost)} of {c.spec.nodes.max} alive)")
            out[L] = k = spares.pop(0)
            taken += [s for s in c.pool if c.members[s].node == k]
        return out, taken, None
