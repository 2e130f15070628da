"""pitstop.etcd_store against a real etcd: TCPStore's semantics, and gloo groups over it."""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pitstop.etcd_store import EtcdStore
from pitstop.store import connect, etcd_spec, parse_spec

pytestmark = pytest.mark.timeout(120)


def _store(endpoint: str, timeout_s: float = 10.0) -> EtcdStore:
    return connect(etcd_spec(endpoint, uuid.uuid4().hex[:12]), timeout=timedelta(seconds=timeout_s))


def test_set_get_check_delete_and_count(etcd_endpoint):
    st = _store(etcd_endpoint)
    assert not st.check(["a"])
    st.set("a", b"\x00\xffbin")
    st.set("b", "text")
    assert st.get("a") == b"\x00\xffbin" and st.get("b") == b"text"
    assert st.check(["a", "b"]) and not st.check(["a", "c"])
    assert st.num_keys() == 2
    assert st.delete_key("a") and not st.delete_key("a")
    assert st.num_keys() == 1
    other = _store(etcd_endpoint)  # another job's prefix sees none of it
    assert other.num_keys() == 0 and not other.check(["b"])


def test_add_is_atomic_under_contention(etcd_endpoint):
    st = _store(etcd_endpoint)
    assert st.add("n", 0) == 0
    results = []

    def bump(s):
        for _ in range(10):
            results.append(s.add("n", 1))

    threads = [threading.Thread(target=bump, args=(st.clone(),)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(1, 61))  # every increment seen exactly once
    assert st.add("n", -5) == 55 and st.get("n") == b"55"


def test_compare_set_follows_tcpstore(etcd_endpoint):
    st = _store(etcd_endpoint)
    assert st.compare_set("v", "", "first") == b"first"            # absent + empty expected: set
    assert st.compare_set("v", "", "second") == b"first"           # present: the current value
    assert st.compare_set("v", "first", "third") == b"third"       # matches: set
    assert st.compare_set("v", "nope", "x") == b"third"
    assert st.compare_set("missing", "old", "x") == b"old"         # absent + expected: TCPStore returns expected
    assert not st.check(["missing"])


def test_get_and_wait_block_until_written_and_time_out(etcd_endpoint):
    st = _store(etcd_endpoint, timeout_s=1.0)
    writer = st.clone()
    threading.Timer(0.3, lambda: writer.set("late", b"here")).start()
    t0 = time.monotonic()
    assert st.get("late") == b"here"
    assert 0.2 < time.monotonic() - t0 < 5
    threading.Timer(0.2, lambda: writer.set("w2", b"1")).start()
    st.wait(["late", "w2"], timedelta(seconds=5))
    with pytest.raises(dist.DistStoreError, match="timed out waiting for key .never."):
        st.wait(["never"])
    with pytest.raises(dist.DistStoreError):
        st.get("never")


def test_unreachable_etcd_raises_runtime_error():
    st = EtcdStore("127.0.0.1", 9, "/pitstop/x/", timeout=timedelta(seconds=1), request_timeout_s=1.0)
    with pytest.raises(RuntimeError, match="did not answer"):
        st.set("a", b"1")
    assert not st.reachable()


def test_spec_parsing_names_the_bad_value():
    assert parse_spec("etcd://10.0.0.1:2379/pitstop/j1") == ("etcd", "10.0.0.1", 2379, "/pitstop/j1/")
    assert parse_spec("127.0.0.1:5") == ("tcp", "127.0.0.1", 5, "")
    from pitstop.errors import PitstopError

    with pytest.raises(PitstopError, match="etcd://HOST:PORT/PREFIX/"):
        parse_spec("etcd://host:2379")
    with pytest.raises(PitstopError, match="127.0.0.1:0.*1..65535"):
        etcd_spec("127.0.0.1:0", "job")


def _gloo_rank(rank: int, spec: str, out) -> None:
    st = connect(spec, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("world", st), rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    sub = dist.new_group([0, 1])
    u = torch.tensor([float(10 * (rank + 1))])
    dist.all_reduce(u, group=sub)
    out.put((rank, t.item(), u.item()))
    dist.destroy_process_group()


def test_gloo_process_groups_rendezvous_over_etcd(etcd_endpoint):
    spec = etcd_spec(etcd_endpoint, uuid.uuid4().hex[:12])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, spec, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [(0, 3.0, 30.0), (1, 3.0, 30.0)]
    assert all(p.exitcode == 0 for p in procs)


def test_mirrored_reads_follow_other_writers_and_own_writes(etcd_endpoint):
    from pitstop.etcd_store import MirroredEtcdStore

    spec = etcd_spec(etcd_endpoint, uuid.uuid4().hex[:12])
    other = connect(spec, timeout=timedelta(seconds=10))
    other.set("before", b"0")
    m = MirroredEtcdStore(*parse_spec(spec)[1:], timeout=timedelta(seconds=10))
    try:
        assert m.check(["before"]) and m.get("before") == b"0"           # the initial sync
        m.set("mine", b"1")
        assert m.check(["mine"]) and m.get("mine") == b"1"               # own write seen at once
        other.set("theirs", b"2")
        deadline = time.monotonic() + 5
        while not m.check(["theirs"]) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert m.get("theirs") == b"2"                                   # another writer's, through the watch
        other.set("mine", b"3")
        while m.get("mine") != b"3" and time.monotonic() < deadline:
            time.sleep(0.005)
        assert m.get("mine") == b"3"
        other.delete_key("before")
        while m.check(["before"]) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not m.check(["before"])
        assert m.add("c", 2) == 2 and m.compare_set("v", "", "x") == b"x"  # atomic ops still go to etcd
        threading.Timer(0.2, lambda: other.set("later", b"4")).start()
        assert m.get("later") == b"4"                                    # a miss blocks, as TCPStore's get
    finally:
        m.close()


def test_mirrored_wait_is_woken_by_the_watch_and_times_out(etcd_endpoint):
    from pitstop.etcd_store import MirroredEtcdStore

    spec = etcd_spec(etcd_endpoint, uuid.uuid4().hex[:12])
    other = connect(spec, timeout=timedelta(seconds=10))
    m = MirroredEtcdStore(*parse_spec(spec)[1:], timeout=timedelta(seconds=1))
    try:
        threading.Timer(0.2, lambda: (other.set("a", b"1"), other.set("b", b"2"))).start()
        t0 = time.monotonic()
        m.wait(["a", "b"], timedelta(seconds=10))
        assert 0.15 < time.monotonic() - t0 < 5 and m.get("b") == b"2"
        with pytest.raises(dist.DistStoreError, match="timed out after 1s waiting for key 'c'"):
            m.wait(["a", "c"])
    finally:
        m.close()


def test_adding_zero_reads_without_writing(etcd_endpoint):
    from pitstop.etcd_store import MirroredEtcdStore

    spec = etcd_spec(etcd_endpoint, uuid.uuid4().hex[:12])
    st = connect(spec, timeout=timedelta(seconds=10))
    assert st.add("n", 0) == 0 and not st.check(["n"])            # polling a missing counter creates nothing
    st.add("n", 3)
    rev = st._range("n")[0]["mod_revision"]
    assert st.add("n", 0) == 3 and st._range("n")[0]["mod_revision"] == rev   # no write
    m = MirroredEtcdStore(*parse_spec(spec)[1:], timeout=timedelta(seconds=10))
    try:
        assert m.add("n", 0) == 3 and m.add("n", 2) == 5
    finally:
        m.close()


def test_mirrored_adds_stay_atomic_under_contention(etcd_endpoint):
    """Each mirrored client guesses from its copy; a stale guess must cost a retry, never a lost count."""
    from pitstop.etcd_store import MirroredEtcdStore

    spec = etcd_spec(etcd_endpoint, uuid.uuid4().hex[:12])
    stores = [MirroredEtcdStore(*parse_spec(spec)[1:], timeout=timedelta(seconds=10)) for _ in range(4)]
    results = []
    try:
        def bump(s):
            for _ in range(10):
                results.append(s.add("n", 1))

        threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == list(range(1, 41))
        assert stores[0].add("n", 5) == 45
        stores[1].set("junk", b"x")
        with pytest.raises(ValueError, match="not a counter"):
            stores[1].add("junk", 1)
    finally:
        for s in stores:
            s.close()


@pytest.mark.timeout(60)
def test_rendezvous_on_etcd_get_clients_of_their_own_not_polling_views(etcd_endpoint):
    """An etcd client has no lock to wait behind and no reverse-DNS stall, and polling it
    would cost an HTTP request per check: each concurrent rendezvous gets a clone of its own.
    Its timeout is what a PrefixStore over it (the world's, a group's) uses for an untimed get."""
    from pitstop.store import PollingStore, SharedConnection

    base = _store(etcd_endpoint, timeout_s=1234.0)
    assert dist.PrefixStore("pitstop/world", base).timeout == timedelta(seconds=1234)
    base.set_timeout(timedelta(seconds=77))
    assert dist.PrefixStore("x", base).timeout == timedelta(seconds=77)
    shared = SharedConnection(base)
    assert shared.polls is False and shared.reserve(1) == 0
    pool = shared.prefixed("pitstop/world")
    views = pool.lend(3)
    assert pool.polls is False and pool.opened == 3
    assert not any(isinstance(v, PollingStore) for v in views) and len({id(v) for v in views}) == 3
    views[0].set("k", "v")
    assert views[2].get("k") == b"v" and base.get("pitstop/world/k") == b"v"
