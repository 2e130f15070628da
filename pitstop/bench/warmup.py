"""``pitstop bench warmup``: how fast is a joiner's first iteration, cold and after the sandbox?

Four runs of the same world-8 job, in one invocation, eager and ``--compile``:

    cold   --no-warmup: no record, the standby waits idle, then builds and runs its role
    warm   default:     rank 0 / 4 record iteration 1, the standby replays each stage kind

In each, the fault injector SIGKILLs role 5 (last pipeline stage) in the forward pass
of step 3, and a standby takes over; in the warm run training holds after the
recorded step 1 until the standby has replayed it (``--hold-for-warm``), so the same
kill meets a warm standby (with ``--compile`` the sandbox compiles too). The controller's
``replaced`` event carries the joiner's first iteration and the stayers' steady
iteration time measured in the same job, so every ratio compares two numbers of one
run on the same noisy machine.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from pitstop.launch.runs import JobResult, run_job
from pitstop.runtime.faults import Fault

ROLE = 5


def _job(d: Path, steps: int, warm: bool, compile_: bool) -> JobResult:
    fault = Fault.kill(rank=ROLE).at(step=3, phase="forward")
    return run_job(d, steps, standby=1, faults=fault.spec(), timeout=1800,
                   launch_args=["--hold-for-warm", "1200"] if warm else ["--no-warmup"],
                   script_args=["--compile"] if compile_ else [],
                   env={"TORCH_LOGS": "recompiles"} if compile_ else None)


#: dynamo's recompile line (``TORCH_LOGS=recompiles``): glog's date and time, the pid, the function.
_RECOMPILE = re.compile(r"[VIWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d(?:\.\d+)?) +(\d+) .*\[__recompiles\] "
                        r"Recompiling function (\S+)")


def recompiles_after(run_dir: Path, t: float, joiner_pid: Optional[int]) -> Dict[str, Any]:
    """dynamo's recompiles that a job's processes logged after time ``t`` (the failure), the
    joiner's (``joiner_pid``) apart from the stayers'. A recompile there is compilation on
    the replacement's critical path: a guard that the new groups or the joiner's own state
    failed (before groups had stable names, every one on ``group_name``)."""
    import datetime

    year = datetime.datetime.fromtimestamp(t).year
    joiner, stayers, where = 0, 0, []
    for log in sorted((run_dir / "logs").glob("*/*/attempt_*/*/stderr.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = _RECOMPILE.search(line)
            if m is None:
                continue
            mo, d, h, mi, sec, pid, fn = m.groups()
            when = datetime.datetime(year, int(mo), int(d), int(h), int(mi)).timestamp() + float(sec)
            if when <= t:
                continue
            if joiner_pid is not None and int(pid) == joiner_pid:
                joiner += 1
            else:
                stayers += 1
            where.append(f"{log.relative_to(run_dir / 'logs').parts[0]}: {fn}")
    return {"joiner": joiner, "stayers": stayers, "functions": where[:10]}


def _pid(proc: Any) -> Optional[int]:
    """The pid of a ``replaced`` event's ``new`` process (``host:pid``)."""
    try:
        return int(str(proc).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def _summary(cold: JobResult, warm: JobResult, compiled: bool = False) -> Dict[str, Any]:
    def first(res: JobResult) -> Dict[str, Any]:
        ev = res.of("replaced")
        return ev[0] if ev else {}

    c, w = first(cold), first(warm)
    warmed = (warm.of("warmed") or [{}])[0]
    recorded = warm.of("recorded")

    def joiner(res: JobResult) -> Dict[str, Any]:  # the new process of ROLE: its first vs its median iteration
        return next((s for s in res.stats if s["rank"] == ROLE and s.get("steps_committed", 0) < res_steps(res)), {})

    def ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
        return round(x / y, 3) if x and y else None

    jc, jw = joiner(cold), joiner(warm)
    steady = jw.get("median_iter_s")

    worker_rss = [s.get("rss_bytes") for s in warm.stats if s.get("rss_bytes")]
    failed = warm.of("failure")
    recompiles = (recompiles_after(warm.run_dir, failed[0]["time"], _pid(w.get("new")))
                  if compiled and failed else None)
    return {
        "steady_iter_s": steady,
        "cold_first_iter_s": jc.get("first_iter_s"),
        "warm_first_iter_s": jw.get("first_iter_s"),
        "ratio_warm": ratio(jw.get("first_iter_s"), steady),
        "ratio_cold": ratio(jc.get("first_iter_s"), jc.get("median_iter_s")),
        "steady_iter_cold_job_s": jc.get("median_iter_s"),
        "record_bytes": sum(r.get("bytes", 0) for r in recorded) or None,
        "standby_rss_bytes": warmed.get("rss_bytes"),
        "worker_rss_bytes": max(worker_rss) if worker_rss else None,
        "warmup_s": round(sum(x.get("seconds", 0) for x in warmed.get("classes", [])), 3) or None,
        "joiner_warm": w.get("warm"),
        "downtime_cold_s": c.get("downtime_s"),
        "downtime_warm_s": w.get("downtime_s"),
        "state_cold_s": c.get("state_s"),
        "state_warm_s": w.get("state_s"),
        "recompiles_after_failure": recompiles,
        "ok": cold.code == 0 and warm.code == 0 and bool(c) and bool(w),
    }


def res_steps(res: JobResult) -> int:
    return max(res.losses) if res.losses else 0


def bench_warmup(steps: int = 20, run_dir: str = "runs/bench-warmup", modes: List[str] = ("eager", "compiled")) -> Dict[str, Any]:
    base = Path(run_dir) / time.strftime("%Y%m%d-%H%M%S")
    out: Dict[str, Any] = {}
    for mode in modes:
        compiled = mode == "compiled"
        cold = _job(base / f"{mode}-cold", steps, warm=False, compile_=compiled)
        warm = _job(base / f"{mode}-warm", steps, warm=True, compile_=compiled)
        out[mode] = _summary(cold, warm, compiled)
    out["run_dir"] = str(base)
    return out
