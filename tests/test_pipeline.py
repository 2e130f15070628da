"""The asynchronous commit's thread (:mod:`pitstop.runtime.pipeline`), alone: its vote is a real
:class:`~pitstop.runtime.vote.Vote` on a real TCPStore (one rank, so it settles at once) and the
optimizer a real torch one. The ring is a stand-in whose pack the test holds, which is the point:
``optimizer.step`` must not run while the last boundary's shard is not packed yet."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pitstop.pg.fence import Fence
from pitstop.protocol import Channel, Verdict
from pitstop.runtime import state
from pitstop.runtime.pipeline import Flight, Pipeline
from pitstop.runtime.vote import Vote
from pitstop.store import host_store

pytestmark = pytest.mark.timeout(60)

TOKEN = "t" * 64


class HeldRing:
    """Packs only when the test lets it; records what the shard held when it packed."""

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param
        self.go = threading.Event()
        self.fail: BaseException | None = None
        self.packed_value: float | None = None

    def pack(self, cap: state.Capture):
        if not self.go.wait(10):
            raise AssertionError("the test never let the pack run")
        if self.fail is not None:
            raise self.fail
        self.packed_value = float(self.param[0])
        return ("snapshot of step", cap.step)


def _pipeline(ring) -> Pipeline:
    st = host_store("127.0.0.1", 0, timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", st.port, is_master=False, timeout=timedelta(seconds=10))
    pipe = Pipeline(ring, Vote(Channel(client, TOKEN), client, 1, Fence(), timeout_s=10.0), 0, exchange=False)
    pipe.server = st  # the store's server lives as long as the test's pipeline
    return pipe


def _flight(step: int) -> Flight:
    return Flight(step, 0, [(step, f"loss {step}")], 1, state.Capture(step, 0, {}), False, "ahead")


def test_the_optimizer_step_waits_until_the_last_boundary_is_packed_then_the_vote_lands():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.5)
    p.grad = torch.ones(4)
    ring = HeldRing(p)
    pipe = _pipeline(ring)
    pipe.hold_step([(opt, "step")])
    pipe.launch(_flight(7))
    stepped = threading.Thread(target=opt.step)
    stepped.start()
    stepped.join(0.3)
    assert stepped.is_alive() and float(p[0]) == 1.0  # held: the shard is not packed yet
    with pytest.raises(RuntimeError, match="step 8 launched while step 7 is in flight"):
        pipe.launch(_flight(8))
    ring.go.set()
    stepped.join(10)
    assert not stepped.is_alive() and float(p[0]) == 0.5
    assert ring.packed_value == 1.0  # the pack saw the state of the boundary, not the next step's
    f = pipe.land()
    assert f.verdict == Verdict.OK and f.snap == ("snapshot of step", 7) and f.window == [(7, "loss 7")]
    assert pipe.flight is None and pipe.step_wait_s >= 0.25 and f.cpu_s >= 0.0
    opt.step()  # nothing in flight: not held
    assert float(p[0]) == 0.0


def test_a_failed_pack_releases_the_optimizer_and_raises_at_landing():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.ones(2)
    ring = HeldRing(p)
    ring.fail = MemoryError("no room for the rollback point (1.26 MB)")
    ring.go.set()
    pipe = _pipeline(ring)
    pipe.hold_step([(opt, "step")])
    pipe.launch(_flight(3))
    t0 = time.monotonic()
    opt.step()  # released even though the pack failed
    assert time.monotonic() - t0 < 5
    with pytest.raises(MemoryError, match="1.26 MB"):
        pipe.land()
    assert pipe.flight is None


def test_a_deferred_vote_waits_for_the_next_step_and_the_optimizer_releases_it():
    """The boundary defers its vote until the loop asks for the next step (the script has then
    logged what the boundary handed back); an optimizer step, or the landing, releases it too."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.ones(2)
    ring = HeldRing(p)
    ring.go.set()
    pipe = _pipeline(ring)
    pipe.hold_step([(opt, "step")])
    f = pipe.defer(_flight(5))
    time.sleep(0.2)
    assert pipe.flight is None and not f.packed.is_set() and ring.packed_value is None  # not launched
    with pytest.raises(RuntimeError, match="step 6 deferred while a flight is pending"):
        pipe.defer(_flight(6))
    opt.step()  # releases, then waits for the pack: the pack saw the boundary's state
    assert ring.packed_value == 1.0 and float(p[0]) == 0.0
    assert pipe.land().verdict == Verdict.OK and pipe.deferred is None and pipe.flight is None
    pipe.defer(_flight(6))
    assert pipe.land().step == 6  # landing a deferred flight launches it first
