"""One spare store connection, shared by concurrent rendezvous through polling views.

A c10d client holds its lock for the whole of a blocking wait, so two threads on one
raw client cannot wait for each other; the polling views of one connection can. Real
TCPStore, real threads.
"""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pitstop.store import PollingStore, SharedConnection


@pytest.fixture
def server():
    s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield s


def _client(server) -> dist.Store:
    return dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))


@pytest.mark.timeout(60)
def test_threads_wait_for_each_other_over_one_shared_connection(server):
    shared = SharedConnection(_client(server))
    n = 6
    views = shared.lend(n)
    assert shared.opened == 1 and len({id(v) for v in views}) == n
    got, errors = {}, []

    def ring(i: int) -> None:  # each waits for the key its neighbour writes after a delay
        try:
            time.sleep(0.05 * i)
            views[i].set(f"k{i}", f"v{i}")
            got[i] = views[i].get(f"k{(i + 1) % n}")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    t0 = time.monotonic()
    threads = [threading.Thread(target=ring, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    elapsed = time.monotonic() - t0
    assert not errors, errors
    assert got == {i: f"v{(i + 1) % n}".encode() for i in range(n)}
    assert elapsed < 2.0, elapsed  # the last key is written at 0.25 s; a blocked client would wait 30 s
    assert shared.opened == 1  # the views opened nothing


@pytest.mark.timeout(60)
def test_a_raw_client_shared_by_two_threads_blocks_which_is_why_views_poll(server):
    """The premise: the second thread's set waits behind the first thread's blocking get."""
    raw = _client(server)
    raw.set_timeout(timedelta(seconds=1))
    out = {}

    def waiter() -> None:
        try:
            raw.get("late")
            out["waiter"] = "got"
        except dist.DistStoreError:
            out["waiter"] = "timed out"

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    raw.set("late", "x")  # queued behind the get: only runs once the get has timed out
    out["set_s"] = time.monotonic() - t0
    t.join(10)
    assert out["waiter"] == "timed out" and out["set_s"] > 0.5, out


@pytest.mark.timeout(60)
def test_a_view_times_out_by_its_own_timeout_naming_the_keys(server):
    shared = SharedConnection(_client(server))
    view = shared.take()
    view.set_timeout(timedelta(seconds=0.3))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"after 0.3s waiting for keys \['never'\]"):
        view.get("never")
    assert 0.25 < time.monotonic() - t0 < 2.0
    with pytest.raises(dist.DistStoreError, match="never2"):
        view.wait(["never2"], timedelta(seconds=0.2))
    other = shared.take()
    assert other.inner is view.inner and other.timeout == timedelta(seconds=30)  # the shared client's stays


@pytest.mark.timeout(60)
def test_prefixed_pool_shares_the_same_connection_behind_the_prefix(server):
    base = SharedConnection(_client(server))
    assert base.reserve(3) == 1 and base.reserve(3) == 0 and base.opened == 1
    pool = base.prefixed("pitstop/world")
    view = pool.take()
    assert isinstance(view, PollingStore) and pool.opened == 1
    view.set("a", "1")
    assert server.get("pitstop/world/a") == b"1"
    pool.store.set("b", "2")
    assert view.get("b") == b"2"
    with pytest.raises(Exception, match="reserve"):
        pool.reserve(-1)
