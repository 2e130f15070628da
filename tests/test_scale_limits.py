"""Tier 1/2: messages sized for 8,192 ranks (pitstop.limits, Channel.put_big / read_big).

A Roster of 8,192 roles with realistic host names is over pitstop's 256 KiB message limit, so
it is written in sealed chunks under a sealed manifest: checked here through a real TCPStore
(and a real etcd where one is installed), each fault refused by name, and a rewrite never read
as a mix of two versions."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pitstop import limits, protocol
from pitstop.protocol import Channel, big_chunk_key
from pitstop.roster import ProcessInfo, Roster

pytestmark = pytest.mark.timeout(180)

TOKEN = "t" * 64
KEY = "ctl/roster"
VALUE_MAX = protocol.BIG_CHUNK_BYTES + protocol.RAW_ENVELOPE


def _roster(roles=8192, hosts=1024, standbys=64, generation=7, host_fmt="gpu-node-{:04d}.cluster.example.com"):
    per = roles // hosts
    r = tuple(ProcessInfo(host_fmt.format(i // per), 100000 + i) for i in range(roles))  # as the controller fills it
    s = tuple(ProcessInfo(host_fmt.format(hosts + i // 8), 200000 + i, "") for i in range(standbys))
    return Roster(generation, r, s)


class Recording:
    """A store that records every value written (the request each ``set`` makes)."""

    def __init__(self, inner):
        self.inner = inner
        self.sets = []

    def set(self, k, v):
        self.sets.append((k, len(v)))
        self.inner.set(k, v)

    def get(self, k):
        return self.inner.get(k)

    def check(self, ks):
        return self.inner.check(ks)

    def multi_get(self, ks):
        return self.inner.multi_get(ks)

    def delete_key(self, k):
        return self.inner.delete_key(k)


def _tcpstore(timeout_s=30.0):
    """A TCPStore server on a free port, and a factory of clients (a client is one thread's)."""
    t = timedelta(seconds=timeout_s)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=t)
    return server, (lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=t))


def _reader(store):
    refused = []
    return Channel(store, TOKEN, on_refused=lambda k, why: refused.append((k, why))), refused


def test_limits_name_what_a_size_crosses():
    assert limits.MAX_BYTES == protocol.MAX_BYTES == 256 * 1024
    assert limits.ETCD_MAX_REQUEST == 1572864 and limits.TCPSTORE_MAX_VALUE == 8388608
    assert limits.crossed(1000) == []
    assert limits.crossed(541_218) == ["MAX_BYTES"]
    assert limits.crossed(2 * 1024 * 1024) == ["MAX_BYTES", "ETCD_MAX_REQUEST"]
    assert limits.crossed(9 * 1024 * 1024) == ["MAX_BYTES", "ETCD_MAX_REQUEST", "TCPSTORE_MAX_VALUE"]
    assert limits.crossed(limits.BIG_VALUE_MAX) == [] and "over MAX_BYTES" in limits.describe(300_000)


def test_a_roster_of_8192_roles_round_trips_in_chunks_through_a_real_tcpstore():
    roster = _roster()
    text = roster.to_json()
    body = json.loads(text)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    # the limit matters: neither the roster's own JSON nor the compact one fits one message
    assert limits.crossed(len(text)) == ["MAX_BYTES"] and limits.crossed(len(canonical)) == ["MAX_BYTES"]
    print(f"roster 8,192 roles + 64 standbys: to_json {len(text):,} B, canonical {len(canonical):,} B")

    server, client = _tcpstore()
    writer_store = Recording(client())
    w = Channel(writer_store, TOKEN)
    rch, refused = _reader(client())
    w.put("ctl/plain", body)                        # the small-message path refuses it on read
    rch.store.wait(["ctl/plain"])                   # a TCPStore set does not wait for the server
    assert rch.read("ctl/plain") is None
    assert len(refused) == 1 and "oversized" in refused.pop()[1]
    writer_store.sets.clear()

    man = w.put_big(KEY, body)
    assert man["bytes"] == len(canonical) and man["chunks"] == -(-len(canonical) // protocol.BIG_CHUNK_BYTES)
    assert man["prev"] is None
    print(f"put_big: {man['chunks']} chunks, largest value {max(n for _, n in writer_store.sets):,} B")
    assert [k for k, _ in writer_store.sets][-1] == KEY          # the manifest is written last
    assert max(n for _, n in writer_store.sets) <= VALUE_MAX
    assert all(not limits.crossed(n) for _, n in writer_store.sets)

    rch.store.wait([KEY])
    got = rch.read_big(KEY, protocol.ROSTER)
    assert got == body and Roster.from_json(json.dumps(got)) == roster and refused == []
    t0 = time.perf_counter()
    assert rch.read_big(KEY, protocol.ROSTER) == body           # polled again: from the manifest alone
    print(f"read_big again (unchanged): {1e3 * (time.perf_counter() - t0):.1f} ms")

    # a small body still goes through (one chunk), and read_big applies the schema
    w.put_big("ctl/small", {"generation": 1})
    rch.store.wait(["ctl/small"])
    assert rch.read_big("ctl/small") == {"generation": 1}
    assert rch.read_big("ctl/small", protocol.LAYOUT) is None
    assert refused[-1][0] == "ctl/small" and "malformed message" in refused[-1][1]
    assert rch.read_big("ctl/absent") is None


def _fault_flip(st, key, man):
    ck = big_chunk_key(key, man["sha256"], 1)
    raw = bytearray(st.get(ck))
    raw[-10] ^= 0x01
    st.set(ck, bytes(raw))
    return key, "chunk 1 of", "bad MAC"


def _fault_missing(st, key, man):
    assert st.delete_key(big_chunk_key(key, man["sha256"], 2))
    return key, "chunk 2 of", "is missing"


def _fault_junk(st, key, man):
    st.set(big_chunk_key(key, man["sha256"], 0), b"{\"generation\": 99}")
    return key, "chunk 0 of", "unauthenticated"


def _fault_swapped(st, key, man):
    a, b = (big_chunk_key(key, man["sha256"], i) for i in (0, 1))
    ra, rb = st.get(a), st.get(b)
    st.set(a, rb)
    st.set(b, ra)
    return key, "chunk 0 of", "bad MAC"


def _fault_replayed(st, key, man):
    st.set("ctl/other", st.get(key))             # the manifest copied onto another key
    return "ctl/other", "", "bad MAC"


def _fault_manifest_junk(st, key, man):
    st.set(key, b'{"chunks": 1, "bytes": 5, "sha256": "00"}')
    return key, "", "unauthenticated"


@pytest.mark.parametrize("fault", [_fault_flip, _fault_missing, _fault_junk, _fault_swapped, _fault_replayed,
                                   _fault_manifest_junk])
def test_each_fault_in_a_chunked_message_is_refused_by_name(fault):
    body = json.loads(_roster(roles=4096, hosts=512, standbys=8).to_json())
    st = dist.HashStore()
    man = Channel(st, TOKEN).put_big(KEY, body)
    assert man["chunks"] >= 3
    key, where, why = fault(st, KEY, man)
    rch, refused = _reader(st)
    assert rch.read_big(key) is None
    assert len(refused) == 1 and refused[0][0] == key, refused
    assert where in refused[0][1] and why in refused[0][1], refused
    assert rch.read_big(key) is None and len(refused) == 1      # the same junk polled again: reported once


def test_reassert_writes_back_a_chunk_overwritten_with_junk():
    st = dist.HashStore()
    w = Channel(st, TOKEN)
    body = json.loads(_roster(roles=2048, hosts=256, standbys=0).to_json())
    man = w.put_big(KEY, body)
    ck = big_chunk_key(KEY, man["sha256"], 1)
    st.set(ck, b"junk")
    rch, refused = _reader(st)
    assert rch.read_big(KEY) is None and "unauthenticated" in refused[0][1]
    assert w.reassert() == 1
    assert _reader(st)[0].read_big(KEY) == body


class _RewriteMidRead:
    """A reader's store that, right after handing out the manifest, lets the writer rewrite the key."""

    def __init__(self, inner, rewrite):
        self.inner, self.rewrite, self.fired = inner, rewrite, False

    def get(self, k):
        v = self.inner.get(k)
        if k == KEY and not self.fired:
            self.fired = True
            self.rewrite()
        return v

    def set(self, k, v):
        self.inner.set(k, v)

    def check(self, ks):
        return self.inner.check(ks)

    def multi_get(self, ks):
        return self.inner.multi_get(ks)


def test_a_rewrite_with_a_smaller_body_is_never_read_as_a_mix():
    big = json.loads(_roster(generation=7).to_json())
    small = json.loads(_roster(generation=8, standbys=0, host_fmt="n{:04d}").to_json())
    server, client = _tcpstore(timeout_s=10.0)
    st = client()
    w = Channel(st, TOKEN)
    m_big = w.put_big(KEY, big)
    # the reader has the big version's manifest when the small one replaces it: it reads the big one, whole
    rc = client()
    rc.wait([KEY])
    rst = _RewriteMidRead(rc, lambda: w.put_big(KEY, small))
    rch, refused = _reader(rst)
    assert rch.read_big(KEY) == big and rst.fired and refused == []
    m_small = w._big_manifest(KEY)
    assert m_small["chunks"] < m_big["chunks"] and m_small["prev"]["sha256"] == m_big["sha256"]
    assert _reader(st)[0].read_big(KEY) == small
    # the replaced version's chunks stay for such readers; the one before it goes with the next rewrite
    assert st.check([big_chunk_key(KEY, m_big["sha256"], i) for i in range(m_big["chunks"])])
    third = dict(small, generation=9)
    m3 = w.put_big(KEY, third)
    assert not any(st.check([big_chunk_key(KEY, m_big["sha256"], i)]) for i in range(m_big["chunks"]))
    assert st.check([big_chunk_key(KEY, m_small["sha256"], i) for i in range(m_small["chunks"])])
    assert m3["prev"] == {"sha256": m_small["sha256"], "chunks": m_small["chunks"]}
    owned = {k for k in w.owned if k.startswith(KEY + "/")}  # only the current version is reasserted
    assert owned == {big_chunk_key(KEY, m3["sha256"], i) for i in range(m3["chunks"])}
    # writing the same body again replaces nothing: its prev stays, nothing is deleted
    assert w.put_big(KEY, third)["prev"] == m3["prev"]
    assert st.check([big_chunk_key(KEY, m_small["sha256"], i) for i in range(m_small["chunks"])])

    # and while a writer rewrites with bodies of varying sizes, every read is one of them, whole
    bodies = [big, small, third, json.loads(_roster(roles=8192, hosts=1024, standbys=16, generation=10).to_json())]
    stop, reads, errors = threading.Event(), [], []

    def read_loop():
        rch2, refused2 = _reader(client())
        try:
            while not stop.is_set():
                got = rch2.read_big(KEY)
                reads.append(None if got is None else bodies.index(got))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        errors.extend(refused2)

    th = threading.Thread(target=read_loop, daemon=True)
    th.start()
    for i in range(24):
        w.put_big(KEY, bodies[i % len(bodies)])
        time.sleep(0.01)
    time.sleep(0.05)
    stop.set()
    th.join(30)
    assert errors == [] and reads and None not in reads, (errors, reads.count(None))


def test_put_big_refuses_a_bad_chunk_size_and_a_body_past_its_limit():
    from pitstop.errors import PitstopError

    w = Channel(dist.HashStore(), TOKEN)
    with pytest.raises(PitstopError, match="chunk_bytes"):
        w.put_big(KEY, {}, chunk_bytes=2 * 1024 * 1024)
    man = w.put_big(KEY, {"a": "x" * 1000}, chunk_bytes=100)
    assert man["chunks"] == 11 and _reader(w.store)[0].read_big(KEY) == {"a": "x" * 1000}
    rch, refused = _reader(w.store)
    assert rch.read_big(KEY, max_bytes=500) is None and "oversized" in refused[0][1]


# --------------------------------------------------------------------------- a real etcd
@pytest.fixture(scope="module")
def etcd_endpoint(tmp_path_factory):
    from pitstop.launch.etcd_server import EtcdServer, etcd_binary

    if etcd_binary() is None:
        pytest.skip("no etcd binary on PATH")
    pytest.importorskip("etcd3gw")
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server.endpoint
    server.stop()


def test_through_a_real_etcd_every_request_stays_under_its_limit(etcd_endpoint):
    import uuid

    from pitstop.store import connect, etcd_spec

    st = connect(etcd_spec(etcd_endpoint, uuid.uuid4().hex[:12]), timeout=timedelta(seconds=10))
    from pitstop.errors import EtcdUnavailable

    st.set("just-fits", b"x" * (limits.ETCD_MAX_REQUEST - 4096))  # the limit is real, and where it says
    with pytest.raises(EtcdUnavailable, match="refused /kv/put"):
        st.set("too-big", b"x" * (limits.ETCD_MAX_REQUEST + 32 * 1024))
    roster = _roster()
    # and a body past it (the controller's state holds rosters and more): three rosters, ~1.6 MB
    bodies = {KEY: json.loads(roster.to_json()),
              "ctl/state": {"rosters": [json.loads(_roster(generation=g).to_json()) for g in (1, 2, 3)]}}
    rec = Recording(st)
    w = Channel(rec, TOKEN)
    for key, body in bodies.items():
        man = w.put_big(key, body)
        print(f"etcd put_big {key}: {man['bytes']:,} B in {man['chunks']} chunks")
    assert len(json.dumps(bodies["ctl/state"])) > limits.ETCD_MAX_REQUEST
    biggest = max(len(k) + n for k, n in rec.sets)
    assert biggest <= VALUE_MAX + 200 and not limits.crossed(biggest)
    rch, refused = _reader(st.clone())
    assert rch.read_big(KEY) == bodies[KEY] and Roster.from_json(json.dumps(rch.read_big(KEY))) == roster
    assert rch.read_big("ctl/state") == bodies["ctl/state"] and refused == []


@pytest.mark.parametrize("lost", [1, 8, 64, 65, 512, 8192])
def test_a_fault_verdict_for_any_number_of_lost_roles_fits_a_vote_slot(lost):
    """The controller's verdict for a discarded step names the lost roles: 62 machines lost at
    4,096 simulated ranks made one of 2,914 characters, past the slot's 2,048, and every reader
    refused it. It names at most FAULT_ROLES_MAX roles and counts the rest."""
    from pitstop.protocol import VOTE, Verdict, open_, seal

    roles = list(range(8192 - lost, 8192))
    v = Verdict.fault({"roles": roles, "generation": 12345})
    got = open_(TOKEN, "k", seal(TOKEN, "k", {"verdict": v}), VOTE)["verdict"]  # raises if refused
    assert got == v and not Verdict.commits(got) and not Verdict.is_poisoned(got)
    body = json.loads(got)["fault"]
    assert body["roles"] == roles[:Verdict.FAULT_ROLES_MAX]
    assert body.get("roles_not_named", 0) == max(0, lost - Verdict.FAULT_ROLES_MAX)
