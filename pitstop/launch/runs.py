"""Run ``pitstop launch`` on the world-8 GPT as a real subprocess and read back what it did.

Shared by the tier-3 tests, the recovery benchmark and the demo.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from pitstop.launch.events import EVENTS

ROOT = Path(__file__).resolve().parents[2]
PITSTOP = [sys.executable, "-m", "pitstop.launch.cli"]
GPT = ["examples/train_gpt.py", "--tp", "2", "--pp", "2", "--checksum"]


def _data_cache(script: List[str], run_dir: Path) -> List[str]:
    """``--data-cache-path`` for the GPT script, as a Megatron-LM user passes it: the dataset's
    index files are built once, and a restart or a joiner loads them instead of rebuilding."""
    if script and script[0].endswith("train_gpt.py") and "--data-cache-path" not in script:
        return ["--data-cache-path", str(run_dir / "data-cache")]
    return []


@dataclass
class JobResult:
    run_dir: Path
    code: int
    losses: Dict[int, str] = field(default_factory=dict)
    """step -> loss_hex of the committed steps, as logged."""
    checksums: Dict[int, str] = field(default_factory=dict)
    """rank -> param_sha256 printed at the end by the process that plays the role."""
    events: List[dict] = field(default_factory=list)
    stats: List[dict] = field(default_factory=list)

    def of(self, kind: str) -> List[dict]:
        return [e for e in self.events if e["event"] == kind]

    def tails(self, n: int = 25) -> str:
        out = [f"=== pitstop launch exit {self.code}; events:"] + [json.dumps(e)[:400] for e in self.events]
        for path in sorted(glob.glob(str(self.run_dir / "logs" / "*" / "*" / "attempt_0" / "0" / "*.log"))):
            lines = [l for l in Path(path).read_text(errors="replace").splitlines() if "Warning" not in l and "warn" not in l]
            out.append(f"----- {path}")
            out.extend(lines[-n:])
        launcher = self.run_dir / "launcher.log"
        if launcher.exists():
            out.append("----- launcher")
            out.extend(launcher.read_text(errors="replace").splitlines()[-n:])
        return "\n".join(out)


def run_job(run_dir: Path, steps: int, standby: int = 0, faults: str = "", launch_args: Optional[List[str]] = None,
            during: Optional[Callable[[Path], None]] = None, timeout: float = 600,
            script_args: Optional[List[str]] = None, nproc: int = 8, gpt: Optional[List[str]] = None,
            env: Optional[Dict[str, str]] = None, wrap: Optional[List[str]] = None) -> JobResult:
    """Launch, optionally act on the running job (``during(run_dir)``), wait for the end.
    ``gpt`` replaces the default script and layout (``GPT``); ``env`` adds to the job's
    environment (``TORCH_LOGS``); ``wrap`` goes in front of the launcher's command (a test
    that runs the whole job inside a namespace of its own)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    loss_file = run_dir / "loss.jsonl"
    cmd = (wrap or []) + PITSTOP + ["launch", "--nproc-per-node", str(nproc), "--standby", str(standby), "--run-dir", str(run_dir)]
    cmd += (launch_args or []) + ["--"] + (gpt or GPT) + ["--steps", str(steps), "--loss-file", str(loss_file)] \
        + _data_cache(gpt or GPT, run_dir) + (script_args or [])
    job_env = dict(os.environ, **(env or {}), PITSTOP_FAULT=faults)
    with open(run_dir / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=job_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if during is not None:
                during(run_dir)
            code = proc.wait(timeout=max(1.0, timeout))
        except BaseException:
            proc.kill()
            proc.wait()
            res = collect(run_dir, -9)
            print(res.tails())
            raise
    return collect(run_dir, code)


def collect(run_dir: Path, code: int) -> JobResult:
    res = JobResult(run_dir, code)
    lf = run_dir / "loss.jsonl"
    if lf.exists():
        for line in lf.read_text().splitlines():
            d = json.loads(line)
            seen = res.losses.setdefault(d["step"], d["loss_hex"])
            if seen != d["loss_hex"]:  # a step logged twice (a joiner's hand-back) must agree
                res.losses[d["step"]] = f"logged twice, differently: {seen} then {d['loss_hex']}"
    ev = run_dir / EVENTS
    if ev.exists():
        res.events = [json.loads(l) for l in ev.read_text().splitlines() if l.strip()]
    for path in glob.glob(str(run_dir / "logs" / "*" / "*" / "attempt_0" / "0" / "stdout.log")):
        for line in Path(path).read_text(errors="replace").splitlines():
            if line.startswith("{") and "param_sha256" in line:
                d = json.loads(line)
                res.checksums[d["rank"]] = d["param_sha256"]
                res.stats.append(d)
    return res


def wait_for_event(run_dir: Path, kind: str, n: int = 1, timeout: float = 300) -> List[dict]:
    """Block until the controller logged ``n`` events of ``kind``; returns them."""
    ev = run_dir / EVENTS
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ev.exists():
            found = [d for d in (json.loads(l) for l in ev.read_text().splitlines() if l.strip()) if d.get("event") == kind]
            if len(found) >= n:
                return found
        time.sleep(0.2)
    raise AssertionError(f"no {n} '{kind}' event(s) within {timeout}s in {run_dir}")


def wait_for_step(run_dir: Path, step: int, timeout: float = 300) -> None:
    lf = run_dir / "loss.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lf.exists() and sum(1 for _ in lf.read_text().splitlines()) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} was not logged within {timeout}s in {run_dir}")


@dataclass
class Machines:
    """A job of several ``pitstop launch`` processes, one per "machine", each on its own loopback
    address (127.0.0.2, 127.0.0.3, ...), as a cluster runs one launch per machine."""

    run_dir: Path
    head: subprocess.Popen
    agents: Dict[int, subprocess.Popen]
    logs: List = field(default_factory=list)

    def kill_machine(self, node: int) -> None:
        """A machine failure: SIGKILL of the agent's whole process group (its workers die with it)."""
        import signal

        os.killpg(self.agents[node].pid, signal.SIGKILL)

    def wait(self, timeout: float) -> JobResult:
        try:
            code = self.head.wait(timeout=timeout)
        finally:
            for p in [self.head, *self.agents.values()]:
                if p.poll() is None:
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(p.pid, 9)
                        p.wait()
            for f in self.logs:
                f.close()
        return collect(self.run_dir, code)


def machine_addr(node: int) -> str:
    return f"127.0.0.{2 + node}"


def start_machines(run_dir: Path, steps: int, nnodes: str = "4:5", nproc: int = 2, launch_args: Optional[List[str]] = None,
                   gpt: Optional[List[str]] = None, faults: str = "", env: Optional[Dict[str, str]] = None) -> Machines:
    """Start the head (node 0, the controller) and one agent per other machine, all as real
    ``pitstop launch`` processes, each in a process group of its own. ``env`` adds to the
    job's environment."""
    import secrets
    import socket

    from pitstop.launch.nodes import Nodes

    nodes = Nodes.parse(nnodes)
    run_dir.mkdir(parents=True, exist_ok=True)
    s = socket.socket()
    s.bind((machine_addr(0), 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, **(env or {}), PITSTOP_FAULT=faults, PITSTOP_JOB_TOKEN=secrets.token_hex(32))
    base = PITSTOP + ["launch", "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--run-dir", str(run_dir),
                      "--rdzv-endpoint", f"{machine_addr(0)}:{port}"] + (launch_args or [])
    tail = ["--"] + (gpt or GPT) + ["--steps", str(steps), "--loss-file", str(run_dir / "loss.jsonl")] \
        + _data_cache(gpt or GPT, run_dir)
    logs = []

    def one(k: int) -> subprocess.Popen:
        f = open(run_dir / ("launcher.log" if k == 0 else f"launcher-{k}.log"), "w")
        logs.append(f)
        return subprocess.Popen(base + ["--node-rank", str(k), "--local-addr", machine_addr(k)] + tail, cwd=ROOT,
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    head = one(0)
    agents = {k: one(k) for k in range(1, nodes.max)}
    return Machines(run_dir, head, agents, logs)
