"""A machine's agent speaks for its ranks (pitstop.launch.hub and pitstop.runtime.local): real
Unix sockets, a real TCPStore, several "machines" (hubs) in one process, ranks as threads.

What could go wrong and is checked: the vote settles exactly when every rank of the job
arrived, with one `add` per machine per step (counted on the store); a rank that dies
before arriving does not stall its machine's batch; a late rank (a joiner) is added on its
own; a rank that stops beating is reported hung; junk and a hello without the token are
refused by name and do not disturb the others; a verdict the agent relays is only
believed when its seal opens."""

from __future__ import annotations

import base64
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pitstop import protocol
from pitstop.launch.hub import LocalHub
from pitstop.pg.fence import Fence
from pitstop.protocol import Channel, Verdict
from pitstop.runtime import keys
from pitstop.runtime.local import LocalLink, LocalVote, address

TOKEN = "t" * 64


class Counting:
    """Counts a real store client's operations (a unit test's proxy: never handed to c10d)."""

    def __init__(self, inner, counts, lock):
        self.inner, self.counts, self.lock = inner, counts, lock

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("add", "get", "set", "check", "wait", "compare_set", "multi_get"):
            return attr

        def f(*a, **kw):
            with self.lock:
                self.counts[name] = self.counts.get(name, 0) + 1
            return attr(*a, **kw)

        return f


@pytest.fixture
def server():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield s


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def _hubs(server, n, counts, hung=None, poison=None):
    lock = threading.Lock()
    hubs = []
    for k in range(n):
        hubs.append(LocalHub(LocalHub.new_name(k), TOKEN, lambda: Counting(_client(server), counts, lock), 5.0,
                             on_hung=(hung or (lambda s, t: None)), on_poison=(poison or (lambda g, s: None)),
                             blocking_get=True).start())
    return hubs


def _ranks(hubs, per, server):
    out = []
    for k, hub in enumerate(hubs):
        for i in range(per):
            rank = k * per + i
            link = LocalLink(hub.name, 100 + rank, rank, 0, TOKEN)
            st = _client(server)
            out.append((rank, link, LocalVote(Channel(st, TOKEN), st, len(hubs) * per, Fence(), 20.0, link)))
    return out


def _vote_all(ranks, gen, step, skip=()):
    got = {}

    def one(rank, vote):
        got[rank] = vote(gen, step, rank, False)

    ts = [threading.Thread(target=one, args=(r, v)) for r, _, v in ranks if r not in skip]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return got


def test_every_rank_gets_ok_with_one_add_per_machine_and_step(server):
    counts = {}
    hubs = _hubs(server, 3, counts)
    ranks = _ranks(hubs, 4, server)
    try:
        for step in (1, 2, 3):
            got = _vote_all(ranks, 0, step)
            assert got == {r: Verdict.OK for r in range(12)}, got
        # 3 machines x 3 steps: one add each, one blocking get for all but the job's last machine
        assert counts["add"] == 9, counts
        assert counts.get("get", 0) <= 3 * 2 + 3, counts
        ch = Channel(_client(server), TOKEN)
        assert ch.read(keys.COMMITTED, protocol.COMMITTED)["step"] == 3
    finally:
        for r in ranks:
            r[1].close()
        for h in hubs:
            h.close()


def test_a_rank_that_dies_before_arriving_does_not_stall_its_machine(server):
    """Its machine's others are added without it; the job's slot, settled by the controller
    (here: by hand, as Controller._resolve_step does), reaches every survivor."""
    counts = {}
    hubs = _hubs(server, 2, counts)
    ranks = _ranks(hubs, 3, server)
    try:
        ranks[4][1].close()  # rank 4 (machine 1) dies
        out = {}
        t = threading.Thread(target=lambda: out.update(_vote_all(ranks, 0, 1, skip=(4,))))
        t.start()
        ch = Channel(_client(server), TOKEN)
        deadline = time.monotonic() + 10
        arrived = ch.private(keys.arrive(0, 1))
        while time.monotonic() < deadline:  # both machines added what they had: 3 + 2
            if ch.store.check([arrived]) and int(ch.store.get(arrived)) == 5:
                break
            time.sleep(0.02)
        assert int(ch.store.get(arrived)) == 5
        fault = Verdict.fault({"roles": [4], "generation": 1})
        assert ch.vote(keys.verdict(0, 1), fault) == fault
        t.join(20)
        assert out == {r: fault for r in (0, 1, 2, 3, 5)}, out
    finally:
        for r in ranks:
            r[1].close()
        for h in hubs:
            h.close()


def test_a_late_joiner_is_added_on_its_own_and_a_silent_rank_is_reported_hung(server):
    counts, hung = {}, []
    hubs = _hubs(server, 2, counts, hung=lambda slot, silent: hung.append((slot, silent)))
    hubs[1].timeout_s = 0.5
    ranks = _ranks(hubs, 2, server)
    try:
        # a standby on machine 1 takes role 3's place: it says its role late, and arrives late
        ranks[3][1].close()
        sb = LocalLink(hubs[1].name, 200, None, 0, TOKEN)
        st = _client(server)
        sb_vote = LocalVote(Channel(st, TOKEN), st, 4, Fence(), 20.0, sb)
        out = {}
        t = threading.Thread(target=lambda: out.update(_vote_all(ranks, 1, 7, skip=(3,))))
        t.start()
        time.sleep(0.5)
        sb.send("role 3 1")
        out[3] = sb_vote(1, 7, 3, False)
        t.join(20)
        assert out == {r: Verdict.OK for r in range(4)}, out
        # machine 1's ranks beat once, then fall silent: after its 0.5 s timeout both are reported
        # (before a first beat a rank is still being admitted: FIRST_BEAT_S bounds that)
        ranks[2][1].send("beat 1")
        sb.send("beat 1")
        deadline = time.monotonic() + 5
        while len({s for s, _ in hung}) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {s for s, _ in hung} == {102, 200}, hung
        sb.close()
    finally:
        for r in ranks:
            r[1].close()
        for h in hubs:
            h.close()


def test_junk_and_an_unproven_hello_are_refused_and_change_nothing(server):
    counts = {}
    hubs = _hubs(server, 1, counts)
    ranks = _ranks(hubs, 2, server)
    try:
        # a hello sealed with another token
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address(hubs[0].name))
        nonce = s.recv(100).split()[1]
        s.sendall(b"hello 7 - 0 " + protocol.seal_raw(b"x" * 64, "local/7", nonce) + b"\n")
        assert s.recv(200).startswith(b"refused its hello does not prove the job token")
        s.close()
        # junk from a verified rank: refused, the line stays up
        for junk in ("arrive x y now 2", "beat", "role -1 0", "arrive 0 1 sideways 2", "\x00\xff" * 10):
            assert ranks[0][1].send(junk)
        # a rank that claims a slot with a line already
        with pytest.raises(Exception, match="has a line already"):
            LocalLink(hubs[0].name, 100, 0, 0, TOKEN)
        time.sleep(0.3)
        assert hubs[0].refused >= 6
        got = _vote_all(ranks, 0, 1)
        assert got == {0: Verdict.OK, 1: Verdict.OK}
    finally:
        for r in ranks:
            r[1].close()
        for h in hubs:
            h.close()


def test_a_relayed_verdict_is_believed_only_when_its_seal_opens(server):
    """A process squatting the agent's socket can delay a verdict, not forge one."""
    name = LocalHub.new_name(9)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(address(name))
    srv.listen(1)

    def fake_agent():
        c, _ = srv.accept()
        c.sendall(b"nonce abc\n")
        c.recv(1000)
        c.sendall(b"ok\n")
        c.recv(1000)  # the arrival
        forged = protocol.seal(b"y" * 64, "whatever", {"verdict": "ok"})
        c.sendall(b"verdict 0 1 " + base64.b64encode(forged) + b"\n")
        time.sleep(1)
        c.close()

    t = threading.Thread(target=fake_agent)
    t.start()
    link = LocalLink(name, 5, 0, 0, TOKEN)
    st = _client(server)
    got = LocalVote(Channel(st, TOKEN), st, 2, Fence(), 5.0, link)(0, 1, 0, False)
    assert Verdict.is_poisoned(got) and "does not verify" in got, got
    t.join()
    link.close()
    srv.close()


def test_the_end_of_a_generation_reaches_each_role_through_one_wait_per_machine(server):
    """The controller writes ended(g): each machine's agent waits on it once and tells its ranks
    that play a role in g (not a standby), whatever their number; junk under the key is refused
    and tells nobody; a rank that hears nothing else holds no store wait of its own."""
    counts: dict = {}
    hubs = _hubs(server, 2, counts)
    got: dict = {}
    lock = threading.Lock()

    def heard(rank):
        def f(g):
            with lock:
                got.setdefault(rank, []).append(g)
        return f

    links = []
    for k, hub in enumerate(hubs):
        for i in range(3):
            rank = k * 3 + i
            link = LocalLink(hub.name, 100 + rank, rank, 0, TOKEN)
            link.on_ended(heard(rank))
            links.append(link)
    standby = LocalLink(hubs[1].name, 200, None, 0, TOKEN)
    standby.on_ended(heard("standby"))
    ctl = Channel(_client(server), TOKEN)
    time.sleep(0.5)
    assert got == {}
    waits_before = counts.get("wait", 0)
    assert waits_before <= len(hubs), counts  # one wait per machine, none per rank

    ctl.put(keys.ended(0), {"time": time.time()})

    def told(want):
        deadline = time.monotonic() + 10
        while got != want and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert got == want, got

    told({r: [0] for r in range(6)})
    # each machine waited on ended(0) and now waits on ended(1): two waits and one read each
    assert counts.get("wait", 0) <= 2 * len(hubs) and counts.get("get", 0) <= len(hubs), counts

    ctl.store.set(keys.ended(1), b"junk")  # not sealed: refused by name, nobody is told
    time.sleep(0.5)
    assert got == {r: [0] for r in range(6)}, got
    ctl.put(keys.ended(1), {"time": time.time()})
    told({r: [0, 1] for r in range(6)})
    for link in links + [standby]:
        link.close()
    for hub in hubs:
        hub.close()


def test_one_reader_thread_serves_many_links_as_their_own_threads_would(server):
    """The scale harness's ranks share one reader thread (LineReader): every verdict and every
    "ended" line reaches the link it was sent to, no link starts a thread of its own, a link
    closed by its rank is unregistered and its socket closed by the reader, and a line past
    MAX_LINE closes only its own link."""
    from pitstop.runtime.local import MAX_LINE, LineReader

    counts: dict = {}
    hubs = _hubs(server, 2, counts)
    reader = LineReader()
    before = threading.active_count()
    heard: dict = {}
    lock = threading.Lock()
    ranks = []
    for k, hub in enumerate(hubs):
        for i in range(4):
            rank = k * 4 + i
            link = LocalLink(hub.name, 100 + rank, rank, 0, TOKEN, reader=reader)
            link.on_ended(lambda g, rank=rank: (lock.acquire(), heard.setdefault(rank, []).append(g), lock.release()))
            st = _client(server)
            ranks.append((rank, link, LocalVote(Channel(st, TOKEN), st, 8, Fence(), 20.0, link)))
    try:
        assert threading.active_count() == before  # no reader thread per link
        for step in (1, 2):
            got = _vote_all(ranks, 0, step)
            assert got == {r: Verdict.OK for r in range(8)}, got
        Channel(_client(server), TOKEN).put(keys.ended(0), {"time": time.time()})
        deadline = time.monotonic() + 10
        while len(heard) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert heard == {r: [0] for r in range(8)}, heard
        # a rank's close: the reader sees the end, unregisters the socket and closes it
        victim = ranks[0][1]
        victim.close()
        deadline = time.monotonic() + 5
        while victim.sock.fileno() >= 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert victim.closed and victim.sock.fileno() < 0
        # a line that outgrows MAX_LINE from the agent's side closes that link only
        other = ranks[1][1]
        hub_end = next(c.sock for c in hubs[0].conns.values() if c.slot == 101)
        hub_end.sendall(b"x" * (MAX_LINE + 10))
        deadline = time.monotonic() + 5
        while not other.closed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert other.closed
        assert not any(link.closed for _, link, _ in ranks[2:])
        # the others still hear their agent (ranks 0 and 1 are gone: their machine's end-of-generation
        # line goes to its 2 others)
        Channel(_client(server), TOKEN).put(keys.ended(1), {"time": time.time()})
        deadline = time.monotonic() + 10
        while any(len(heard.get(r, [])) < 2 for r in range(2, 8)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert {r: heard[r] for r in range(2, 8)} == {r: [0, 1] for r in range(2, 8)}, heard
        assert heard[0] == [0] and heard[1] == [0], heard
    finally:
        for r in ranks:
            r[1].close()
        for h in hubs:
            h.close()
