"""The asynchronous commit: a boundary's vote runs while the next step does.

At ``commit_interval`` 1 a synchronous boundary packs the rollback point, exchanges it with
the data-parallel peer and waits for every rank's vote: about a tenth of a steady step on
this machine (``benchmarks/hook.json``). With ``async_commit`` the boundary only captures
what cannot wait (the RNG streams) and hands the rest to one background thread; it reads
the verdict at the next boundary, before it votes again::

    training thread   step s | capture s | log s-1, launch | step s+1 ..... | land s, capture s+1 | ...
                                      \\            ^ optimizer.step waits until s is packed
    pipeline thread                    pack s | exchange s (ring's own gloo group) | vote s

    land s:  committed  -> s is the rollback point and the buddy copy; commit() returns s
             poisoned   -> roll back to s-1, redo s and s+1 (s+1 ran on garbage anyway)
             switch next-> the drain switches after s+1: every rank votes s+1 at once

Why each piece is safe:

- **The shard is read late.** Between two boundaries only ``optimizer.step`` writes the
  shard (main parameters and moments; the forward and backward write activations and
  gradients). So :meth:`Pipeline.hold_step` wraps the optimizer's ``step`` (and DeepSpeed's)
  to wait until the pack is done. The RNG streams are read at the boundary itself.
- **The exchange has a communicator of its own** (:attr:`pitstop.groups.Entry.ring`): two
  threads issuing operations on one gloo group would pair them differently on each rank.
- **The vote has a store connection of its own**: a c10d client holds its lock for the
  whole of a blocking wait, and the training thread's client serves the step's other calls.
- **The window is the controller's as before**: a rank is at most one boundary past its
  last vote, and reads that vote before it votes again, so the steps a failure can discard
  are still those from the last committed step to the next vote
  (:meth:`~pitstop.runtime.config.RuntimeConfig.discard_window`).

A boundary that must know its own verdict before the loop goes on votes synchronously: the
first step (its record warms the standbys), a checkpoint step, the last step, and the step a
drain switches after. The choice depends on the step alone, so every rank makes the same one:
a rank whose step is poisoned votes so at once (the controller learns early) but runs the next
step too, its broken groups short-circuiting, and rolls back with the others at the next
boundary. Recovering at once would deadlock: its healthy peers, a step ahead, would wait for
it in that step's collectives while it waited for them in the rollback's.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from pitstop.runtime import state
from pitstop.runtime.buddy import BuddyRing
from pitstop.runtime.framework import wrap
from pitstop.runtime.vote import Vote


@dataclass
class Flight:
    """One boundary's vote, in the background."""

    step: int
    gen: int
    window: List[Tuple[int, Any]]
    """The (step, report) pairs this vote makes final: the held steps and its own."""
    nsteps: int
    """The steps this process ran that the vote decides (its window, less a joiner's hand-back)."""
    cap: state.Capture
    poisoned: bool
    mode: str
    redeliver: List[Tuple[int, Any]] = field(default_factory=list)
    """The joiner's hand-back this vote carries: back to the session if the vote is discarded."""
    packed: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    snap: Optional[state.Snapshot] = None
    received: Optional[state.Snapshot] = None
    verdict: Optional[str] = None
    error: Optional[BaseException] = None
    cpu_s: float = 0.0
    """CPU seconds the pipeline thread spent on it (pack, exchange, vote): the work taken off
    the boundary, which still runs on this process's cores."""


class Pipeline:
    """The session's asynchronous commit (see the module docstring). Handed the ring and a
    :class:`Vote` over its own store connection; owns its thread and the flight in the air."""

    def __init__(self, ring: BuddyRing, vote: Vote, rank: int, exchange: bool) -> None:
        self.ring = ring
        self.vote = vote
        self.rank = rank
        self.exchange = exchange
        """Whether the ring exchanges (a buddy and a ring of two or more); else only the vote."""
        self.flight: Optional[Flight] = None
        self.deferred: Optional[Flight] = None
        """A flight made at the boundary, launched when the loop asks for its next step
        (:meth:`release`): only after the script has logged what that boundary handed back can
        this vote commit, or a failure in between would lose those steps' reports (the vote's
        snapshot, which a joiner hands back from, carries only its own window)."""
        self.cpu_s = 0.0
        """CPU seconds of the pipeline thread over every landed flight."""
        self.step_wait_s = 0.0
        """Seconds ``optimizer.step`` waited for a pack (counted into the boundary's cost)."""
        self._q: "queue.Queue[Flight]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="pitstop-commit", daemon=True)
        self._thread.start()

    def launch(self, f: Flight) -> Flight:
        if self.flight is not None:
            raise RuntimeError(f"pipeline: step {f.step} launched while step {self.flight.step} is in flight")
        self.flight = f
        self._q.put(f)
        return f

    def defer(self, f: Flight) -> Flight:
        """Launch ``f`` at :meth:`release` (the next step), not now."""
        if self.flight is not None or self.deferred is not None:
            raise RuntimeError(f"pipeline: step {f.step} deferred while a flight is pending")
        self.deferred = f
        return f

    def release(self) -> None:
        """Launch the deferred flight, if any: the loop asked for its next step, or the optimizer
        is about to step, or the session lands it."""
        f, self.deferred = self.deferred, None
        if f is not None:
            self.launch(f)

    def land(self) -> Flight:
        """Wait for the flight in the air; it is no longer in the air afterwards. Raises what
        its thread raised (a store gone: the caller's controller-lost path)."""
        self.release()
        f = self.flight
        if f is None:
            raise RuntimeError("pipeline: nothing in flight to land")
        f.done.wait()
        self.flight = None
        self.cpu_s += f.cpu_s
        if f.error is not None:
            raise f.error
        return f

    def wait_packed(self) -> None:
        """Before the optimizer steps: the flight's shard must be packed (see the module docstring)."""
        self.release()
        f = self.flight
        if f is not None and not f.packed.is_set():
            t0 = time.perf_counter()
            f.packed.wait()
            self.step_wait_s += time.perf_counter() - t0

    def hold_step(self, targets: List[Tuple[Any, str]]) -> None:
        """Wrap each (object, method) that writes the shard so that it waits for the pack."""
        for obj, name in targets:
            wrap(obj, name, self.wait_packed)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:  # a daemon: it ends with the process
            self._run(self._q.get())

    def _run(self, f: Flight) -> None:
        t_cpu = time.thread_time()
        try:
            try:
                f.snap = self.ring.pack(f.cap)
            finally:
                f.packed.set()
            why = None
            if self.exchange:  # a poisoned rank still takes part: its peers wait for it
                f.received, why = self.ring.exchange_behind(f.snap, f.gen)
            f.verdict = self.vote(f.gen, f.step, self.rank, f.poisoned or why is not None, f.mode, why)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread at landing
            f.error = exc
        finally:
            f.cpu_s = time.thread_time() - t_cpu
            f.done.set()

