"""``pitstop bench machines``: machine failures and host drains, side by side in one run.

World 8 (tp2 pp2 dp2) on four "machines" of two processes, one ``pitstop launch`` per
machine, each on its own loopback address; ``4:5`` adds a standby machine. Four jobs:

1. uninterrupted, on one host (the reference losses and checksums);
2. the baseline: no standby, ``--save-interval 2``, rank 5 SIGKILLed in step 4: every
   machine's processes restart from the checkpoint (kill to first finished step);
3. machine 2 (roles 4, 5) SIGKILLed after step 3, the standby machine takes over;
4. ``pitstop drain --host`` of machine 3 onto the standby machine;

plus three overlap cases on the same machines (ranks 1 and 6 killed at once; a joiner
killed during machine 2's recovery; a machine lost with no standby machine left, which
must end in a clear ``failed``). Every time comes from the controller's event log.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List

from pitstop.launch.events import ROSTER
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

    # correlated and overlapping failures, on the machines too
    def roles_pids(d: Path, roles) -> List[int]:
        import json

        roster = json.loads((d / ROSTER).read_text())
        return [roster["roles"][r]["pid"] for r in roles]

    def two_at_once(m) -> None:  # rank 1 (machine 0) and rank 6 (machine 3); the machines stay up
        wait_for_event(m.run_dir, "warmed", n=2, timeout=600)
        wait_for_step(m.run_dir, 3, timeout=600)
        for pid in roles_pids(m.run_dir, (1, 6)):
            os.kill(pid, signal.SIGKILL)

    both = _machines(base / "two-at-once", steps, "4:5", two_at_once, ["--hold-for-warm", "120"])

    def joiner_dies(m) -> None:  # machine 2 lost, then a joiner on the standby machine during the recovery
        wait_for_event(m.run_dir, "warmed", n=2, timeout=600)
        wait_for_step(m.run_dir, 3, timeout=600)
        m.kill_machine(2)
        wait_for_event(m.run_dir, "failure", timeout=120)
        os.kill(roles_pids(m.run_dir, (5,))[0], signal.SIGKILL)

    overlap = _machines(base / "joiner-dies", steps, "4:5", joiner_dies, ["--hold-for-warm", "120", "--save-interval", "2"])

    def no_spare(m) -> None:
        wait_for_step(m.run_dir, 3, timeout=600)
        m.kill_machine(1)

    nospare = _machines(base / "no-standby-machine", steps, "4", no_spare, ["--save-interval", "2", "--no-warmup"])

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
        "two_ranks_on_two_machines_at_once": bool(both.of("replaced")) and _identical(both, ref, steps),
        "joiner_dies_during_a_machines_recovery": bool(overlap.of("fallback")) and _identical(overlap, ref, steps),
        "machine_lost_with_no_standby_machine_fails_clearly": nospare.code == 1 and any(
            "no standby machine is left" in e.get("reason", "") for e in nospare.of("failed")),
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
                              "heartbeat_silent_s": lost.get("silent_s"),
                              "confirmed_after_reported_failure": lost.get("after_reported_failure"),
                              "cause": lost.get("cause"),
                              "heartbeat_timeout_s": 10.0, "plan_s": rep0.get("plan_s"),
                              "groups_s": rep0.get("groups_s"), "state_s": rep0.get("state_s"),
                              "first_step_s": rep0.get("first_step_s"), "rebuilt": rep0.get("rebuilt")}},
            "host_drain": {"pause_s": dr0.get("pause_s"), "steady_iteration_s": dr0.get("steady_iter_s"),
                           "prepare_s": dr0.get("prepare_s"), "roles": dr0.get("roles"),
                           "loss_identical": bool(dr0) and _identical(drained, ref, steps)},
            "overlap": {"cases": len(cases), "passed": sum(cases.values()), "detail": cases}}
