"""``pitstop bench machines``: machine failures and host drains, side by side in one run.

World 8 (tp2 pp2 dp2) on four "machines" of two processes, one ``pitstop launch`` per
machine, each on its own loopback address; ``4:5`` adds a standby machine. Four jobs:

1. uninterrupted, on one host (the reference losses and checksums);
2. the baseline: no standby, ``--save-interval 2``, rank 5 SIGKILLed in step 4: every
   machine's processes restart from the checkpoint (kill to first finished step);
3. machine 2 (roles 4, 5) SIGKILLed after step 3, the standby machine takes over;
4. ``pitstop drain --host`` of machine 3 onto the standby machine;

plus the overlap cases on one host (two ranks killed at once; a joiner killed during its
recovery). Every time comes from the controller's event log.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List

from pitstop.launch.runs import JobResult, machine_addr, run_job, start_machines, wait_for_event, wait_for_step
from pitstop.runtime.faults import Fault


def _identical(res: JobResult, ref: JobResult, steps: int) -> bool:
    return (res.code == 0 and all(res.losses.get(s) == ref.losses.get(s) for s in range(1, steps + 1))
            and res.checksums == ref.checksums)


def _machines(run_dir: Path, steps: int, nnodes: str, during, extra: List[str] = (), faults: str = "") -> JobResult:
    m = start_machines(run_dir, steps, nnodes, faults=faults,
                       launch_args=["--heartbeat-timeout", "10", *extra])
    try:
        during(m)
    finally:
        res = m.wait(900)
    return res


def bench_machines(steps: int = 10, run_dir: str = "runs/bench-machines") -> Dict[str, Any]:
    import os
    import signal

    base = Path(run_dir) / time.strftime("%Y%m%d-%H%M%S")
    ref = run_job(base / "reference", steps)
    if ref.code != 0:
        raise RuntimeError(f"the reference run failed:\n{ref.tails()}")

    restart = _machines(base / "restart", steps, "4", lambda m: None, ["--save-interval", "2"],
                        faults=Fault.kill(rank=5).at(step=4, phase="backward").spec())

    t_kill: Dict[str, float] = {}

    def kill_machine(m) -> None:
        wait_for_event(m.run_dir, "warmed", n=2, timeout=600)
        wait_for_step(m.run_dir, 3, timeout=600)
        t_kill["t"] = time.time()
        m.kill_machine(2)

    failure = _machines(base / "machine-failure", steps, "4:5", kill_machine, ["--hold-for-warm", "120"])

    def drain_host(m) -> None:
        from pitstop.launch.controller import request_drain

        wait_for_event(m.run_dir, "recorded", n=2, timeout=600)
        request_drain(m.run_dir, host=machine_addr(3))

    drained = _machines(base / "host-drain", steps, "4:5", drain_host, ["--hold-for-warm", "120"])

    # overlapping and correlated failures, on one host
    def two_at_once(d: Path) -> None:
        import json

        wait_for_event(d, "warmed", n=2)
        wait_for_step(d, 3)
        roster = json.loads((d / "roster.json").read_text())
        for r in (4, 5):
            os.kill(roster["roles"][r]["pid"], signal.SIGKILL)

    both = run_job(base / "two-at-once", steps, standby=2, during=two_at_once, launch_args=["--hold-for-warm", "60"])

    def joiner_dies(d: Path) -> None:
        import json

        wait_for_event(d, "failure")
        os.kill(json.loads((d / "roster.json").read_text())["roles"][6]["pid"], signal.SIGKILL)

    overlap = run_job(base / "joiner-dies", steps, standby=2, during=joiner_dies,
                      faults=Fault.kill(rank=6).at(step=5, phase="backward").spec(),
                      launch_args=["--save-interval", "2", "--no-warmup"])

    rst = (restart.of("restarted") or [{}])[0]
    rep = [e for e in failure.of("replaced") if e.get("roles") == [4, 5]]
    lost = (failure.of("machine-lost") or [{}])[0]
    rep0 = rep[0] if rep else {}
    # kill to first finished step: the controller counts from the moment it saw the machine lost
    down = None
    if rep0.get("downtime_s") is not None and lost.get("time") and t_kill:
        down = round(rep0["downtime_s"] + (lost["time"] - t_kill["t"]), 4)
    dr = [e for e in drained.of("drained") if e.get("roles") == [6, 7]]
    dr0 = dr[0] if dr else {}
    cases = {
        "two_ranks_at_once": bool(both.of("replaced")) and _identical(both, ref, steps),
        "joiner_dies_during_recovery": bool(overlap.of("fallback")) and _identical(overlap, ref, steps),
    }
    return {"bench": "machines", "layout": "world 8, tp2 pp2 dp2, 4 machines x 2 processes (+1 standby machine)",
            "machine_failure": {
                "ranks_lost": lost.get("roles"),
                "downtime_s": down,
                "baseline_restart_s": rst.get("downtime_s"),
                "ratio": None if not (down and rst.get("downtime_s")) else round(down / rst["downtime_s"], 4),
                "loss_identical": bool(rep0) and _identical(failure, ref, steps),
                "standby_machine": sorted({v.split(":")[0] for v in rep0.get("new", {}).values()}) if rep0 else None,
                "baseline_loss_identical": _identical(restart, ref, steps),
                "breakdown": {"detect_s": None if not (lost and t_kill) else round(lost["time"] - t_kill["t"], 4),
                              "heartbeat_silent_s": lost.get("silent_s"), "plan_s": rep0.get("plan_s"),
                              "groups_s": rep0.get("groups_s"), "state_s": rep0.get("state_s"),
                              "first_step_s": rep0.get("first_step_s"), "rebuilt": rep0.get("rebuilt")}},
            "host_drain": {"pause_s": dr0.get("pause_s"), "steady_iteration_s": dr0.get("steady_iter_s"),
                           "prepare_s": dr0.get("prepare_s"), "roles": dr0.get("roles"),
                           "loss_identical": bool(dr0) and _identical(drained, ref, steps)},
            "overlap": {"cases": len(cases), "passed": sum(cases.values()), "detail": cases}}
