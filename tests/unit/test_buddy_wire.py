"""The buddy ring's one-message wire, over a real gloo pair (two ranks as two threads of
this process, sharing a HashStore): agreement, steady exchanges, a header that outgrows its
capacity, a shard that changes size, and the committed copy never overwritten."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pitstop.errors import RecoveryError
from pitstop.runtime.buddy import BuddyWire, capacity
from pitstop.runtime.state import Snapshot

pytestmark = pytest.mark.timeout(120)


def snapshot(step: int, nbytes: int, fill: int, rng: str = "r") -> Snapshot:
    data = torch.full((nbytes,), fill % 256, dtype=torch.uint8)
    return Snapshot(step, [("p", (nbytes,), "uint8", None)], data, rng.encode(), world_seq=step)


def pair():
    store = dist.HashStore()
    pgs = [None, None]

    def make(r):
        pgs[r] = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=60))

    ts = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return pgs


def exchange_both(pgs, wires, snaps, gen: int):
    """Both ranks exchange at once (each sends to the other: a ring of two)."""
    got, errors = [None, None], []

    def one(r):
        pg, peer = pgs[r], 1 - r

        def sendrecv(out, inp):
            ws = [pg.send([out], peer, 0), pg.recv([inp], peer, 0)]
            for w in ws:
                w.wait()

        try:
            got[r] = wires[r].exchange(snaps[r], gen, sendrecv, lambda out: pg.send([out], peer, 0),
                                       lambda inp: pg.recv([inp], peer, 0), lambda: False)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    ts = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert not errors, errors
    return got


def same(a: Snapshot, b: Snapshot) -> bool:
    return (a.step, a.layout, a.rng, a.world_seq) == (b.step, b.layout, b.rng, b.world_seq) and torch.equal(a.data, b.data)


def test_steady_exchanges_growth_and_the_committed_copy_survive():
    pgs, wires = pair(), [BuddyWire(), BuddyWire()]
    s = [snapshot(1, 1000, 1), snapshot(1, 1000, 2)]
    got = exchange_both(pgs, wires, s, gen=0)  # the agreement round, then the message
    assert same(got[0], s[1]) and same(got[1], s[0])
    assert wires[0].cap == capacity(len(s[0].meta_bytes())) and wires[0].peer_nbytes == 1000
    [w.keep() for w in wires]
    kept = got[0].data.clone()

    # steady: the next copy lands in the other buffer; the committed one is untouched
    s = [snapshot(2, 1000, 3), snapshot(2, 1000, 4)]
    got2 = exchange_both(pgs, wires, s, gen=0)
    assert same(got2[0], s[1]) and same(got2[1], s[0])
    assert torch.equal(got[0].data, kept), "the exchange overwrote the committed buddy copy"
    # not kept (the step was discarded): the next exchange reuses that buffer, still not the committed one
    s = [snapshot(3, 1000, 5), snapshot(3, 1000, 6)]
    got3 = exchange_both(pgs, wires, s, gen=0)
    assert same(got3[0], s[1]) and torch.equal(got[0].data, kept)

    # rank 0's header outgrows its capacity and its shard changes size; rank 1 stays as it was
    big = "x" * (wires[0].cap + 10_000)
    s = [snapshot(4, 1500, 7, rng=big), snapshot(4, 1000, 8)]
    got4 = exchange_both(pgs, wires, s, gen=0)
    assert same(got4[1], s[0]) and same(got4[0], s[1])
    assert wires[0].cap >= len(s[0].meta_bytes()) and wires[1].peer_cap == wires[0].cap
    assert wires[1].peer_nbytes == 1500
    # and the new layout holds for the next round
    s = [snapshot(5, 1500, 9, rng=big), snapshot(5, 1000, 10)]
    got5 = exchange_both(pgs, wires, s, gen=0)
    assert same(got5[1], s[0]) and same(got5[0], s[1])
    # a new generation agrees again (a new ring)
    s = [snapshot(6, 10, 11), snapshot(6, 20, 12)]
    got6 = exchange_both(pgs, wires, s, gen=1)
    assert same(got6[1], s[0]) and same(got6[0], s[1]) and wires[0].peer_nbytes == 20


def test_a_message_that_does_not_describe_itself_is_refused_by_name():
    w = BuddyWire()
    junk = torch.tensor([-5, 0], dtype=torch.int64)

    def sendrecv(out, inp):
        inp.copy_(junk)

    with pytest.raises(RecoveryError, match="agreed sizes header -5"):
        w.exchange(snapshot(1, 10, 1), 0, sendrecv, None, None, lambda: False)
    # a poisoned step's buffers are never parsed
    assert w.exchange(snapshot(1, 10, 1), 0, sendrecv, None, None, lambda: True) is None and w.gen is None
