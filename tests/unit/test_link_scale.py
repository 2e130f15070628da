"""Tier 2: the agents' links (pitstop.launch.link) at ~1,000 machines, real sockets in one process.

``select.select`` refuses any descriptor above 1,023, so a controller holding a link per machine
broke near 1,000 machines; the server now waits on ``selectors`` (epoll). Also the lines both
ways, ``last_seen``, and junk lines refused by name without touching other links."""

from __future__ import annotations

import resource
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pitstop.launch import link

pytestmark = pytest.mark.timeout(180)

TOKEN = "t" * 64
N = 1100


def _raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        pytest.skip(f"RLIMIT_NOFILE hard limit {soft} < {need} descriptors")


def _until(srv, cond, what, timeout_s=60.0, lost=None):
    t0 = time.monotonic()
    while True:
        got = srv.poll()
        if lost is not None:
            lost.extend(got)
        else:
            assert got == [], got  # nothing here may count as a loss
        if cond():
            return
        assert time.monotonic() - t0 < timeout_s, what
        time.sleep(0.002)


def _connect_all(srv, nodes, token=TOKEN):
    """Connect machines ``nodes`` from a thread pool while this thread polls the server."""
    socks, errors = {}, []

    def one(k):
        try:
            socks[k] = link.connect("127.0.0.1", srv.port, k, token, timeout_s=60)
        except (OSError, ValueError) as exc:
            errors.append((k, exc))

    with ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(one, k) for k in nodes]
        _until(srv, lambda: all(f.done() for f in futs) and all(k in srv.links for k in socks),
               f"not every link was taken ({len(srv.links)} of {len(nodes)})", timeout_s=120)
    assert errors == []
    return socks


def test_a_thousand_links_past_descriptor_1023_report_exactly_the_machines_lost():
    _raise_nofile(2 * N + 200)
    refused = []
    srv = link.LinkServer("127.0.0.1", TOKEN, on_refused=lambda what, why: refused.append((what, why)))
    socks = {}
    try:
        socks = _connect_all(srv, range(N))
        assert set(srv.links) == set(range(N)) and not srv.pending and refused == []
        fds = sorted(s.fileno() for s in srv.links.values())
        assert fds[-1] > 1023, fds[-1]  # the server really waits on descriptors select.select cannot
        print(f"{len(fds)} links, server descriptors {fds[0]}..{fds[-1]}")
        with pytest.raises(ValueError, match="filedescriptor out of range"):
            select.select([srv.links[max(srv.links, key=lambda k: srv.links[k].fileno())]], [], [], 0)

        # three machines fail (two closes, one reset), one leaves cleanly
        socks.pop(7).close()
        socks.pop(512).close()
        rst = socks.pop(1099)
        rst.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        rst.close()
        link.leave(socks.pop(300))
        lost = []
        _until(srv, lambda: len(lost) >= 3 and 300 not in srv.links, "the losses were not all reported", lost=lost)
        deadline = time.monotonic() + 0.5  # and nothing more turns up
        while time.monotonic() < deadline:
            lost.extend(srv.poll())
            time.sleep(0.01)
        assert sorted(k for k, _ in lost) == [7, 512, 1099], lost
        causes = dict(lost)
        assert causes[7] == causes[512] == "its agent's connection to the controller closed"
        assert causes[1099].startswith("its agent's connection to the controller broke ("), causes[1099]  # the reset
        assert set(srv.links) == set(range(N)) - {7, 300, 512, 1099}
        assert set(srv.last_seen) == set(srv.links) and refused == []

        # a machine's link comes back after a loss
        socks.update(_connect_all(srv, [7]))
        assert 7 in srv.links

        # an idle poll over ~1,100 links costs O(ready), not O(links): well under a millisecond each
        t0 = time.perf_counter()
        for _ in range(200):
            assert srv.poll() == []
        per_poll = (time.perf_counter() - t0) / 200
        print(f"idle poll over {len(srv.links)} links: {1e6 * per_poll:.0f} us")
        assert per_poll < 0.005, per_poll
    finally:
        for s in socks.values():
            s.close()
        srv.close()


def test_lines_both_ways_last_seen_and_junk_refused_by_name():
    refused = []
    srv = link.LinkServer("127.0.0.1", TOKEN, on_refused=lambda what, why: refused.append((what, why)))
    socks = {}
    try:
        socks = _connect_all(srv, [1, 2, 3])
        a1 = link.AgentLink(socks[1])
        a2 = link.AgentLink(socks[2], on_refused=lambda what, why: refused.append((what, why)))
        seen0 = dict(srv.last_seen)
        assert set(seen0) == {1, 2, 3}
        assert srv.lines(1) == [] and srv.inbox == {}

        time.sleep(0.01)
        assert a1.send(b"exit w0 pid 123 code 0") and a1.send(b"beat 5")
        _until(srv, lambda: len(srv.inbox.get(1, [])) == 2, "machine 1's lines did not arrive")
        assert srv.last_seen[1] > seen0[1] and srv.last_seen[2] == seen0[2]
        assert srv.lines(1) == [b"exit w0 pid 123 code 0", b"beat 5"] and srv.lines(1) == []

        # a keepalive (an empty line) refreshes last_seen and files nothing
        before = srv.last_seen[2]
        time.sleep(0.01)
        socks[2].sendall(b"\n")
        _until(srv, lambda: srv.last_seen[2] > before, "the keepalive did not refresh last_seen")
        assert 2 not in srv.inbox

        # junk from machine 2: an over-long line (in pieces), a non-ASCII line; then a good one
        socks[2].sendall(b"x" * 200)
        time.sleep(0.05)
        assert srv.poll() == []  # the server holds the first piece
        socks[2].sendall(b"y" * 200 + b"z" * 100 + b"\n" + "caf\u00e9\n".encode() + b"ok after junk\n")
        a3_before = srv.last_seen[3]
        _until(srv, lambda: srv.inbox.get(2) == [b"ok after junk"], "machine 2's good line after junk was lost")
        whats = [w for w, _ in refused]
        assert whats == ["link line from machine 2", "link line from machine 2"], refused
        assert f"over {link._MAX_LINE} bytes" in refused[0][1] and "not printable ASCII" in refused[1][1]
        assert set(srv.links) == {1, 2, 3} and srv.last_seen[3] == a3_before  # nobody else touched
        assert 1 not in srv.inbox and 3 not in srv.inbox

        # the controller writes to a machine; the agent reads without blocking
        assert a2.lines() == []
        assert srv.send(2, b"kill w1 9") and srv.send(2, b"stop")
        t0 = time.monotonic()
        got = []
        while len(got) < 2 and time.monotonic() - t0 < 10:
            got += a2.lines()
            time.sleep(0.005)
        assert got == [b"kill w1 9", b"stop"] and a1.lines() == []
        assert not srv.send(99, b"x")  # no such link
        with pytest.raises(ValueError):
            srv.send(2, b"two\nlines")
        with pytest.raises(ValueError):
            srv.send(2, b"x" * (link._MAX_LINE + 1))

        # lines sent just before a clean leave are kept; the leave is no loss
        assert a1.send(b"last words")
        a1.leave()
        _until(srv, lambda: 1 not in srv.links, "machine 1's leave was not seen")
        assert srv.lines(1) == [b"last words"] and 1 not in srv.last_seen
        assert not srv.send(1, b"x")

        # a send to a link that just died is no crash, and the loss is reported
        socks[3].close()
        lost = []
        _until(srv, lambda: bool(lost), "machine 3's close was not reported", lost=lost)
        assert lost == [(3, "its agent's connection to the controller closed")]
        assert not srv.send(3, b"x")

        # the agent sees the controller go
        srv.close()
        t0 = time.monotonic()
        while not a2.closed and time.monotonic() - t0 < 10:
            a2.lines()
            time.sleep(0.01)
        assert a2.closed and not a2.send(b"x")
    finally:
        for s in socks.values():
            s.close()
        srv.close()


def test_a_pending_connection_that_never_says_hello_is_refused_after_hello_s(monkeypatch):
    monkeypatch.setattr(link, "HELLO_S", 0.2)
    refused = []
    srv = link.LinkServer("127.0.0.1", TOKEN, on_refused=lambda what, why: refused.append(why))
    silent = socket.create_connection(("127.0.0.1", srv.port))
    try:
        _until(srv, lambda: len(srv.pending) == 1, "the connection was not accepted")
        _until(srv, lambda: bool(refused), "the silent connection was not refused", timeout_s=10)
        assert "no hello line" in refused[0] and not srv.pending and not srv.links
        # a link that sends a line in the same segment as its hello gets it filed
        from pitstop.protocol import seal_raw

        raw = socket.create_connection(("127.0.0.1", srv.port))
        box = {}
        th = threading.Thread(target=lambda: box.update(nonce=raw.recv(64)), daemon=True)
        th.start()
        _until(srv, lambda: not th.is_alive(), "no nonce came")
        nonce = box["nonce"].split(b"\n", 1)[0]
        raw.sendall(b"5 " + seal_raw(TOKEN.encode(), "link/5", nonce) + b"\nfirst\n")
        _until(srv, lambda: srv.inbox.get(5) == [b"first"], "the line behind the hello was lost")
        assert 5 in srv.links and len(refused) == 1
        raw.close()
    finally:
        silent.close()
        srv.close()
