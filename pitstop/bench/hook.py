"""``pitstop bench hook``: what pitstop's iteration boundary costs a steady step, side by side.

The same GPT job runs, round after round, these ways on this machine:

1. **plain**: ``torchrun --standalone`` with Megatron's own groups, no pitstop anywhere;
2. **pitstop, commit_interval 1, synchronous** (``--no-async-commit``): ``pitstop launch``,
   and every boundary packs a rollback point, exchanges the buddy copy and waits for the vote;
3. **pitstop, commit_interval 1** (the default, ``async_commit``): the boundary captures the
   RNG streams and a background thread does the rest while the next step runs
   (:mod:`pitstop.runtime.pipeline`);
4. **pitstop, commit_interval K** for each K asked for: a vote every K steps (asynchronous
   too); the boundaries between touch neither the store nor the state.

Three figures per run, because each can mislead alone:

- ``hook_pct``: the time a rank spends inside ``commit()`` (plus the optimizer's wait for a
  pack, with ``async_commit``), per step of the steady range (whole vote windows, step 1 and
  the last step left out), over the steady step. It is measured in the process, so it is not
  drowned in run-to-run noise. Synchronous, it is an upper bound: part of the vote's wait is
  for the slowest rank, which the next step's first collective would wait for anyway.
- ``background_cpu_per_step_s``: the CPU seconds the asynchronous commit's thread spent per
  step. Off the boundary, but on the same cores: on a machine whose cores the step keeps
  busy (this one: no GPU) that work still slows the step; where the step runs on a GPU and
  the CPU waits, it overlaps.
- ``wall_overhead_pct``: the steady step (median over steps after the first 3) against the
  plain run's, median over the rounds. It catches what the others do not (the wrapped
  groups, the heartbeat thread, the controller and agent beside the workers, the background
  thread), but on a 2-core machine it moves by several percent from run to run:
  ``noise_floor_pct`` gives the plain runs' own spread over the rounds, the smallest
  difference it can resolve.

Every variant's losses must equal the synchronous run's bit for bit (``loss_identical_to_sync``).

Last, one run per K pays the price of K: a rank SIGKILLed in a step whose vote is not in yet,
replaced by a warm standby; the whole window since the last committed vote is redone (with
``async_commit``, one step more). Its downtime and ``steps_redone`` are reported, and its
losses and checksums must equal the synchronous run's bit for bit.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from pitstop.launch.runs import ROOT, JobResult, run_job
from pitstop.runtime.faults import Fault

#: (name, world size, flags of examples/train_gpt.py, steps). Steps SKIP+1 .. steps-1 are
#: the steady range: 64 and 128 boundaries, whole windows of K = 1, 2, 4, ..., 64.
JOBS = [
    ("world 8 (tp2 pp2 dp2), 4 processes per core", 8, ["--tp", "2", "--pp", "2"], 68),
    ("world 2 (dp2), one process pinned to each core", 2, ["--pin-core"], 132),
]
SKIP = 3  # the first steps (record, allocator, caches) are not steady
STEADY = 64  # boundaries in the world-8 job's steady range; the world-2 job has twice as many


def check_intervals(intervals: Sequence[int]) -> None:
    """Each K must tile the steady range (else the hook figure counts a partial window) and
    leave room for the kill halfway through its second window."""
    bad = [k for k in intervals if k < 2 or STEADY % k]
    if bad:
        raise ValueError(f"commit intervals {bad}: expected divisors of {STEADY} that are >= 2 "
                         f"(2, 4, 8, 16, 32, 64): each must tile the {STEADY}-step steady range")


def _steady(loss_file: Path) -> float:
    lines = [json.loads(line) for line in loss_file.read_text().splitlines()]
    times = [d["step_time_s"] for d in lines if d["step"] > SKIP and d.get("step_time_s") is not None]
    if len(times) < 5:
        raise RuntimeError(f"{loss_file}: {len(times)} steady steps logged, expected at least 5")
    return statistics.median(times)


def _plain(run_dir: Path, world: int, layout: List[str], steps: int, timeout: float = 600) -> Dict[str, Any]:
    """torchrun, Megatron's own groups: the job as it runs without pitstop."""
    run_dir.mkdir(parents=True, exist_ok=True)
    loss = run_dir / "loss.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "examples/train_gpt.py", *layout, "--megatron-groups", "--steps", str(steps), "--loss-file", str(loss),
           "--data-cache-path", str(run_dir.parent / "data-cache")]
    with open(run_dir / "torchrun.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code != 0:
        raise RuntimeError(f"the plain run failed ({code}):\n" + (run_dir / "torchrun.log").read_text()[-4000:])
    return {"steady_s": _steady(loss)}


def _pitstop(run_dir: Path, world: int, layout: List[str], steps: int, k: int, async_commit: bool = True
             ) -> Dict[str, Any]:
    flags = ["--commit-interval", str(k)] + ([] if async_commit else ["--no-async-commit"])
    res = run_job(run_dir, steps, nproc=world, gpt=["examples/train_gpt.py", *layout, "--checksum"], launch_args=flags)
    if res.code != 0 or len(res.stats) != world:
        raise RuntimeError(f"the pitstop run (commit_interval {k}, async_commit {async_commit}) failed:\n{res.tails()}")
    # the steady boundaries: not the first steps (step 1 votes and finishes the record) nor the
    # last (it always votes); JOBS' step counts make that range whole windows of every K compared
    per_rank = [[x for st, x in s["boundary_s"] if SKIP < st < steps] for s in res.stats]
    hook = statistics.mean(sum(xs) / len(xs) for xs in per_rank)
    background = statistics.mean(s.get("background_cpu_s", 0.0) for s in res.stats) / steps
    return {"steady_s": _steady(run_dir / "loss.jsonl"), "hook_per_step_s": hook,
            "background_cpu_per_step_s": background, "result": res}


#: The variants measured beside the plain run: (JSON key, commit interval, async_commit). The
#: synchronous one is the commit as it was, every boundary waiting for its own vote.
def variants(intervals: Sequence[int]) -> List[tuple]:
    return [("commit_interval_1_sync", 1, False), ("commit_interval_1", 1, True)] + \
        [(f"commit_interval_{k}", k, True) for k in intervals]


def _spread_pct(xs: Sequence[float]) -> float:
    return round(100 * (max(xs) - min(xs)) / statistics.median(xs), 2)


def bench_hook(run_dir: str = "runs/bench-hook", rounds: int = 3, intervals: Sequence[int] = (8, 32),
               jobs: Optional[List[tuple]] = None) -> Dict[str, Any]:
    check_intervals(intervals)
    base = Path(run_dir) / time.strftime("%Y%m%d-%H%M%S")
    ks = [1] + list(intervals)
    vs = variants(intervals)
    out: Dict[str, Any] = {"rows": [], "rounds": rounds, "commit_intervals": ks, "run_dir": str(base)}
    refs: Dict[str, JobResult] = {}
    for name, world, layout, steps in jobs or JOBS:
        runs: Dict[str, List[Dict[str, Any]]] = {"plain": [], **{key: [] for key, _, _ in vs}}
        tag = f"w{world}"
        for r in range(rounds):  # interleaved, so a slow spell of the machine hits every variant
            d = base / tag / f"round{r}"
            runs["plain"].append(_plain(d / "plain", world, layout, steps))
            for key, k, async_commit in vs:
                runs[key].append(_pitstop(d / key, world, layout, steps, k, async_commit))
        # the reference of the kills: the synchronous commit, so the asynchronous one is checked against it
        refs[tag] = runs["commit_interval_1_sync"][0]["result"]
        ref_losses = refs[tag].losses
        plain = statistics.median(x["steady_s"] for x in runs["plain"])
        row: Dict[str, Any] = {"job": name, "world_size": world, "steps": steps,
                               "plain_steady_s": round(plain, 5),
                               "noise_floor_pct": _spread_pct([x["steady_s"] for x in runs["plain"]])}
        for key, k, async_commit in vs:
            steady = statistics.median(x["steady_s"] for x in runs[key])
            hook = statistics.median(x["hook_per_step_s"] for x in runs[key])
            row[key] = {
                "commit_interval": k, "async_commit": async_commit,
                "steady_s": round(steady, 5),
                "spread_pct": _spread_pct([x["steady_s"] for x in runs[key]]),
                "hook_per_step_s": round(hook, 6),
                "hook_pct": round(100 * hook / steady, 3),
                "background_cpu_per_step_s": round(statistics.median(x["background_cpu_per_step_s"] for x in runs[key]), 6),
                "wall_overhead_pct": round(100 * (steady - plain) / plain, 2),
                "loss_identical_to_sync": all(x["result"].losses == ref_losses for x in runs[key]),
            }
        out["rows"].append(row)
    out["recovery"] = [_recovery(base / "w8" / f"kill-k{k}", refs.get("w8"), k) for k in ks]
    return out


def _recovery(run_dir: Path, ref: Optional[JobResult], interval: int) -> Dict[str, Any]:
    """The price of commit_interval K: a kill between votes redoes the window since the last one."""
    name, world, layout, steps = JOBS[0]
    # halfway through the second window (or the last one); at K = 1, a step whose vote runs in the
    # background (step 1 votes at once)
    kill_step = min(interval + interval // 2, steps - 1) if interval > 1 else 6
    fault = Fault.kill(rank=5).at(step=kill_step, phase="backward")
    res = run_job(run_dir, steps, standby=1, nproc=world, gpt=["examples/train_gpt.py", *layout, "--checksum"],
                  faults=fault.spec(), launch_args=["--commit-interval", str(interval), "--hold-for-warm", "600"])
    rep = (res.of("replaced") or [{}])[0]
    happened = res.code == 0 and bool(rep) and rep.get("role") == 5
    identical = happened and ref is not None and res.losses == ref.losses and res.checksums == ref.checksums
    return {"commit_interval": interval,
            "job": f"{name}, commit_interval {interval}, 1 standby, rank 5 SIGKILLed in step {kill_step} (backward)",
            "replaced": happened, "downtime_s": rep.get("downtime_s"), "first_discarded_step": rep.get("step"),
            "steps_redone": rep.get("steps_redone"), "detect_s": rep.get("detect_s"), "groups_s": rep.get("groups_s"),
            "state_s": rep.get("state_s"), "loss_identical": identical}
