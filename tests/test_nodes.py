"""Tier 1: machines as pure data (``--nnodes MIN:MAX``, node ranks) and SLURM's variables."""

from __future__ import annotations

import re

import pytest

from pitstop.errors import ConfigError
from pitstop.launch.nodes import Nodes, expand_hostlist, from_slurm


def test_nnodes_min_max():
    assert Nodes.parse("4") == Nodes(4, 4) and Nodes.parse("4").standby_machines == 0
    n = Nodes.parse("4:5")
    assert n.standby_machines == 1 and n.is_standby_machine(4) and not n.is_standby_machine(3)
    assert [n.node_of(r, 2) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    for bad, msg in (("0", "min(0)"), ("5:4", "MAX(4) must be >= MIN(5)"), ("x", "expected N or MIN:MAX"),
                     ("4:y", "expected N or MIN:MAX")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            Nodes.parse(bad)
    with pytest.raises(ConfigError, match=r"--node-rank\(5\): expected 0..4"):
        n.check_rank(5)


@pytest.mark.parametrize("text, hosts", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("gpu[01-02,07],login1", ["gpu01", "gpu02", "gpu07", "login1"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("n[001-002],m[5]", ["n001", "n002", "m5"]),
    ("h1,h2", ["h1", "h2"]),
])
def test_slurm_hostlists_expand(text, hosts):
    assert expand_hostlist(text) == hosts


def test_slurm_place_names_the_head_and_this_node():
    env = {"SLURM_JOB_NODELIST": "gpu[07-09],spare1", "SLURM_NNODES": "4", "SLURM_NODEID": "2"}
    p = from_slurm(env)
    assert (p.nnodes, p.node_rank, p.head) == (4, 2, "gpu07")
    assert from_slurm({}) is None
    with pytest.raises(ConfigError, match=r"SLURM_NNODES\(3\) != 4 hosts"):
        from_slurm({**env, "SLURM_NNODES": "3"})
    with pytest.raises(ConfigError, match=r"SLURM_NODEID\(4\): expected 0..3"):
        from_slurm({**env, "SLURM_NODEID": "4"})
    with pytest.raises(ConfigError, match="expected integers"):
        from_slurm({**env, "SLURM_NODEID": "x"})
    with pytest.raises(ConfigError, match="runs backwards"):
        expand_hostlist("gpu[09-07]")


def test_remote_agents_report_a_silent_machine_and_one_that_never_joined(dict_store):
    """Through sealed messages only: machine 0's agent says hello and beats, then falls silent;
    machine 1 never says hello. Both machines' processes are reported exited, with the reason."""
    import time

    from pitstop.launch.remote import RemoteAgents
    from pitstop.protocol import Channel
    from pitstop.runtime import keys

    st, lost = dict_store, []
    ch = Channel(st, "t" * 64)
    ra = RemoteAgents(ch, "/nonexistent", 2, heartbeat_timeout_s=0.2, on_node_lost=lambda k, s: lost.append(k),
                      poll_s=0.0, join_timeout_s=0.3)
    p0 = ra.start("w0", {"RANK": "0", "PITSTOP_JOB_TOKEN": "secret"}, 0)
    ra.start("w1", {"RANK": "1"}, 1)
    cmd = st.d[keys.node_cmd(0, 1)]
    assert b"secret" not in cmd and b'"RANK":"0"' in cmd          # the token never crosses the store
    ch.put(keys.node(0, "hello"), {"node": 0, "host": "h", "addr": "127.0.0.2", "nproc": 1, "pid": 5})
    ch.put(keys.node_event(0, "w0", "started"), {"pid": 77})
    assert ra.poll() == [] and p0.pid == 77 and ra.alive(0) and not ra.alive(1)
    st.set(keys.node(0, "hb"), "junk")                              # junk is not a beat
    ch.put(keys.node(0, "hb"), {"n": 1})
    assert ra.poll() == []
    out, t_end = [], time.monotonic() + 1.0
    while len(out) < 2 and time.monotonic() < t_end:  # it looks on, and sees the silence
        out += ra.poll()
        time.sleep(0.05)
    assert {p.name: p.exit for p in out} == {"w0": "machine 0 lost",
                                            "w1": "machine 1 never joined (no agent hello within 0s)"}
    assert sorted(lost) == [0, 1] and not ra.alive(0)
    assert ra.start("w2", {}, 0).exit == "machine 0 is lost"          # nothing is sent to a lost machine


def test_a_restarted_controller_takes_the_agents_view_and_finds_commands_sent_after_the_last_save(dict_store):
    """RemoteAgents.state/restore round-trip through JSON; a start sent after the state was
    saved is found in the store (returned for adoption) and its number is not reused."""
    import json

    from pitstop.launch.remote import RemoteAgents
    from pitstop.protocol import Channel
    from pitstop.runtime import keys

    ch = Channel(dict_store, "t" * 64)
    old = RemoteAgents(ch, "/nonexistent", 2, heartbeat_timeout_s=5.0, poll_s=0.0)
    old.start("w0", {"RANK": "0", "PITSTOP_SLOT": "1"}, 0)
    ch.put(keys.node(0, "hello"), {"node": 0, "host": "h", "addr": "127.0.0.2", "nproc": 1, "pid": 5})
    ch.put(keys.node_event(0, "w0", "started"), {"pid": 77})
    old.poll()
    saved = json.loads(json.dumps(old.state()))
    old.start("sb3", {"RANK": "-1", "PITSTOP_SLOT": "4", "PITSTOP_STANDBY": "1"}, 0)   # after the save
    old.kill(old.procs["w0"])
    new = RemoteAgents(ch, "/nonexistent", 2, heartbeat_timeout_s=5.0, poll_s=0.0)
    found = new.restore(saved)
    assert [(k, c["name"]) for k, c in found] == [(0, "sb3")]                # the start, not the kill
    assert new.procs["w0"].pid == 77 and new.procs["sb3"].pid is None and new.alive(0) and not new.alive(1)
    assert new.cmds[0] == 3                                                   # the next command is number 4
    new.start("w9", {"RANK": "9"}, 0)
    assert ch.read(keys.node_cmd(0, 4), None)["name"] == "w9"


def test_a_reported_failure_confirms_a_silent_machine_sooner_but_never_a_beating_one(dict_store):
    """Heartbeat timeout 5 s, confirm 0.3 s. Without a report, 0.5 s of silence is nothing;
    after ``suspect()`` it is a loss, while machine 1, which keeps beating, stays."""
    import time

    from pitstop.launch.remote import RemoteAgents
    from pitstop.protocol import Channel
    from pitstop.runtime import keys

    st, lost = dict_store, []
    ch = Channel(st, "t" * 64)
    ra = RemoteAgents(ch, "/nonexistent", 2, heartbeat_timeout_s=5.0, on_node_lost=lambda k, s: lost.append((k, s)),
                      poll_s=0.0, confirm_s=0.3)
    assert ra.confirm_s == 0.3 and not ra.suspecting()
    for k in (0, 1):
        ch.put(keys.node(k, "hello"), {"node": k, "host": "h", "addr": f"127.0.0.{k + 2}", "nproc": 1, "pid": 5})
        ra.start(f"w{k}", {}, k)
    beat = {0: 0, 1: 0}

    def tick(nodes):
        for k in nodes:
            beat[k] += 1
            ch.put(keys.node(k, "hb"), {"n": beat[k]})
        return ra.poll()

    tick((0, 1))
    t_end = time.monotonic() + 0.5
    while time.monotonic() < t_end:                # machine 0 falls silent; no failure reported
        assert tick((1,)) == []
        time.sleep(0.05)
    assert lost == [] and ra.alive(0)
    ra.suspect()
    assert ra.suspecting()
    out = tick((1,))
    assert [p.name for p in out] == ["w0"] and out[0].exit == "machine 0 lost"
    assert [k for k, _ in lost] == [0] and lost[0][1] >= 0.5 and ra.alive(1)
    assert RemoteAgents(ch, "/x", 1, heartbeat_timeout_s=0.2, confirm_s=1.0).confirm_s == 0.2  # never above the timeout


def test_a_probe_after_a_reported_failure_takes_only_the_machine_that_does_not_answer(dict_store):
    """Heartbeat timeout 5 s, confirm 4 s, probe 0.2 s. Both machines beat just before the
    report; machine 0's agent answers the probe, machine 1's does not (and a replayed old
    pong answers nothing): machine 1 is lost within the probe time, machine 0 stays."""
    import time

    from pitstop.launch.remote import RemoteAgents
    from pitstop.protocol import Channel
    from pitstop.runtime import keys

    st, lost = dict_store, []
    ch = Channel(st, "t" * 64)
    ra = RemoteAgents(ch, "/nonexistent", 2, heartbeat_timeout_s=5.0, on_node_lost=lambda k, s: lost.append(k),
                      poll_s=0.0, confirm_s=4.0, probe_s=0.2)
    for k in (0, 1):
        ch.put(keys.node(k, "hello"), {"node": k, "host": "h", "addr": f"127.0.0.{k + 2}", "nproc": 1, "pid": 5})
        ch.put(keys.node(k, "hb"), {"n": 1})
        ra.start(f"w{k}", {}, k)
    ch.put(keys.node(1, "pong"), {"n": 0})          # an old answer, as if replayed
    assert ra.poll() == []
    ra.suspect()
    assert ch.read(keys.node(0, "probe")) == {"n": 1} and ch.read(keys.node(1, "probe")) == {"n": 1}
    t0 = time.monotonic()
    ch.put(keys.node(0, "pong"), {"n": 1})          # machine 0's agent answers on its next loop
    out = []
    while not out and time.monotonic() - t0 < 3.5:
        out = ra.poll()
        time.sleep(0.01)
    waited = time.monotonic() - t0
    assert [p.name for p in out] == ["w1"] and lost == [1] and ra.alive(0)
    assert waited >= 0.2                            # never before the probe time ...
    assert ra.nodes[1].cause.startswith("its agent left probe 1 unanswered for ")  # ... and by the probe, not silence
    assert ra.nodes[0].probe_n == 0                 # answered
    assert RemoteAgents(ch, "/x", 1, heartbeat_timeout_s=5.0, confirm_s=1.0, probe_s=3.0).probe_s == 1.0


def test_a_machines_agent_answers_a_probe_once_and_not_a_replayed_one(tmp_path):
    """The real agent loop on a real TCPStore: a sealed probe is answered with its number on
    the agent's next loop; the same probe written again is not answered again; junk on the
    probe key is refused and answers nothing; ``ctl/done`` ends the agent."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from pitstop.launch.node_agent import NodeAgent
    from pitstop.protocol import Channel
    from pitstop.runtime import keys

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    token = "k" * 64
    agent = NodeAgent(3, "127.0.0.1", 1, ["true"], tmp_path, f"127.0.0.1:{master.port}", token,
                      heartbeat_interval_s=0.01)
    rc = []
    th = threading.Thread(target=lambda: rc.append(agent.run()), daemon=True)
    th.start()
    ch = Channel(master, token)
    ch.wait(keys.node(3, "hello"), timeout_s=10)

    def until(cond, what):
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < 10, what
            time.sleep(0.005)

    def two_more_loops():  # the agent beats once a loop (interval 0.01 s), after it read the probe key
        n0 = ch.read(keys.node(3, "hb"))["n"]
        until(lambda: ch.read(keys.node(3, "hb"))["n"] >= n0 + 2, "the agent stopped beating")

    try:
        until(lambda: ch.read(keys.node(3, "hb")) is not None, "no beat")
        master.set(keys.node(3, "probe"), b"junk")
        two_more_loops()
        assert ch.read(keys.node(3, "pong")) is None        # junk is no probe
        ch.put(keys.node(3, "probe"), {"n": 4}, own=False)
        until(lambda: ch.read(keys.node(3, "pong")) is not None, "probe 4 unanswered")
        assert ch.read(keys.node(3, "pong")) == {"n": 4}
        ch.put(keys.node(3, "pong"), {"n": 0}, own=False)   # clear the answer, then replay probe 4
        ch.put(keys.node(3, "probe"), {"n": 4}, own=False)
        two_more_loops()
        assert ch.read(keys.node(3, "pong")) == {"n": 0} and agent.answered == 4
    finally:
        ch.put(keys.DONE, {"set": True})
        th.join(10)
    assert rc == [0]


def test_a_machines_link_reports_its_agents_death_at_once_and_refuses_impostors():
    """The agent's TCP link (pitstop.launch.link), real sockets and a real process: a link that
    proves the token is taken; a wrong token, junk, or a second link for a machine are refused
    and never count; a clean leave is no loss; a process SIGKILLed while it holds a link is
    reported lost on the next polls, with the cause."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from pitstop.launch import link

    token = "t" * 64
    refused = []
    srv = link.LinkServer("127.0.0.1", token, on_refused=lambda what, why: refused.append(why))

    def until(cond, what, lost=None):
        t0 = time.monotonic()
        while True:
            got = srv.poll()
            if lost is not None:
                lost.extend(got)
            else:
                assert got == [], got  # nothing here may count as a loss
            if cond():
                return
            assert time.monotonic() - t0 < 20, what
            time.sleep(0.01)

    def connect_async(node, tok):
        box = {}

        def go():
            try:
                box["sock"] = link.connect("127.0.0.1", srv.port, node, tok)
            except (OSError, ValueError) as exc:
                box["error"] = exc
        th = threading.Thread(target=go, daemon=True)
        th.start()
        return box, th

    try:
        good, th = connect_async(2, token)
        until(lambda: 2 in srv.links, "the good link was not taken")
        th.join(5)
        bad, th = connect_async(3, "x" * 64)
        until(lambda: any("does not prove" in r for r in refused), "a wrong token was not refused")
        th.join(5)
        dup, th = connect_async(2, token)
        until(lambda: any("has a link already" in r for r in refused), "a second link for machine 2 was taken")
        th.join(5)
        import socket

        junk = socket.create_connection(("127.0.0.1", srv.port))
        junk.sendall(b"hello there\n")
        until(lambda: sum("does not prove" in r for r in refused) >= 2, "junk was not refused")
        junk.close()
        assert set(srv.links) == {2}
        link.leave(good["sock"])
        until(lambda: not srv.links, "a clean leave left the link")  # and reported no loss (until asserts it)

        code = ("import sys, time; from pitstop.launch import link; "
                f"s = link.connect('127.0.0.1', {srv.port}, 4, {token!r}); print('up', flush=True); time.sleep(600)")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            until(lambda: 4 in srv.links, "the process's link was not taken")
            os.kill(proc.pid, signal.SIGKILL)
            lost = []
            until(lambda: bool(lost), "the killed process's link was not reported", lost=lost)
            assert lost == [(4, "its agent's connection to the controller closed")], lost
            assert 4 not in srv.links
        finally:
            proc.kill()
            proc.wait()
    finally:
        srv.close()


def test_silence_the_controller_did_not_see_is_not_counted_but_real_silence_still_is(dict_store):
    """Confirm 0.3 s after a reported failure. The controller does not look for 1.2 s (its loop
    busy, or its store reads stalled) while both machines' beats are due: the next look must
    not call them lost, since it saw no silence. Machine 0 then stays silent while the
    controller looks every 0.05 s: it is lost after 0.3 s of seen silence; machine 1, which
    beats, stays."""
    import time

    from pitstop.launch.remote import Lookout, RemoteAgents
    from pitstop.protocol import Channel
    from pitstop.runtime import keys

    st, lost = dict_store, []
    ch = Channel(st, "t" * 64)
    ra = RemoteAgents(ch, "/nonexistent", 2, heartbeat_timeout_s=5.0, on_node_lost=lambda k, s: lost.append((k, s)),
                      poll_s=0.0, confirm_s=0.3)
    for k in (0, 1):
        ch.put(keys.node(k, "hello"), {"node": k, "host": "h", "addr": f"127.0.0.{k + 2}", "nproc": 1, "pid": 5})
        ra.start(f"w{k}", {}, k)
        ch.put(keys.node(k, "hb"), {"n": 1})
    assert ra.poll() == []
    ra.suspect()
    time.sleep(1.2)                                   # the controller is blind; nobody's beat lands
    assert ra.poll() == [] and lost == [], lost       # 1.2 s unseen: not a loss
    t0, out, beat = time.monotonic(), [], 1
    while not out and time.monotonic() - t0 < 3.0:    # now it looks: only machine 1 beats
        beat += 1
        ch.put(keys.node(1, "hb"), {"n": beat})
        out = ra.poll()
        time.sleep(0.05)
    seen = time.monotonic() - t0
    assert [p.name for p in out] == ["w0"] and [k for k, _ in lost] == [0] and ra.alive(1), (out, lost)
    assert 0.15 <= seen < 1.0, seen                   # lost on the silence it saw (0.3 s, 0.1 of it in the gap)

    lk = Lookout(0.5)
    assert lk.look(10.0) == 0.0 and lk.look(10.4) == 0.0 and abs(lk.look(12.0) - 1.1) < 1e-9
    assert abs(lk.blind_s - 1.1) < 1e-9
    with pytest.raises(ValueError, match=r"allowance_s\(0\)"):
        Lookout(0)


def test_an_agent_whose_first_link_attempt_fails_tries_again_and_links(tmp_path):
    """The controller's link listener behind a real TCP relay whose first connection is cut at
    once (as 20 of 1,026 agents saw at 8,192 ranks: their first connect timed out while every
    machine connected together). The agent tries the same address again, backing off, and
    links: it does not stay on the store's fallback for the rest of the job."""
    import socket
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from pitstop.launch import link
    from pitstop.launch.node_agent import NodeAgent
    from pitstop.protocol import Channel
    from pitstop.runtime import keys

    token = "k" * 64
    srv = link.LinkServer("127.0.0.1", token)
    relay = socket.create_server(("127.0.0.1", 0))
    cut = []
    stop = threading.Event()

    def pump(a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def relay_loop():
        while not stop.is_set():
            try:
                c, _ = relay.accept()
            except OSError:
                return
            if not cut:  # the first connection: cut before the handshake
                cut.append(time.monotonic())
                c.close()
                continue
            up = socket.create_connection(("127.0.0.1", srv.port))
            threading.Thread(target=pump, args=(c, up), daemon=True).start()
            threading.Thread(target=pump, args=(up, c), daemon=True).start()

    threading.Thread(target=relay_loop, daemon=True).start()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    ch = Channel(master, token)
    ch.put(keys.NODE_LINK, {"host": "127.0.0.1", "port": relay.getsockname()[1]})
    agent = NodeAgent(3, "127.0.0.1", 1, ["true"], tmp_path, f"127.0.0.1:{master.port}", token,
                      heartbeat_interval_s=0.05)
    rc = []
    th = threading.Thread(target=lambda: rc.append(agent.run()), daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        while 3 not in srv.links:
            srv.poll()
            assert time.monotonic() - t0 < 20, f"the agent never linked (first connection cut: {bool(cut)})"
            time.sleep(0.01)
        assert cut and agent._link_fails == 1 and agent.linked
    finally:
        ch.put(keys.DONE, {"set": True})
        srv.send(3, b"done")  # a linked agent looks at ctl/done when its link says so
        t0 = time.monotonic()
        while th.is_alive() and time.monotonic() - t0 < 10:
            srv.poll()
            time.sleep(0.01)
        stop.set()
        relay.close()
        srv.close()
    assert rc == [0]
