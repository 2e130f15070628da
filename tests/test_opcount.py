"""The outside counter of a real job's store operations (pitstop.bench.opcount): which process
and thread an operation is counted under, the window read back from the snapshots, and a real
process, started with the site hook, whose real TCPStore client (and c10d's use of it) is
counted before any pitstop code ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist

from pitstop.bench import opcount


@pytest.mark.parametrize("argv,kind", [
    (["py", "-m", "pitstop.launch.cli", "launch", "--nnodes", "4", "--node-rank", "2", "--", "t.py"], "agent"),
    (["py", "-m", "pitstop.launch.cli", "launch", "--nnodes", "4", "--node-rank", "0", "--", "t.py"], "controller"),
    (["py", "-m", "pitstop.launch.cli", "launch", "--nproc-per-node", "8", "--", "t.py"], "controller"),
    # the script's own flags never make it the launcher
    (["py", "-u", "t.py", "--node-rank", "3", "launch"], "worker"),
    (["py", "-m", "pitstop.launch.node_agent", "--node", "0", "--", "t.py"], "agent"),
    ([".venv/bin/pitstop", "launch", "--node-rank", "1", "--", "t.py"], "agent"),
])
def test_process_kind(argv, kind):
    assert opcount.process_kind(argv) == kind


def test_labels():
    assert opcount.label("controller", "pitstop-watch-x") == "controller"
    assert opcount.label("agent", "MainThread") == "agent"
    assert opcount.label("worker", "pitstop-heartbeat-3") == "heartbeat"
    assert opcount.label("worker", "pitstop-ended-3") == "heartbeat"
    assert opcount.label("worker", "pitstop-watch-ended-r1") == "watch"
    assert opcount.label("worker", "pitstop-commit") == "main"
    assert opcount.label("worker", "MainThread") == "main"


def test_window_takes_what_each_steady_process_counted_between_two_times(tmp_path):
    (tmp_path / "1.json").write_text(json.dumps({"kind": "worker", "snaps": [
        [10.0, {"main.add": 1}], [11.0, {"main.add": 4, "heartbeat.get": 2}], [12.0, {"main.add": 9, "heartbeat.get": 3}]]}))
    (tmp_path / "2.json").write_text(json.dumps({"kind": "agent", "snaps": [[10.5, {"agent.wait": 1}], [12.0, {"agent.wait": 5}]]}))
    # started inside the window: not counted (its start-up is not steady)
    (tmp_path / "3.json").write_text(json.dumps({"kind": "worker", "snaps": [[11.5, {"main.add": 100}], [12.5, {"main.add": 200}]]}))
    (tmp_path / "4.json").write_text("{junk")
    got = opcount.window(sorted(tmp_path.glob("*.json")), 10.6, 12.0)
    assert got == {"worker": {"main.add": 8, "heartbeat.get": 3}, "agent": {"agent.wait": 4}}


@pytest.mark.timeout(120)
def test_a_process_started_with_the_site_hook_counts_its_real_store_clients(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    script = tmp_path / "t.py"
    script.write_text(textwrap.dedent(f"""
        import threading, time
        from datetime import timedelta
        import torch.distributed as dist
        s = dist.TCPStore("127.0.0.1", {server.port}, is_master=False, timeout=timedelta(seconds=30))
        s.set("a", b"1"); s.get("a"); s.add("n", 2); s.wait(["a"])
        c = s.clone()  # another connection, counted alike
        t = threading.Thread(target=lambda: c.check(["a"]), name="pitstop-heartbeat-7"); t.start(); t.join()
        p = dist.PrefixStore("x/", s)  # as c10d wraps it for a group's rendezvous
        p.set("b", b"2")
        time.sleep(0.6)
    """))
    counts = tmp_path / "counts"
    counts.mkdir()
    env = dict(os.environ, PITSTOP_OPCOUNT_DIR=str(counts),
               PYTHONPATH=os.pathsep.join([str(opcount.SITE_DIR), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    files = list(counts.glob("*.json"))
    assert len(files) == 1, files
    d = json.loads(files[0].read_text())
    assert d["kind"] == "worker"
    last = d["snaps"][-1][1]
    assert last == {"main.set": 2, "main.get": 1, "main.add": 1, "main.wait": 1, "heartbeat.check": 1}, last
    # without the variable, the hook installs nothing
    env.pop("PITSTOP_OPCOUNT_DIR")
    out = subprocess.run([sys.executable, "-c", "import torch.distributed as d; print(d.TCPStore.__name__)"],
                         env=env, capture_output=True, text=True, timeout=90)
    assert out.stdout.strip() == "TCPStore", out
