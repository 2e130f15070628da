"""The controller's last resort: a checkpoint restart of the whole job, or the end of it.

::

    a role lost, no standby left (or no peer holds its state)
        -> _fallback: the latest checkpoint (pitstop's own, or the script's declared one)
            none      -> "failed", exit 1
            step S    -> announce the fallback, _restart_all(S)
    _restart_all: past --max-restarts -> "failed"; else stop every process that is not an
        idle standby, place each training machine's ranks (_restart_placement: a standby
        machine may take a lost machine's place), start them all at epoch + 1

A room of :class:`pitstop.launch.controller.Controller`, which holds the state these
methods read (roster, members, pool, agent, events).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Dict, List, Optional, Tuple

from pitstop import protocol
from pitstop.errors import PitstopError
from pitstop.launch.events import CHECKPOINTS
from pitstop.runtime import keys
from pitstop.runtime.worker import ENV_RESUME

log = logging.getLogger(__name__)


class RestartMixin:
    """The checkpoint fallback and the full restart (see the module docstring)."""

    def _fallback(self, roles: List[int], reason: str, step: int, t_detect: float, fired: Optional[float],
                  why: str = "no standby left") -> None:
        g = self.roster.generation
        resume, where = self._latest_checkpoint()
        self.events.write("failure", role=roles[0], roles=roles, reason=reason, step=step, generation=g,
                          standbys=len(self.pool))
        if resume is None:
            self.events.write("failed", reason=f"role(s) {','.join(map(str, roles))} lost, {why}, and no checkpoint "
                                                f"(save_interval={self.cfg.save_interval}, {where})")
            self.exit_code = 1
            return
        self.events.write("fallback", mode="checkpoint-restart", resume_step=resume, reason=why)
        self.ch.put(keys.fault(g), {"fallback": True, "resume_step": resume})
        self._ended(g)
        self._restart_all(resume, roles[0], reason, t_detect, fired)

    def _latest_checkpoint(self) -> Tuple[Optional[int], str]:
        """The step a checkpoint restart resumes from (None: there is none), and where it looked.

        pitstop's own checkpoints when the job saves them (``--save-interval``); otherwise the
        script's, if world rank 0 declared them (Megatron-LM's ``--save``: the workers reload
        it themselves through Megatron-LM's ``--load``). The declaration comes from the network:
        an absolute directory and a bare file name, or it is refused."""
        from pitstop.runtime import checkpoint

        if self.cfg.save_interval:
            d = self.cfg.save_dir or str(self.run_dir / CHECKPOINTS)
            return checkpoint.latest_step(d), f"dir {d}"
        ck = self.ch.read(keys.CHECKPOINT, protocol.CHECKPOINT)
        if ck is None:
            return None, "the script declared no checkpoints of its own"
        d, marker = ck["dir"], ck["marker"]
        if not os.path.isabs(d) or not marker or marker in (".", "..") or "/" in marker or "\0" in d + marker:
            self.ch.refuse(keys.CHECKPOINT, f"checkpoint location {d!r}, marker {marker!r}: expected an absolute "
                                            "directory and a file name")
            return None, "the script's checkpoint declaration was refused"
        try:
            return checkpoint.latest_step(d, marker), f"the script's checkpoints in {d}"
        except PitstopError as exc:
            log.warning("the script's checkpoint marker cannot be used: %s", exc)
            return None, f"the script's checkpoints in {d}: {exc}"

    def _restart_all(self, resume: Optional[int], role: int, reason: str, t_detect: float, fired: Optional[float]) -> None:
        """Stop every worker and start them all again (from checkpoint ``resume``, or from scratch).
        The job's ``epoch`` counts these restarts; past ``--max-restarts`` the job ends instead."""
        g = self.roster.generation if self.roster is not None else self.generation
        if self.epoch >= self.spec.max_restarts:
            self.events.write("failed", reason=f"{reason}; not restarted: {self.epoch} restart(s) already "
                                               f"(--max-restarts {self.spec.max_restarts}), the cause repeats")
            log.error("giving up: %s (%d restarts, --max-restarts %d)", reason, self.epoch, self.spec.max_restarts)
            self.exit_code = 1
            return
        if resume is None:
            self.events.write("restart", mode="from-scratch", reason=f"role {role} lost before the first step"
                              if role >= 0 else reason)
        placement: Dict[int, int] = {}
        if self.spec.agents_apart:
            placement, taken, why = self._restart_placement()
            if why:
                self.events.write("failed", reason=f"{reason}; the restart needs {self._training_machines()} "
                                                   f"machines: {why}")
                self.exit_code = 1
                return
            for s in taken:  # a standby machine becomes a training machine: its standbys make room
                self.pool.remove(s)
                self.stopping.add(self.members[s].proc.name)
                self.agent.kill(self.members[s].proc)
                del self.members[s]
        # every process but the idle standbys: workers, joiners that took a role, a drain's joiner
        doomed = [m.proc for s, m in self.members.items() if s not in self.pool and m.proc is not None and m.proc.running]
        doomed += [e["proc"] for e in self.expected.values() if not e["standby"] and e["proc"].running]
        for p in doomed:
            self.agent.kill(p)
        deadline = time.monotonic() + 30
        while any(p.running for p in doomed) and time.monotonic() < deadline:
            self.agent.poll()
            time.sleep(0.01)
        for s in [s for s in self.members if s not in self.pool]:
            del self.members[s]
        for s in [s for s, e in self.expected.items() if not e["standby"]]:
            del self.expected[s]
        self.leavers.clear()
        self.role_slots.clear()
        self.finished.clear()
        self.epoch += 1
        self.generation = g + 1
        self.roster = None
        self.store.delete_key(keys.COMMITTED)
        self.committed = None
        for r in range(self.spec.world_size):
            self._start_worker(r, {ENV_RESUME: str(resume), "PITSTOP_FAULT": ""} if resume is not None else {"PITSTOP_FAULT": ""},
                               placement.get(r // self.spec.nproc_per_node))
        self.pending.append({"kind": "restart", "generation": g + 1, "step": (resume or 0) + 1, "fired": fired,
                             "detected": t_detect, "planned": time.time(), "reason": reason, "role": role})

    def _training_machines(self) -> int:
        return self.spec.world_size // self.spec.nproc_per_node

    def _restart_placement(self) -> tuple:
        """Where a full restart runs each training machine's ranks: ``({logical machine: machine},
        standby slots to stop, why not)``.

        A logical machine ``L`` holds ranks ``L*nproc .. L*nproc+nproc-1``. It stays on the live
        machine that holds all of its roles now (the standby machine that took them over, say),
        else on machine ``L`` if that is alive, else it moves to a live standby machine whose idle
        standbys are stopped to free its devices. With too few live machines, nothing starts."""
        nproc, alive = self.spec.nproc_per_node, (lambda k: not self.agent.nodes[k].lost)
        out: Dict[int, int] = {}
        for L in range(self._training_machines()):
            where = {self.members[self.role_slots[r]].node for r in range(L * nproc, (L + 1) * nproc)
                     if r in self.role_slots and self.role_slots[r] in self.members}
            if len(where) == 1 and alive(k := where.pop()) and k not in out.values():
                out[L] = k
        for L in range(self._training_machines()):
            if L not in out and alive(L) and L not in out.values():
                out[L] = L
        spares = [k for k in range(self.spec.nodes.max) if alive(k) and k not in out.values()]
        lost = sorted(k for k in range(self.spec.nodes.max) if not alive(k))
        taken: List[int] = []
        for L in range(self._training_machines()):
            if L in out:
                continue
            if not spares:
                return out, [], (f"machine(s) {lost} are lost and no standby machine is left "
                                 f"({self.spec.nodes.max - len(lost)} of {self.spec.nodes.max} alive)")
            out[L] = k = spares.pop(0)
            taken += [s for s in self.pool if self.members[s].node == k]
        return out, taken, None
