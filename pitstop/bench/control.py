"""``pitstop bench control``: a running job under a stream of junk on every control key.

The fuzzer is what a process on the same machine can do that knows the store's
address but not the job token: write random, truncated, oversized and wrong-type
values, and replay sealed values it read, onto every key name of
:mod:`pitstop.runtime.keys`. The job must finish bitwise identical to an
uninterrupted run and still replace a rank killed meanwhile; every junk message
that anybody read must have been refused.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from pitstop.launch.events import CONTROLLER, ROSTER
from pitstop.runtime import keys

log = logging.getLogger(__name__)


def _junk(rng: random.Random, stolen: List[bytes]) -> bytes:
    kind = rng.randrange(8)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))      # random bytes
    if kind == 1:
        return b"ps1." + bytes(rng.choice(b"0123456789abcdef") for _ in range(rng.randrange(0, 70)))  # truncated envelope
    if kind == 2:
        return b"x" * (300 * 1024)                                                  # oversized
    if kind == 3:                                                                   # wrong type, unsigned
        return json.dumps(rng.choice([[1, 2], "ok", 7, None, {"role": "5"}, {"n": -1}, {"fallback": True}])).encode()
    if kind == 4:                                                                   # the old plain protocol
        return rng.choice([b"1", b"ok", b"switch", b"0:5:1.0", b'{"role": 0, "generation": 1, "mode": "recover"}'])
    if kind == 5 and stolen:                                                        # a sealed value, replayed elsewhere
        return rng.choice(stolen)
    if kind == 6 and stolen:                                                        # a sealed value, truncated
        s = rng.choice(stolen)
        return s[: rng.randrange(1, max(2, len(s)))]
    return b"ps1." + b"0" * 64 + b"." + json.dumps({"role": 0, "generation": 1, "mode": "recover"}).encode()  # forged MAC


def fuzz_store(host: str, port: int, seconds: float, seed: int = 0, period_s: float = 0.05,
               stop: Optional[threading.Event] = None) -> Dict[str, int]:
    """Write junk onto every key of ``keys.all_patterns()`` for ``seconds`` (bounded, then stops).

    Values already in the store are read first and replayed onto other keys, or back
    onto their own key later (a stale heartbeat). Returns how many writes of each kind.

    Each round writes the next 40 keys of one shuffled order of every name, so every key
    gets junk once in each sweep of ``len(names) / 40`` rounds (about a second here): which
    keys were hit does not depend on the luck of a random sample, only on how long the
    fuzzer runs (``sweeps`` counts the full passes)."""
    import torch.distributed as dist

    st = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    rng = random.Random(seed)
    names = keys.all_patterns()
    stolen: List[bytes] = []
    counts = {"writes": 0, "replays": 0, "rounds": 0, "sweeps": 0}
    order = rng.sample(names, len(names))
    at = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        try:
            chunk = order[at:at + 40]
            at += len(chunk)
            if at >= len(order):
                at = 0
                counts["sweeps"] += 1
            for k in chunk:
                if st.check([k]):
                    v = st.get(k)
                    if v.startswith(b"ps1.") and len(stolen) < 200:
                        stolen.append(bytes(v))
                v = _junk(rng, stolen)
                if v in stolen:
                    counts["replays"] += 1
                st.set(k, v)
                counts["writes"] += 1
        except (RuntimeError, OSError) as exc:  # DistNetworkError: the job ended and its store with it
            counts["store_gone"] = 1
            log.info("fuzzer: the store went away after %d writes: %s", counts["writes"], str(exc).splitlines()[0])
            break
        counts["rounds"] += 1
        time.sleep(period_s)
    return counts


def bench_control(run_dir: str = "runs/bench-control", steps: int = 10, fuzz_s: float = 60.0,
                  parts: Tuple[str, ...] = ("fuzz", "restart", "etcd"), etcd_endpoint: Optional[str] = None) -> Dict:
    """``fuzz``: one world-8 job with a standby, a SIGKILL at step 4 and the fuzzer running,
    against an uninterrupted run of the same job. ``restart``: the controller SIGKILLed
    while an etcd-backed job trains, then a rank (:func:`controller_restart`). ``etcd``:
    the same job on etcd and on the embedded store (:func:`bench_etcd`). Without
    ``etcd_endpoint`` an etcd of its own is started (Debian's etcd-server)."""
    from pitstop.launch.runs import run_job, wait_for_event
    from pitstop.runtime.faults import Fault

    root = Path(run_dir)
    out: Dict[str, Any] = {"bench": "control"}
    ref = run_job(root / "reference", steps) if ("fuzz" in parts or "restart" in parts) else None
    if "fuzz" in parts:
        counts: Dict[str, int] = {}

        def during(rd: Path) -> None:
            wait_for_event(rd, "roster")
            info = json.loads((rd / CONTROLLER).read_text())
            counts.update(fuzz_store(info["host"], info["port"], fuzz_s, seed=1))

        fault = Fault.kill(rank=5).at(step=4, phase="backward")
        res = run_job(root / "fuzzed", steps, standby=1, faults=fault.spec(), during=during,
                      launch_args=["--hold-for-warm", "30"])
        replaced = [e for e in res.of("replaced") if e.get("role") == 5]
        same = (res.code == 0 and ref.code == 0 and len(res.losses) == steps
                and all(res.losses.get(s) == ref.losses.get(s) for s in range(1, steps + 1))
                and res.checksums == ref.checksums)
        refused = res.of("refused")
        out["fuzz"] = {
            "messages": counts.get("writes", 0), "replays": counts.get("replays", 0),
            "refused": len(refused), "refused_keys": len({e["key"] for e in refused}),
            "job_ok": bool(same and replaced), "replaced": len(replaced),
            "loss_identical": bool(same), "exit_code": res.code}
    if "restart" in parts or "etcd" in parts:
        from pitstop.launch.etcd_server import EtcdServer

        server = None if etcd_endpoint else EtcdServer(root / "etcd").start()
        endpoint = etcd_endpoint or server.endpoint
        try:
            if "restart" in parts:
                long_steps = max(steps, 40)  # the controller's restart (a Python start) spans many steps
                long_ref = ref if long_steps == steps else run_job(root / "reference-long", long_steps)
                cr, res = controller_restart(root / "controller-restart", endpoint, long_steps, kill_role=5)
                cr["loss_identical"] = bool(res.code == 0 and long_ref.code == 0 and res.losses == long_ref.losses
                                            and len(res.losses) == long_steps and res.checksums == long_ref.checksums)
                cr["exit_code"] = res.code
                out["controller_restart"] = cr
            if "etcd" in parts:
                out["etcd"] = bench_etcd(root / "etcd-runs", endpoint, steps=max(steps, 12))
        finally:
            if server is not None:
                server.stop()
    return out


class CommitClock:
    """When each step's loss line appeared in ``loss.jsonl`` (polled every 10 ms, in a thread)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "loss.jsonl"
        self.times: List[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                n = sum(1 for _ in self.path.open()) if self.path.exists() else 0
            except OSError:
                n = len(self.times)
            now = time.time()
            while len(self.times) < n:
                self.times.append(now)
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def longest_gap(self, t0: float, t1: float) -> Tuple[float, int]:
        """(the longest wait for a commit that ended in (t0, t1], commits in (t0, t1])."""
        gaps, n = [], 0
        for a, b in zip(self.times, self.times[1:]):
            if t0 < b <= t1:
                gaps.append(b - max(a, t0))
                n += 1
        return (max(gaps) if gaps else t1 - t0), n


def controller_restart(run_dir: Path, endpoint: str, steps: int, kill_role: int, nproc: int = 8,
                       gpt: Optional[List[str]] = None) -> Tuple[Dict[str, Any], Any]:
    """One etcd-backed job with a standby: at step 6 the controller is SIGKILLed; its supervisor
    starts it again and it re-attaches; then the process of ``kill_role`` is SIGKILLed (a real
    signal, at whatever point of its step it is in) and must be replaced.

    ``training_paused_s`` compares the longest wait for a commit while the controller was
    down with the longest one between steps 2 and 6 of the same run (steps before the
    kill): 0 when training did not wait for the controller."""
    from pitstop.launch.runs import run_job, wait_for_event, wait_for_step

    seen: Dict[str, Any] = {}
    clock: List[CommitClock] = []

    def during(rd: Path) -> None:
        clock.append(CommitClock(rd))
        wait_for_step(rd, 6)
        pid = json.loads((rd / CONTROLLER).read_text())["pid"]
        seen["killed_at"] = time.time()
        os.kill(pid, signal.SIGKILL)
        back = wait_for_event(rd, "controller-resumed", timeout=120)[0]
        seen["back_at"] = back["time"]
        seen["controller_pid"], seen["resumed_pid"] = pid, back["pid"]
        roster = json.loads((rd / ROSTER).read_text())
        seen["victim"] = roster["roles"][kill_role]["pid"]
        seen["role_killed_at"] = time.time()
        try:
            os.kill(seen["victim"], signal.SIGKILL)
        except ProcessLookupError:
            raise RuntimeError(f"role {kill_role}'s process {seen['victim']} had already ended when the controller "
                               f"came back {back['time'] - seen['killed_at']:.1f} s after its kill: the job's "
                               f"{steps} steps outran the restart") from None

    res = run_job(run_dir, steps, standby=1, nproc=nproc, gpt=gpt, during=during, timeout=600,
                  launch_args=["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint])
    c = clock[0] if clock else None
    if c is not None:
        c.stop()
    out: Dict[str, Any] = {"replaced_after_restart": False, "training_paused_s": None}
    if c is not None and "back_at" in seen:
        down_gap, down_steps = c.longest_gap(seen["killed_at"], seen["back_at"])
        before_gap, _ = c.longest_gap(c.times[1] if len(c.times) > 1 else 0.0, seen["killed_at"])
        rep = [e for e in res.of("replaced") if e.get("role") == kill_role and e["time"] > seen["back_at"]]
        out.update(
            controller_down_s=round(seen["back_at"] - seen["killed_at"], 3),
            steps_while_down=down_steps,
            longest_commit_wait_down_s=round(down_gap, 4), longest_commit_wait_before_s=round(before_gap, 4),
            training_paused_s=round(max(0.0, down_gap - before_gap), 4),
            replaced_after_restart=bool(rep), replaced=rep[0] if rep else None,
            controller_pid=seen["controller_pid"], resumed_pid=seen["resumed_pid"],
            controller_lost_events=len(res.of("controller-lost")),
        )
    return out, res


def _steady(res) -> Optional[float]:
    """The median committed step time of a run (steps 3 and later: step 1 builds, 2 warms)."""
    # a joiner's hand-back of steps its role's previous process made final carries no time of its own
    xs = [float(d["step_time_s"]) for d in _loss_lines(res.run_dir) if d["step"] >= 3 and d.get("step_time_s") is not None]
    return statistics.median(xs) if xs else None


def _loss_lines(run_dir: Path) -> List[dict]:
    p = Path(run_dir) / "loss.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def bench_etcd(root: Path, endpoint: str, steps: int = 12) -> Dict[str, Any]:
    """The same world-8 job on the embedded TCPStore and on etcd, side by side: the steady step
    (uninterrupted runs) and a replacement of rank 5 killed in step 4's backward pass."""
    from pitstop.launch.runs import run_job
    from pitstop.runtime.faults import Fault

    etcd_args = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint]
    tcp, etcd = run_job(root / "tcp-steady", steps), run_job(root / "etcd-steady", steps, launch_args=etcd_args)
    fault = Fault.kill(rank=5).at(step=4, phase="backward").spec()
    tcp_f = run_job(root / "tcp-fault", steps, standby=1, faults=fault)
    etcd_f = run_job(root / "etcd-fault", steps, standby=1, faults=fault, launch_args=etcd_args)
    s_tcp, s_etcd = _steady(tcp), _steady(etcd)
    r_tcp = next((e for e in tcp_f.of("replaced") if e.get("role") == 5), None)
    r_etcd = next((e for e in etcd_f.of("replaced") if e.get("role") == 5), None)
    same = all(r.code == 0 for r in (tcp, etcd, tcp_f, etcd_f)) and \
        all(r.losses == tcp.losses and r.checksums == tcp.checksums for r in (etcd, tcp_f, etcd_f))
    return {
        "steady_step_s_tcpstore": s_tcp, "steady_step_s_etcd": s_etcd,
        "steady_overhead_pct": None if not (s_tcp and s_etcd) else round(100.0 * (s_etcd - s_tcp) / s_tcp, 2),
        "unplanned_s": None if r_etcd is None else r_etcd["downtime_s"],
        "unplanned_s_tcpstore": None if r_tcp is None else r_tcp["downtime_s"],
        "ratio_vs_tcpstore": None if not (r_tcp and r_etcd) else round(r_etcd["downtime_s"] / r_tcp["downtime_s"], 3),
        "breakdown_etcd": None if r_etcd is None else {k: r_etcd.get(k) for k in ("detect_s", "plan_s", "groups_s",
                                                                                  "state_s", "first_step_s")},
        "loss_identical": bool(same and r_tcp and r_etcd),
    }
