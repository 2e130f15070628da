"""The vote at an iteration boundary: did every rank finish the step on healthy groups?

::

    each rank:   poisoned?  --yes-->  settle the slot "poisoned r<rank>: <why>"
                    | no
                 arrive (a private counter) --the last of world_size--> settle "ok" or "switch"
                    |                                                   (and publish `committed`)
                 wait for the slot, read it back, verify its seal

Its ``mode`` says what a ready drain makes of the verdict. ``"now"``: the boundary waits for
the vote, so ``switch`` (the drain switches after this step). ``"ahead"``: an asynchronous vote
(:mod:`pitstop.runtime.pipeline`), read only at the next boundary, after one more step ran:
``switch next``, and every rank votes that next step in ``"switch"`` mode, at once, which
settles ``switch`` whatever the flag says (the drain was ready a step ago).

The slot is a compare-and-set key holding a sealed verdict, so the first settler wins and
nobody can forge one without the job's token: a poisoned rank, the last arriver, or the
controller (which settles a dead rank's step poisoned). The vote is handed its channel, its
store and the fence; it holds no state between steps.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from pitstop import pg as pgmod
from pitstop import protocol
from pitstop.protocol import Verdict
from pitstop.runtime import keys


class Vote:
    """One rank's side of the per-step verdict (see the module docstring)."""

    def __init__(self, ch: protocol.Channel, store: dist.Store, world_size: int, fence: pgmod.Fence,
                 timeout_s: float) -> None:
        self.ch = ch
        self.store = store
        self.world_size = world_size
        self.fence = fence
        self.timeout_s = timeout_s
        """How long a rank waits for the slot to be settled: twice the collective timeout, so the
        controller has settled a dead rank's step long before."""

    def why(self) -> str:
        """The fence's first error, or the groups it marked broken."""
        return self.fence.errors[0] if self.fence.errors else f"groups marked broken: {sorted(self.fence.broken)}"

    def tell_poisoned(self, gen: int, step: int, rank: int) -> None:
        """Settle ``step``'s slot poisoned now (a rank between votes tells the controller at once)."""
        self.ch.vote(keys.verdict(gen, step), Verdict.poisoned(rank, self.why()))

    MODES = ("now", "ahead", "switch")

    def __call__(self, gen: int, step: int, rank: int, poisoned: bool, mode: str = "now",
                 why: Optional[str] = None) -> str:
        """Vote on ``step`` of generation ``gen``; return the settled verdict. ``why``: the reason
        of a poisoned vote when it is not the fence's (a failed buddy exchange)."""
        if mode not in self.MODES:
            raise ValueError(f"vote mode {mode!r}: expected one of {', '.join(self.MODES)}")
        ch, vk = self.ch, keys.verdict(gen, step)
        if poisoned:
            ch.vote(vk, Verdict.poisoned(rank, why or self.why()))
        elif ch.add(keys.arrive(gen, step), 1) == self.world_size:
            return settle_last(ch, gen, step, mode)  # settled: no need to wait for the slot or read it again
        self.store.wait([ch.private(vk)], timedelta(seconds=self.timeout_s))
        got = ch.settled(vk, present=True)
        return got if got is not None else Verdict.poisoned(None, "the verdict does not verify")


def settle_last(ch: protocol.Channel, gen: int, step: int, mode: str) -> str:
    """The job's last arrival at ``step`` settles its slot: ``ok``, or a switch when a drain is
    ready (see the module docstring for ``mode``), and publishes the commit; returns the verdict
    that holds (a poisoned rank or the controller may have settled it first). Called by the last
    rank (:class:`Vote`) or by the agent that added the last machine's arrivals
    (:mod:`pitstop.launch.hub`)."""
    if mode == "switch":
        want = Verdict.SWITCH
    elif ch.read(keys.drain_ready(gen), protocol.FLAG) is None:
        want = Verdict.OK
    else:
        want = Verdict.SWITCH_NEXT if mode == "ahead" else Verdict.SWITCH
    got = ch.vote(keys.verdict(gen, step), want)
    if got == want:
        now = time.time()
        ch.put(keys.COMMITTED, {"generation": gen, "step": step, "time": now}, own=False)
        if want == Verdict.SWITCH:
            ch.put(keys.drain_switch(gen), {"step": step, "time": now})
    return got
