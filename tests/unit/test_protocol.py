"""Tier 1: the control protocol's envelope, message shapes and channel (pure; a dict stands in
for the store only where the store's own behaviour is not under test, and a real TCPStore
where it is)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from pitstop import protocol
from pitstop.protocol import Channel, Refused, open_, seal
from pitstop.runtime import keys

TOKEN = "t" * 64


def test_a_sealed_message_opens_with_its_token_and_key_only():
    raw = seal(TOKEN, "ctl/assign/3", {"role": 5, "generation": 1, "mode": "recover", "step": 3})
    assert open_(TOKEN, "ctl/assign/3", raw, protocol.ASSIGN)["role"] == 5
    with pytest.raises(Refused, match="bad MAC"):
        open_("u" * 64, "ctl/assign/3", raw)                 # another job's token
    with pytest.raises(Refused, match="bad MAC"):
        open_(TOKEN, "ctl/assign/4", raw)                    # replayed onto another slot
    with pytest.raises(Refused, match="bad MAC"):
        open_(TOKEN, "ctl/assign/3", raw.replace(b'"role":5', b'"role":6'))  # tampered body


def test_sealing_is_deterministic_so_compare_set_votes_work():
    assert seal(TOKEN, "k", {"b": 1, "a": 2}) == seal(TOKEN, "k", {"a": 2, "b": 1})


@pytest.mark.parametrize("raw, reason", [
    (b"ok", "unauthenticated"),
    (b"", "unauthenticated"),
    (b"ps1.", "malformed envelope"),
    (b"ps1." + b"0" * 64, "malformed envelope"),
    (b"ps1." + b"0" * 64 + b".{}", "bad MAC"),
    (b"\xff" * 50, "unauthenticated"),
    (b"x" * (protocol.MAX_BYTES + 1), "oversized"),
    ("a str", "expected bytes"),
    (None, "expected bytes"),
])
def test_junk_is_refused_with_a_reason(raw, reason):
    with pytest.raises(Refused, match=reason) as exc:
        open_(TOKEN, "ctl/fault/g0", raw)
    assert exc.value.key == "ctl/fault/g0"


def _sealed_payload(key: str, payload: bytes) -> bytes:
    return protocol.MAGIC + protocol._mac(TOKEN.encode(), key, payload) + b"." + payload


@pytest.mark.parametrize("body, needle", [
    (b"not json", "malformed JSON"),
    (b'{"role": NaN, "generation": 1, "mode": "recover"}', "malformed JSON"),
    (b'[1, 2]', "expected an object"),
    (b'{"generation": 1, "mode": "recover"}', "missing field 'role'"),
    (b'{"role": "5", "generation": 1, "mode": "recover"}', "assign.role='5': expected int, got str"),
    (b'{"role": true, "generation": 1, "mode": "recover"}', "expected int, got bool"),
    (b'{"role": -1, "generation": 1, "mode": "recover"}', "assign.role=-1: expected >= 0"),
    (b'{"role": 1, "generation": 1, "mode": "steal"}', "expected one of 'recover', 'drain'"),
    (b'{"role": 1, "generation": 1, "mode": "drain", "x": 1}', "unknown field"),
])
def test_a_well_signed_but_malformed_message_is_refused(body, needle):
    """Even a token holder's message is checked: a bug must not become a crash elsewhere."""
    raw = _sealed_payload("ctl/assign/1", body)
    with pytest.raises(Refused) as exc:
        open_(TOKEN, "ctl/assign/1", raw, protocol.ASSIGN)
    assert needle in exc.value.reason, exc.value.reason


def test_every_schema_accepts_what_pitstop_itself_writes():
    examples = {
        protocol.HELLO: {"pid": 12, "host": "h", "standby": True, "rank": None},
        protocol.JOIN_VERDICT: {"ok": True, "slot": 3},
        protocol.FAULT: {"fallback": True, "resume_step": 4},
        protocol.DRAIN: {"role": 2, "generation": 1, "joiner": "h:12"},
        protocol.DRAIN_REQUEST: {"rank": None, "host": "h"},
        protocol.HEARTBEAT: {"n": 7},
        protocol.COMMITTED: {"generation": 0, "step": 3, "time": 1.5},
        protocol.DRAIN_SWITCH: {"step": 3, "time": 2.0},
        protocol.TIMING: {"groups_s": 0.1, "joiner": False, "steady_iter_s": None},
        protocol.RECORD: {"cls": "first", "role": 0, "path": "/r/warmup/first.pt", "bytes": 1, "value_bytes": 1,
                          "ops": 3, "record_s": 0.1},
        protocol.WARM: {"pid": 3, "results": [], "stopped": "", "ok": False, "rss_bytes": 10},
        protocol.CLASSES: {"classes": ["first", "last"]},
    }
    for schema, body in examples.items():
        assert open_(TOKEN, "k", seal(TOKEN, "k", body), schema) == body
    with pytest.raises(Refused, match="timing.x"):
        open_(TOKEN, "k", seal(TOKEN, "k", {"x": "str"}), protocol.TIMING)


def test_channel_reads_absent_and_refused_as_none_and_reports_junk_once(dict_store):
    st, seen = dict_store, []
    ch = Channel(st, TOKEN, lambda k, r: seen.append((k, r)))
    assert ch.read("ctl/done", protocol.FLAG) is None and seen == []
    st.set("ctl/done", "1")                       # the old, unauthenticated protocol
    for _ in range(5):                            # polled five times, reported once
        assert ch.read("ctl/done", protocol.FLAG) is None
    assert len(seen) == 1 and seen[0][0] == "ctl/done" and "unauthenticated" in seen[0][1]
    ch.put("ctl/done", {"set": True})
    assert ch.read("ctl/done", protocol.FLAG) == {"set": True}
    assert ch.refused == 1


def test_private_names_depend_on_the_token(dict_store):
    a, b = Channel(dict_store, TOKEN), Channel(dict_store, "other")
    assert a.private("ctl/arrive/g0/s1").startswith("ctl/arrive/g0/s1/")
    assert a.private("ctl/arrive/g0/s1") != b.private("ctl/arrive/g0/s1")
    assert a.private("ctl/arrive/g0/s1") != a.private("ctl/arrive/g0/s2")


def test_vote_on_a_real_tcpstore_settles_once_and_junk_on_the_public_name_is_ignored():
    import torch.distributed as dist

    from pitstop.store import host_store

    st = host_store("127.0.0.1", 0, timedelta(seconds=10))
    cl = dist.TCPStore("127.0.0.1", st.port, is_master=False, timeout=timedelta(seconds=10))
    ch1, ch2 = Channel(st, TOKEN), Channel(cl, TOKEN)
    cl.set(keys.verdict(0, 1), "junk")                     # an attacker's guess at the name
    assert ch1.vote(keys.verdict(0, 1), "ok") == "ok"
    assert ch2.vote(keys.verdict(0, 1), "poisoned at r3") == "ok"   # first verdict wins
    assert ch2.settled(keys.verdict(0, 1)) == "ok"
    cl.set(keys.arrive(0, 1), "junk")                      # the public name: nobody adds to it
    assert [ch1.add(keys.arrive(0, 1), 1), ch2.add(keys.arrive(0, 1), 1)] == [1, 2]


def test_the_store_listens_on_loopback_only():
    import subprocess

    from pitstop.store import host_store

    st = host_store("127.0.0.1", 0, timedelta(seconds=10))
    out = subprocess.run(["ss", "-Hltn", f"sport = :{st.port}"], capture_output=True, text=True).stdout
    assert out.strip(), out
    assert all("127.0.0.1:" in line for line in out.splitlines()), out


def test_key_list_for_the_fuzzer_names_every_key_function():
    """The fuzzer writes onto keys.all_patterns(): every key and key function of the module is in it."""
    import inspect

    names = set(keys.all_patterns())
    assert len(names) == len(keys.all_patterns()) > 200
    consts = [v for n, v in vars(keys).items() if n.isupper() and isinstance(v, str)]
    assert consts and all(c in names for c in consts), [c for c in consts if c not in names]
    sample = {"i": 1, "slot": 1, "g": 0, "s": 1, "n": 1, "k": 1, "cls": "first", "what": "hello", "who": "joiner",
              "name": "w1"}
    funcs = [f for n, f in vars(keys).items() if inspect.isfunction(f) and n != "all_patterns"]
    assert len(funcs) >= 15
    for f in funcs:
        args = {p: sample[p] for p in inspect.signature(f).parameters}
        if f is keys.node_event:
            args["what"] = "exit"
        assert f(**args) in names, (f.__name__, f(**args))


def test_sealed_raw_values_open_only_for_their_key_and_token():
    from pitstop.protocol import Refused, open_raw, seal_raw

    tok = b"k" * 32
    v = seal_raw(tok, "g/0/1", b"\x00\x01addr")
    assert open_raw(tok, "g/0/1", v) == b"\x00\x01addr"
    for key, raw, why in [("g/0/2", v, "bad MAC"), ("g/0/1", seal_raw(b"x" * 32, "g/0/1", b"a"), "bad MAC"),
                          ("g/0/1", b"127.0.0.1:4444", "unauthenticated"), ("g/0/1", v[:-1] + b"X", "bad MAC"),
                          ("g/0/1", "text", "expected bytes")]:
        with pytest.raises(Refused, match=why):
            open_raw(tok, key, raw)


def test_a_gloo_rendezvous_on_a_sealed_store_refuses_an_unsealed_address():
    """Junk (an address of an attacker's choosing, unsealed) at the key where rank 0 of a
    two-rank gloo group reads rank 1's address: the build fails with the refusal, and gloo
    never connects anywhere. With only sealed values, a group of one builds as usual."""
    from datetime import timedelta

    import torch.distributed as dist

    from pitstop.store import SealedStore

    inner = dist.HashStore()
    sealed = SealedStore(inner, "t" * 64)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("one", sealed), 0, 1, timedelta(seconds=5))
    assert pg.size() == 1 and inner.get("one/0/0").startswith(b"ps1r.")
    inner.set("two/0/1", b"\x00junk: connect to 10.0.0.66:4444")
    with pytest.raises(Exception, match="unauthenticated"):
        dist.ProcessGroupGloo(dist.PrefixStore("two", sealed), 0, 2, timedelta(seconds=5))
    assert sealed.clone().get("one/0/0") == sealed.get("one/0/0")   # a second connection, same seal


def test_inside_a_job_the_world_group_and_the_registry_seal_what_they_write():
    """With the job token set (as join() sets it), the world group's collective values and the
    registry's gloo rendezvous land sealed in the store; junk over a world value is refused
    with a GroupError naming the key, not read as data."""
    import subprocess
    import sys

    code = r"""
import torch, torch.distributed as dist
from pitstop import store as st
from pitstop.errors import GroupError
from pitstop.groups import GroupRegistry
from pitstop.layout import ParallelLayout
from pitstop.pg import init_world, world_group

srv = dist.TCPStore("127.0.0.1", 0, 1, True)
st.JOB_TOKEN = b"t" * 64
init_world(dist.TCPStore("127.0.0.1", srv.port, 1, False), 0, 1)
out = [torch.zeros(2)]
dist.all_gather(out, torch.tensor([3.0, 4.0]))
reg = GroupRegistry(ParallelLayout(1), dist.distributed_c10d._get_default_store())
reg.build()
raw = [srv.get(k) for k in ("pitstop/world/0//pitstop/g0/" + reg._name("dp", (0,), 0) + "~raw//cpu//0/0",)]
print("gather", out[0].tolist(), "sealed", all(r.startswith(b"ps1r.") for r in raw))
w = world_group()
seq = w.seq + 1
w._store.set(f"rec/op{seq}", b"junk")  # raw, through the same prefixes
w.detached = True
try:
    dist.all_reduce(torch.zeros(1))
    print("junk read")
except GroupError as e:
    print("refused:", str(e)[:200])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gather [3.0, 4.0] sealed True" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "refused:" in out.stdout and "unauthenticated" in out.stdout and f"rec/op" in out.stdout, out.stdout


def test_verdict_words_are_written_and_read_in_one_place():
    """The boundary writes and the controller reads the vote's words through ``Verdict``:
    what commits, what is poisoned, the controller's fault marker; a long reason is cut."""
    from pitstop.protocol import Verdict

    assert Verdict.commits(Verdict.OK) and Verdict.commits(Verdict.SWITCH)
    long = Verdict.poisoned(5, "x" * 5000)
    assert long.startswith("poisoned at r5: ") and len(long) == len("poisoned at r5: ") + Verdict.WHY_MAX
    assert Verdict.is_poisoned(long) and not Verdict.commits(long)
    assert Verdict.poisoned(None, "the verdict does not verify") == "poisoned: the verdict does not verify"
    marker = Verdict.fault({"role": 5, "generation": 0})
    assert json.loads(marker) == {"fault": {"role": 5, "generation": 0}}
    assert not Verdict.commits(marker) and not Verdict.is_poisoned(marker)
    assert not Verdict.commits(None) and not Verdict.is_poisoned(None)
    assert len(long) <= 2048  # fits the VOTE schema's verdict field


def test_a_key_watch_calls_back_once_per_key_as_the_key_moves_on(monkeypatch):
    """The session's watch on ``keys.ended(g)`` (a stayer freed from a collective on a dead
    peer): the thread blocks in the real TCPStore's ``wait`` and calls back once the key holds
    a good message, once per key, then follows ``key()`` to the next generation's. Junk under
    the key calls nothing back until the writer's own message is put back; a callback that
    raises does not end the thread."""
    import threading
    import time

    import torch.distributed as dist

    from pitstop.runtime.worker import ENV_STORE, KeyWatch
    from pitstop.store import host_store

    st = host_store("127.0.0.1", 0, timedelta(seconds=10))
    monkeypatch.setenv(ENV_STORE, f"127.0.0.1:{st.port}")
    ch = Channel(st, TOKEN)
    gen = {"g": 0}
    seen, lock = [], threading.Lock()

    def callback(c: Channel) -> None:
        with lock:
            seen.append((gen["g"], c.read(keys.fault(gen["g"]), protocol.FAULT)))
        if gen["g"] == 1:
            raise RuntimeError("a callback's own failure")

    monkeypatch.setattr(KeyWatch, "WAIT_S", 0.2)
    w = KeyWatch("t", lambda: keys.ended(gen["g"]), callback, ch, protocol.STAMP).start()

    def until(n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(seen) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    time.sleep(0.5)  # two store waits time out: nothing is called back for an absent key
    assert seen == []
    body = {"roles": [1], "generation": 1, "step": 3, "joiners": ["h:1"]}
    ch.put(keys.fault(0), body)
    ch.put(keys.ended(0), {"time": 1.0})
    until(1)
    time.sleep(0.5)  # written once, called back once
    assert seen == [(0, body)]
    gen["g"] = 1
    ch.put(keys.fault(1), {**body, "generation": 2})
    ch.put(keys.ended(1), {"time": 2.0})
    until(2)
    gen["g"] = 2
    dist.TCPStore("127.0.0.1", st.port, is_master=False).set(keys.ended(2), b"junk")
    time.sleep(0.5)
    assert len(seen) == 2, seen  # junk is no news
    ch.put(keys.ended(2), {"time": 3.0})  # the controller's reassert
    until(3)
    w.stop()
    assert [g for g, _ in seen] == [0, 1, 2], seen
    assert seen[1][1]["generation"] == 2 and seen[2][1] is None, seen


def test_the_sessions_vote_commits_poisons_switches_and_refuses_a_forged_slot():
    """The session's :class:`~pitstop.runtime.vote.Vote`, three ranks in threads on a real TCPStore,
    each with its own client and fence: all healthy commits (and publishes ``committed``); one
    poisoned rank settles the step poisoned for all, naming itself and its fence's error; a
    ready drain makes the last arriver settle ``switch``; a slot written without the token
    reads as poisoned, never as a commit."""
    import threading

    import torch.distributed as dist

    from pitstop.pg.fence import Fence
    from pitstop.protocol import Verdict
    from pitstop.runtime.vote import Vote
    from pitstop.store import host_store

    st = host_store("127.0.0.1", 0, timedelta(seconds=10))
    clients = [dist.TCPStore("127.0.0.1", st.port, is_master=False, timeout=timedelta(seconds=10)) for _ in range(3)]
    fences = [Fence() for _ in range(3)]
    votes = [Vote(Channel(c, TOKEN), c, 3, f, timeout_s=10.0) for c, f in zip(clients, fences)]
    ch = Channel(st, TOKEN)

    def round_(gen: int, step: int) -> list:
        got: list = [None] * 3

        def one(r: int) -> None:
            got[r] = votes[r](gen, step, r, fences[r].poisoned)

        ts = [threading.Thread(target=one, args=(r,)) for r in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        return got

    assert round_(0, 1) == [Verdict.OK] * 3
    assert ch.read(keys.COMMITTED, protocol.COMMITTED)["step"] == 1

    fences[1].errors.append("all_reduce on pitstop:g0:tp:abc: Connection closed by peer")
    got = round_(0, 2)
    assert len(set(got)) == 1 and got[0].startswith("poisoned at r1: all_reduce on pitstop:g0:tp:abc")
    assert not Verdict.commits(got[0])
    assert ch.read(keys.COMMITTED, protocol.COMMITTED)["step"] == 1   # not moved by a poisoned step
    fences[1].reset()

    ch.put(keys.drain_ready(0), {"set": True})
    assert round_(0, 3) == [Verdict.SWITCH] * 3
    assert ch.read(keys.drain_switch(0), protocol.DRAIN_SWITCH)["step"] == 3

    # generation 1, step 1: someone without the token fills the private slot before anyone arrives
    st.set(ch.private(keys.verdict(1, 1)), b"ok")
    got = [votes[r](1, 1, r, False) for r in range(2)]   # two of three arrive: they wait on the slot
    assert got == [Verdict.poisoned(None, "the verdict does not verify")] * 2


def test_an_asynchronous_vote_defers_a_drain_switch_to_the_next_step_which_all_vote_at_once():
    """``async_commit``: a vote read one boundary late must not say ``switch`` (every rank ran
    another step meanwhile). With a drain ready, the ``ahead`` vote settles ``switch next``,
    publishes the commit but no switch; the next step's ``switch`` vote settles ``switch`` and
    publishes it at that step. A poisoned vote carries the reason it is given (a failed buddy
    exchange, not the fence's), and an unknown mode is refused by name."""
    import threading

    import torch.distributed as dist

    from pitstop.pg.fence import Fence
    from pitstop.protocol import Verdict
    from pitstop.runtime.vote import Vote
    from pitstop.store import host_store

    st = host_store("127.0.0.1", 0, timedelta(seconds=10))
    clients = [dist.TCPStore("127.0.0.1", st.port, is_master=False, timeout=timedelta(seconds=10)) for _ in range(2)]
    votes = [Vote(Channel(c, TOKEN), c, 2, Fence(), timeout_s=10.0) for c in clients]
    ch = Channel(st, TOKEN)

    def round_(gen: int, step: int, mode: str, why=(None, None)) -> list:
        got: list = [None] * 2
        ts = [threading.Thread(target=lambda r=r: got.__setitem__(
            r, votes[r](gen, step, r, why[r] is not None, mode, why[r]))) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        return got

    assert round_(0, 1, "ahead") == [Verdict.OK] * 2  # no drain: an ahead vote is a plain commit
    ch.put(keys.drain_ready(0), {"set": True})
    assert round_(0, 2, "ahead") == [Verdict.SWITCH_NEXT] * 2
    assert Verdict.commits(Verdict.SWITCH_NEXT)
    assert ch.read(keys.COMMITTED, protocol.COMMITTED)["step"] == 2
    assert ch.read(keys.drain_switch(0), protocol.DRAIN_SWITCH) is None
    assert round_(0, 3, "switch") == [Verdict.SWITCH] * 2
    assert ch.read(keys.drain_switch(0), protocol.DRAIN_SWITCH)["step"] == 3

    got = round_(1, 1, "ahead", why=(None, "buddy exchange on pitstop:g1:dp+ring: Connection reset by peer"))
    assert got == [Verdict.poisoned(1, "buddy exchange on pitstop:g1:dp+ring: Connection reset by peer")] * 2
    with pytest.raises(ValueError, match="vote mode 'later': expected one of now, ahead, switch"):
        votes[0](1, 2, 0, False, "later")
