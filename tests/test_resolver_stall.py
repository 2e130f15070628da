"""A resolver that answers late must not get a live process called hung, nor a live store gone.

c10d's store client names both ends of every new socket (``getnameinfo`` on a v4-mapped
``::ffff:127.0.0.1``, which ``/etc/hosts`` does not match), so each new connection asks the
DNS server for a PTR record. Where that answer is lost, the connection waits out the
resolver's timeout (glibc: 5 s). A worker that opened its heartbeat's connection only after
the controller admitted it was silent that long from its admission, and was declared hung
(``silent_s`` 5.0, seen once in a clean clone's junk-storm test, reproduced every time with
30 % of the answers dropped).

The test runs a whole job in a mount namespace whose ``/etc/resolv.conf`` points at a DNS
server of its own that answers every query (NXDOMAIN), 4.5 s late: every new connection takes
4.5 s, longer than the job's heartbeat timeout (4 s, which leaves a loaded 2-core machine
room for an ordinary pause). A server that never answers is no test: after one timeout glibc
fails that process's later lookups at once. It needs root (the namespace, port 53)."""

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from pitstop.launch.runs import run_job

HOLE = "127.3.5.3"  # a loopback address of its own for the slow DNS server
ANSWER_DELAY_S = 4.5
HEARTBEAT_TIMEOUT_S = 4.0
WORLD2 = ["examples/train_gpt.py", "--checksum"]


def _namespaces_work() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _namespaces_work(), reason="needs root and unshare -m (a mount namespace)")


@pytest.fixture
def slow_resolver(tmp_path):
    """A resolv.conf naming a DNS server that answers every query NXDOMAIN ``ANSWER_DELAY_S``
    late, and the command prefix that runs a program with it as /etc/resolv.conf (a private
    mount namespace: nothing else on the machine sees it). Yields (prefix, queries seen)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((HOLE, 53))
    except OSError:
        sock.close()
        raise
    sock.settimeout(0.1)
    seen = []
    due = []  # (when, query, address)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                q, addr = sock.recvfrom(4096)
                if len(q) >= 12:  # a DNS header at least; anything else is not a query
                    seen.append(q)
                    due.append((time.monotonic() + ANSWER_DELAY_S, q, addr))
            except socket.timeout:
                pass
            now = time.monotonic()
            for item in [d for d in due if d[0] <= now]:
                due.remove(item)
                _, q, addr = item
                flags = 0x8000 | (q[2] & 0x01) << 8 | 0x0080 | 0x0003  # a response, RD copied, RA, NXDOMAIN
                try:
                    sock.sendto(q[:2] + flags.to_bytes(2, "big") + q[4:6] + bytes(6) + q[12:], addr)
                except OSError:  # the asker is gone: nothing to answer
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    conf = tmp_path / "resolv.conf"
    conf.write_text(f"nameserver {HOLE}\noptions timeout:{int(ANSWER_DELAY_S) + 3} attempts:1\n")
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(conf)]
    try:
        yield wrap, seen
    finally:
        stop.set()
        t.join()
        sock.close()


def test_the_stall_is_real_a_new_store_connection_waits_the_resolvers_timeout(slow_resolver):
    """The premise, measured: inside the namespace a TCPStore client connection and its clone
    each wait for the late answer, and the server saw the PTR queries."""
    import torch.distributed as dist

    wrap, seen = slow_resolver
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    code = ("import sys, time, torch.distributed as d; t = time.monotonic(); "
            f"s = d.TCPStore('127.0.0.1', {master.port}, is_master=False); t1 = time.monotonic(); "
            "s.clone(); print(t1 - t, time.monotonic() - t1)")
    out = subprocess.run(wrap + [sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    took = [float(x) for x in out.stdout.strip().splitlines()[-1].split()]
    assert min(took) >= ANSWER_DELAY_S - 0.1, (took, out.stderr[-500:])
    assert sum(b"in-addr" in q for q in seen) >= 2, seen


def test_reachable_tells_a_live_store_from_a_dead_or_frozen_one_while_every_lookup_is_late(slow_resolver):
    """``pitstop.store.reachable`` decides whether a worker stops as 'controller lost'. With
    1 s allowed and every answer 4.5 s late, a c10d client alone said False for a live store
    (before the fix). Now: a live store is reachable, a closed port is not (at once), and a
    store whose process is stopped (SIGSTOP: its kernel still accepts) is not either."""
    import signal

    import torch.distributed as dist

    wrap, _ = slow_resolver
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    frozen = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as d; "
                               "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
                               "print(s.port, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        frozen_port = int(frozen.stdout.readline())
        os.kill(frozen.pid, signal.SIGSTOP)
        # os._exit, as a worker leaves after False: the probe of the stopped store is still blocked
        code = ("import os, time; from pitstop.store import reachable; out = []\n"
                f"for port in ({master.port}, {dead}, {frozen_port}):\n"
                "    t = time.monotonic(); out += [reachable(f'127.0.0.1:{port}', 1.0, 6.0), time.monotonic() - t]\n"
                "print(*out, flush=True)\nos._exit(0)")
        out = subprocess.run(wrap + [sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    finally:
        frozen.kill()
        frozen.wait()
    assert out.returncode == 0, out.stderr[-2000:]
    live, t_live, gone, t_gone, stopped, t_stopped = out.stdout.split()
    assert (live, gone, stopped) == ("True", "False", "False"), out.stdout
    assert float(t_live) >= ANSWER_DELAY_S - 0.2, t_live  # it did wait out the late lookup
    assert float(t_gone) < 1.0, t_gone
    assert float(t_stopped) < 1.0 + 6.0 + 1.0, t_stopped  # bounded, though the client itself is not
    master.set("still", "here")
    assert master.get("still") == b"here"


@pytest.mark.timeout(300)
def test_a_job_whose_every_new_connection_stalls_is_never_called_hung(slow_resolver, tmp_path):
    """Each new connection takes 4.5 s, the heartbeat timeout is 4 s: the job still trains to
    the end, and no process is declared hung (before the fix: every worker, at its first beat)."""
    wrap, seen = slow_resolver
    res = run_job(tmp_path / "run", 3, nproc=2, gpt=WORLD2, wrap=wrap,
                  launch_args=["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)], timeout=260)
    assert not res.of("hung"), (res.of("hung"), res.tails())
    assert res.code == 0 and sorted(res.losses) == [1, 2, 3], res.tails()
    # the stall happened: every process's connections asked the slow server (each answer is
    # late by construction, the premise test measures it)
    assert sum(b"in-addr" in q for q in seen) >= 6, len(seen)
