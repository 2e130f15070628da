"""``pitstop bench recovery``: the same world-8 job four ways, side by side in one run.

1. uninterrupted (the reference: losses, checksums, steady iteration time, hook cost);
2. a checkpoint restart as users do it today: one rank killed, every process
   restarted, groups re-initialised, the checkpoint loaded from disk;
3. pitstop's unplanned replacement of the same kill by a standby;
4. pitstop's planned drain of one rank.

Times are taken from the controller's event log, so each is measured the same way:
from the kill (the fault injector stamps the store just before it fires) to the end
of the first step that finished after it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from pitstop.launch.controller import request_drain
from pitstop.launch.runs import JobResult, run_job, wait_for_event, wait_for_step
from pitstop.runtime.faults import Fault

KILL = Fault.kill(rank=5).at(step=4, phase="backward")


def _identical(res: JobResult, ref: JobResult, happened: Optional[str] = None) -> bool:
    """``res`` ended cleanly with the reference's losses and checksums, and, given ``happened``
    (``replaced``, ``drained``), the controller logged that event: a run whose kill or drain never
    took effect also matches the reference, and must not count as a bitwise replacement."""
    return (res.code == 0 and res.losses == ref.losses and res.checksums == ref.checksums
            and (happened is None or bool(res.of(happened))))


def _repeated(repeat: int, restart_job: Callable[[int], JobResult], unplanned_job: Callable[[int], JobResult]
              ) -> Tuple[JobResult, JobResult, List[JobResult], Dict[str, Any]]:
    """Run the checkpoint restart and the warm replacement ``repeat`` times, interleaved (restart
    1, replacement 1, restart 2, ...) so that a drift in the machine's load falls on both.

    Returns the restart run and the replacement run whose times are the lower medians of their
    series (each a run that happened, so its breakdown adds up), every replacement run (whose
    losses the caller checks), and the series of times:
    on a machine this noisy one run can flatter or wrong either side by 2x. ``ratio_pairs`` are
    the per-repeat ratios, each a replacement over the restart run beside it."""
    if repeat < 1:
        raise ValueError(f"repeat({repeat}) must be >= 1")
    restarts: List[JobResult] = []
    replacements: List[JobResult] = []
    for i in range(repeat):
        restarts.append(restart_job(i))
        replacements.append(unplanned_job(i))

    def downtime(res: JobResult, kind: str) -> Optional[float]:
        return (res.of(kind) or [{}])[0].get("downtime_s")

    base = [downtime(r, "restarted") for r in restarts]
    ours = [downtime(r, "replaced") for r in replacements]

    def median_run(runs: List[JobResult], times: List[Optional[float]]) -> JobResult:
        if any(t is None for t in times):  # a run without its event: report that one, as a single run would
            return runs[[t is None for t in times].index(True)]
        m = statistics.median_low(times)
        return runs[times.index(m)]

    series = {
        "n": repeat,
        "baseline_restart_s": base,
        "unplanned_s": ours,
        "ratio_pairs": [None if not (b and u) else round(u / b, 4) for b, u in zip(base, ours)],
    }
    return median_run(restarts, base), median_run(replacements, ours), replacements, series


def _with_repeats(out: Dict[str, Any], series: Dict[str, Any], every_identical: bool) -> Dict[str, Any]:
    """Attach the repeats; with more than one, ``loss_identical`` holds only if every repeat's does."""
    if series["n"] > 1:
        pairs = [r for r in series["ratio_pairs"] if r is not None]
        out["repeats"] = {**series, "ratio_max": max(pairs) if pairs else None,
                          "ratio_min": min(pairs) if pairs else None}
        out["loss_identical"] = out["loss_identical"] and every_identical
    return out


def _summary(ref: JobResult, restart: JobResult, rep: Dict[str, Any], drn: Dict[str, Any],
             identical: bool) -> Dict[str, Any]:
    """The keys both recovery benchmarks report (see BENCHMARKS.md)."""
    import json

    iters = [json.loads(line)["step_time_s"] for line in (ref.run_dir / "loss.jsonl").read_text().splitlines()[1:]]
    steady = statistics.median(iters)
    hook = statistics.mean(s["hook_s"] / max(1, s["steps_committed"]) for s in ref.stats)
    buddy = statistics.mean(s["buddy_s"] / max(1, s["steps_committed"]) for s in ref.stats)
    rst = (restart.of("restarted") or [{}])[0]
    baseline_s, unplanned_s = rst.get("downtime_s"), rep.get("downtime_s")
    return {
        "baseline_restart_s": baseline_s,
        "unplanned_s": unplanned_s,
        "planned_pause_s": drn.get("pause_s"),
        "steady_iteration_s": steady,
        "ratio_unplanned": None if not (baseline_s and unplanned_s) else round(unplanned_s / baseline_s, 4),
        "loss_identical": identical,
        "buddy_copy_bytes": max(s["buddy_bytes"] for s in ref.stats),
        "hook_overhead_pct": round(100 * hook / steady, 3),
        "breakdown": {
            "unplanned": {k: rep.get(k) for k in ("detect_s", "plan_s", "groups_s", "state_s", "first_step_s",
                                                  "joiner_built_s", "joiner_attach_wait_s", "swapped", "stale_refs")},
            "planned": {k: drn.get(k) for k in ("prepare_s", "pause_s", "groups_s", "state_s", "first_step_s",
                                                "swapped", "stale_refs")},
            "restart": {"resume_step": (restart.of("fallback") or [{}])[0].get("resume_step")},
            "hook_per_step_s": round(hook, 5),
            "buddy_exchange_per_step_s": round(buddy, 5),
            "restart_loss_identical": restart.code == 0 and all(restart.losses.get(k) == v for k, v in ref.losses.items()),
        },
    }


def _suffix(i: int) -> str:
    return "" if i == 0 else f"-{i + 1}"


def bench_recovery(steps: int = 8, run_dir: str = "runs/bench-recovery", repeat: int = 1) -> Dict[str, Any]:
    """The world-8 Megatron job; ``repeat`` > 1 runs the restart and the warm replacement that many
    times each, interleaved, and reports the lower medians (see :func:`_repeated`)."""
    base = Path(run_dir) / time.strftime("%Y%m%d-%H%M%S")
    ref = run_job(base / "reference", steps)
    if ref.code != 0:
        raise RuntimeError(f"the reference run failed:\n{ref.tails()}")
    # the same kill twice: a standby warmed by the sandbox (held for at step 1), and a cold one
    restart, unplanned, repeats, series = _repeated(
        repeat,
        lambda i: run_job(base / f"restart{_suffix(i)}", steps, standby=0, faults=KILL.spec(),
                          launch_args=["--save-interval", "2"]),
        lambda i: run_job(base / f"unplanned{_suffix(i)}", steps, standby=1, faults=KILL.spec(),
                          launch_args=["--hold-for-warm", "600"]))
    cold = run_job(base / "unplanned-cold", steps, standby=1, faults=KILL.spec(), launch_args=["--no-warmup"])

    def drain(d: Path) -> None:  # asked for right after the recorded step 1, while the standby warms up
        wait_for_event(d, "recorded", n=2)
        request_drain(d, rank=2)

    planned = run_job(base / "planned", steps, standby=1, during=drain, launch_args=["--hold-for-warm", "30"])

    rep = (unplanned.of("replaced") or [{}])[0]
    rep_cold = (cold.of("replaced") or [{}])[0]
    out = _summary(ref, restart, rep, (planned.of("drained") or [{}])[0],
                   _identical(unplanned, ref, "replaced") and _identical(planned, ref, "drained")
                   and _identical(cold, ref, "replaced"))
    _with_repeats(out, series, all(_identical(r, ref, "replaced") for r in repeats))
    # what the sandboxed warmup takes off the critical path (same kill, same job, cold standby)
    out["breakdown"]["warmup"] = {
        "joiner_warm": rep.get("warm"), "cold_joiner_s": rep_cold.get("downtime_s"), "warm_joiner_s": rep.get("downtime_s"),
        "state_cold_s": rep_cold.get("state_s"), "state_warm_s": rep.get("state_s"),
        "first_iter_cold_s": rep_cold.get("first_iter_s"), "first_iter_warm_s": rep.get("first_iter_s")}
    # what keeping a standby warm costs: its resident memory after the sandbox, beside a worker's
    warmed = [e["rss_bytes"] for e in unplanned.of("warmed") if e.get("ok")]
    out["standby_memory"] = {"warmed_standby_rss_bytes": max(warmed) if warmed else None,
                             "worker_rss_bytes": max((s["rss_bytes"] for s in ref.stats if "rss_bytes" in s), default=None)}
    return {
        **out,
        "job": "world 8 (tp2 pp2 dp2) Megatron-Core GPT on CPU/gloo, 1 standby, kill rank 5 at step 4 (backward), drain rank 2",
        "run_dir": str(base),
    }


#: The DeepSpeed job: world 4, pure data parallel, ZeRO 2 (examples/train_deepspeed.py).
DS_GPT = ["examples/train_deepspeed.py", "--zero-stage", "2", "--checksum"]


def _ds_script(zero_stage: int) -> List[str]:
    """The DeepSpeed example at ``zero_stage``."""
    return [DS_GPT[0], "--zero-stage", str(zero_stage), *DS_GPT[3:]]


DS_KILL = Fault.kill(rank=2).at(step=4, phase="backward")
DS_LAUNCH = ["--heartbeat-timeout", "15"]  # DeepSpeed's import and engine build load two cores for seconds


def bench_recovery_deepspeed(steps: int = 8, run_dir: str = "runs/bench-recovery-deepspeed",
                             zero_stage: int = 2, repeat: int = 1) -> Dict[str, Any]:
    """The same keys as :func:`bench_recovery` plus ``zero_stage``, for a DeepSpeed engine at
    world 4 (ZeRO stage ``zero_stage``, 2 unless asked).

    The baseline is DeepSpeed's own checkpoint restart, as a DeepSpeed user runs it:
    ``engine.save_checkpoint`` every 2 steps, the kill, every process restarted, groups
    and engine built again, ``engine.load_checkpoint``, first finished step (pitstop's
    no-standby fallback with a DeepSpeed job does exactly this). The drain runs with ``--step-delay 0.3`` so the
    job is still running when the standby has built its engine; the delay is not in any
    other run, and the pause it reports does not depend on it.

    The unplanned replacement runs twice, side by side: with a standby warmed in the sandbox
    (it replays rank 0's recorded set-up and step 1; training holds after step 1 until it has,
    ``--hold-for-warm``), whose time is ``unplanned_s``, and with a cold one (``--no-warmup``),
    under ``breakdown.warmup``. ``repeat`` > 1: as :func:`bench_recovery`.
    """
    base = Path(run_dir) / time.strftime("%Y%m%d-%H%M%S")
    gpt = _ds_script(zero_stage)
    ref = run_job(base / "reference", steps, nproc=4, gpt=gpt, launch_args=DS_LAUNCH)
    if ref.code != 0:
        raise RuntimeError(f"the reference run failed:\n{ref.tails()}")
    restart, unplanned, repeats, series = _repeated(
        repeat,
        lambda i: run_job(base / f"restart{_suffix(i)}", steps, standby=0, faults=DS_KILL.spec(), nproc=4, gpt=gpt,
                          launch_args=DS_LAUNCH + ["--save-interval", "2"]),
        lambda i: run_job(base / f"unplanned{_suffix(i)}", steps, standby=1, faults=DS_KILL.spec(), nproc=4, gpt=gpt,
                          launch_args=DS_LAUNCH + ["--hold-for-warm", "600"]))
    cold = run_job(base / "unplanned-cold", steps, standby=1, faults=DS_KILL.spec(), nproc=4, gpt=gpt,
                   launch_args=DS_LAUNCH + ["--no-warmup"])
    drain_steps = max(steps, 24)
    slow = gpt + ["--step-delay", "0.3"]
    ref_slow = run_job(base / "reference-slow", drain_steps, nproc=4, gpt=slow, launch_args=DS_LAUNCH)

    def drain(d: Path) -> None:
        wait_for_step(d, 1)
        request_drain(d, rank=1)

    planned = run_job(base / "planned", drain_steps, standby=1, during=drain, nproc=4, gpt=slow, launch_args=DS_LAUNCH)
    rep = (unplanned.of("replaced") or [{}])[0]
    rep_cold = (cold.of("replaced") or [{}])[0]
    out = _summary(ref, restart, rep, (planned.of("drained") or [{}])[0],
                   _identical(unplanned, ref, "replaced") and _identical(cold, ref, "replaced")
                   and _identical(planned, ref_slow, "drained"))
    _with_repeats(out, series, all(_identical(r, ref, "replaced") for r in repeats))
    warmed = [e for e in unplanned.of("warmed") if e.get("ok")]
    cls = (warmed[0]["classes"] or [{}])[0] if warmed else {}
    out["breakdown"]["warmup"] = {
        "joiner_warm": rep.get("warm"), "cold_joiner_warm": rep_cold.get("warm"),
        "cold_joiner_s": rep_cold.get("downtime_s"), "warm_joiner_s": rep.get("downtime_s"),
        "state_cold_s": rep_cold.get("state_s"), "state_warm_s": rep.get("state_s"),
        "built_cold_s": rep_cold.get("joiner_built_s"), "built_warm_s": rep.get("joiner_built_s"),
        "first_iter_cold_s": rep_cold.get("first_iter_s"), "first_iter_warm_s": rep.get("first_iter_s"),
        "sandbox_s": round(cls["seconds"], 4) if "seconds" in cls else None, "ops_replayed": cls.get("ops"),
        "local_checked": cls.get("local_checked"), "local_equal": cls.get("local_equal")}
    out["standby_memory"] = {"warmed_standby_rss_bytes": max((e["rss_bytes"] for e in warmed), default=None),
                             "worker_rss_bytes": max((s["rss_bytes"] for s in ref.stats if "rss_bytes" in s), default=None)}
    return {
        **out,
        "zero_stage": zero_stage,
        "job": f"world 4 (dp4) DeepSpeed ZeRO-{zero_stage} engine, examples/train_deepspeed.py, CPU/gloo, 1 standby "
               "(warmed in the sandbox; a cold one side by side), "
               "kill rank 2 at step 4 (backward), drain rank 1",
        "run_dir": str(base),
    }


#: The fault matrix: roles by what they are in tp2 pp2 dp2, phases of a step.
MATRIX_ROLES = {"tp-rank": 1, "first-stage": 0, "last-stage": 4, "second-dp-replica": 6}
#: The general-standby matrix: world 6, tp1 pp3 dp2 (stages 0-1, 2-3, 4-5); warmed standbys.
PP3_GPT = ["examples/train_gpt.py", "--tp", "1", "--pp", "3", "--num-layers", "6", "--checksum"]
PP3_ROLES = {"first-stage": 1, "middle-stage": 2, "last-stage": 5}


def bench_faults(steps: int = 10, run_dir: str = "runs/bench-faults", layout: str = "tp2pp2") -> Dict[str, Any]:
    """Every (role, phase) cell of the fault matrix, each a SIGKILL replaced by a standby and
    checked bit for bit against an uninterrupted run: one job per phase, one kill per role.

    ``layout="pp3"`` is the general-standby matrix: world 6 with a middle stage, and the
    standbys have replayed the first-, middle- and last-stage records before the first kill
    (``--hold-for-warm``); a cell also records whether the standby that took it was warm.
    """
    from pitstop.runtime.faults import STEP_PHASES, Faults

    if layout not in ("tp2pp2", "pp3"):
        raise ValueError(f"layout {layout!r}: expected tp2pp2 or pp3")
    pp3 = layout == "pp3"
    roles = PP3_ROLES if pp3 else MATRIX_ROLES
    kw: Dict[str, Any] = dict(nproc=6, gpt=PP3_GPT) if pp3 else {}
    base = Path(run_dir) / time.strftime("%Y%m%d-%H%M%S")
    ref = run_job(base / "reference", steps, launch_args=["--no-warmup"], **kw)
    if ref.code != 0:
        raise RuntimeError(f"the reference run failed:\n{ref.tails()}")
    cells = []
    for phase in STEP_PHASES:
        faults = Faults(Fault.kill(rank).at(step=2 + 2 * i, phase=phase) for i, rank in enumerate(roles.values()))
        args = ["--heartbeat-timeout", "10"]  # 10-12 processes on few cores: no false hangs
        res = run_job(base / phase, steps, standby=len(roles), faults=faults.spec(),
                      launch_args=args + (["--hold-for-warm", "600"] if pp3 else []), **kw)
        identical = _identical(res, ref)
        replaced = {e["role"]: e for e in res.of("replaced")}
        for name, rank in roles.items():
            ev = replaced.get(rank, {})
            cells.append({"role": name, "rank": rank, "phase": phase, "replaced": bool(ev), "warm": ev.get("warm"),
                          "downtime_s": ev.get("downtime_s"), "bitwise": identical and bool(ev)})
    job = ("world 6 (tp1 pp3 dp2) GPT, 3 standbys warmed on the first, middle and last stage records, "
           "one job per phase killing 3 roles at steps 2, 4, 6") if pp3 else \
        "world 8 (tp2 pp2 dp2) GPT, 4 standbys, one job per phase killing 4 roles at steps 2, 4, 6, 8"
    return {
        "cells": cells,
        "passed": sum(c["bitwise"] for c in cells),
        "warm": sum(bool(c["warm"]) for c in cells),
        "total": len(cells),
        "layout": layout,
        "job": job,
        "run_dir": str(base),
    }
