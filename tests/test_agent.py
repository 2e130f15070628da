"""The agent's view of its processes: exits seen at once (pidfds), and which are dying.

The controller ends a failure's settle window as soon as no other child is dying
(:meth:`pitstop.launch.controller.Controller._gathered`); these tests pin the two facts it
rests on, with real processes and real signals."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from pitstop.launch.agent import PF_EXITING, SIGKILL_BIT, Agent, exiting

pytestmark = pytest.mark.timeout(120)

STAT = "4242 (python3 (w 2)) {state} 1 4242 4242 0 -1 {flags} 0 0 0 0 5 3 0 0 20 0 9 0 1 1 1"
STATUS = "Name:\tpython3\nState:\tS (sleeping)\nSigQ:\t0/1\nSigPnd:\t{pnd}\nShdPnd:\t{shd}\nSigBlk:\t0\n"


def _stat(state: str = "S", flags: int = 0x400040) -> str:
    return STAT.format(state=state, flags=flags)


def _status(pnd: int = 0, shd: int = 0) -> str:
    return STATUS.format(pnd=f"{pnd:016x}", shd=f"{shd:016x}")


def test_exiting_reads_state_flags_and_pending_kill_from_proc_text():
    assert not exiting(_stat(), _status())
    assert not exiting(_stat("R"), _status(pnd=1 << (signal.SIGTERM - 1)))  # a catchable signal is not death
    assert exiting(_stat("Z"), _status())
    assert exiting(_stat("X"), _status())
    assert exiting(_stat(flags=0x400040 | PF_EXITING), _status())
    assert exiting(_stat(), _status(pnd=SIGKILL_BIT))
    assert exiting(_stat(), _status(shd=SIGKILL_BIT | 1))
    assert exiting(None, _status()) and exiting(_stat(), None)  # gone from /proc: gone
    assert not exiting("garbage without a parenthesis", _status())


def _sleeper(agent: Agent, name: str):
    return agent.start(name, ["-c", "import time; time.sleep(600)"], dict(os.environ))


def test_a_kill_wakes_wait_exit_and_the_other_killed_process_counts_as_dying(tmp_path):
    agent = Agent(tmp_path)
    procs = {n: _sleeper(agent, n) for n in ("a", "b", "c")}
    try:
        if not agent.pidfds:
            pytest.skip("no pidfd_open on this kernel/Python: wait_exit falls back to a plain sleep")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
                not open(f"/proc/{p.pid}/cmdline", "rb").read().startswith(sys.executable.encode())
                for p in procs.values()):
            time.sleep(0.05)  # each child is the Python interpreter now, not the fork before exec
        t0 = time.monotonic()
        agent.wait_exit(0.3)
        assert time.monotonic() - t0 >= 0.25  # nobody exited: it slept the whole pause
        assert agent.poll() == [] and agent.dying() == []

        os.kill(procs["a"].pid, signal.SIGKILL)
        os.kill(procs["b"].pid, signal.SIGKILL)
        t0 = time.monotonic()
        agent.wait_exit(20.0)
        assert time.monotonic() - t0 < 10.0, "wait_exit slept on after a child exited"
        seen = {p.name for p in agent.poll()}
        dying = {p.name for p in agent.dying()}
        assert seen, "wait_exit returned but poll saw no exit"
        assert seen | dying == {"a", "b"} and "c" not in dying, (seen, dying)
        while len(seen) < 2:
            agent.wait_exit(1.0)
            seen |= {p.name for p in agent.poll()}
        assert procs["a"].exit == procs["b"].exit == "signal SIGKILL" and procs["c"].running
        assert set(agent.pidfds) == {"c"}  # the exited ones' descriptors are closed
    finally:
        agent.close()
    assert agent.pidfds == {}


#: A process that starts a helper with multiprocessing's ``spawn`` (as Megatron-LM's workers
#: do), writes the helper's pid to argv[1], then either waits or SIGKILLs itself (argv[2]).
HELPER_PARENT = """
import multiprocessing as mp, os, sys, time
def helper():
    time.sleep(600)
if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=helper)
    p.start()
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(p.pid))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    if sys.argv[2] == "crash":
        os.kill(os.getpid(), 9)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.parametrize("how", ["killed by the agent", "killed by itself"])
def test_a_killed_process_takes_the_helpers_it_started_with_it(tmp_path, how):
    """A worker SIGKILLed by the agent (a restart, a hung rank) or by itself (the fault injector)
    must not leave its multiprocessing helpers running: before the agent signalled process
    groups, each such kill in the Megatron-LM lane left a spawned helper (about 0.5 GB) and its
    resource tracker reparented to init."""
    script = tmp_path / "parent.py"
    script.write_text(HELPER_PARENT)
    pidfile = tmp_path / "helper.pid"
    agent = Agent(tmp_path)
    helper = None
    try:
        p = agent.start("w", [str(script), str(pidfile), "crash" if how == "killed by itself" else "wait"],
                        dict(os.environ))
        deadline = time.monotonic() + 60
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        helper = int(pidfile.read_text())
        assert _alive(helper)
        if how == "killed by the agent":
            agent.kill(p)
        while p.running and time.monotonic() < deadline:
            agent.wait_exit(1.0)
            agent.poll()
        assert p.exit == "signal SIGKILL"
        while _alive(helper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(helper), f"the helper (pid {helper}) outlived its parent, {how}"
    finally:
        if helper is not None and _alive(helper):
            os.kill(helper, signal.SIGKILL)
        agent.close()
