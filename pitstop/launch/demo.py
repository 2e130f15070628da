"""``make demo``: the main job. World-8 Megatron-Core GPT (tp2 pp2 dp2) on CPU, one standby.

1. an uninterrupted run of the same job, for comparison;
2. the pitstop run: after step 1 (recorded) the standby replays it in its sandbox; rank 5 is
   SIGKILLed in the backward pass of step 3 and the warmed standby takes over; after step 6
   rank 2 is drained to a standby (the pool refills);
3. a summary: each event's downtime, the groups rebuilt and kept, and whether every
   step's loss and every rank's final parameters matched the uninterrupted run bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path

from pitstop.launch.controller import request_drain
from pitstop.launch.runs import run_job, wait_for_step
from pitstop.runtime.faults import Fault


def run_demo(steps: int = 80, run_dir: str = "runs/demo") -> int:
    base = Path(run_dir) / time.strftime("%Y%m%d-%H%M%S")
    print(f"pitstop demo: world 8 (tp2 pp2 dp2) Megatron-Core GPT on CPU, {steps} steps; runs in {base}", flush=True)
    print("  [1/2] uninterrupted run ...", flush=True)
    ref = run_job(base / "uninterrupted", steps)
    if ref.code != 0:
        print(ref.tails())
        return 1
    drain_after = 6
    kill = Fault.kill(rank=5).at(step=min(3, steps), phase="backward")
    print(f"  [2/2] pitstop run: kill rank 5 at step {kill.step} ({kill.phase}), drain rank 2 after step {drain_after} ...",
          flush=True)

    def drain(d: Path) -> None:
        wait_for_step(d, drain_after)
        request_drain(d, rank=2)  # waits in the controller until the refilled standby is warm

    # training holds after the recorded step 1 until the standby has replayed it (at most 60 s)
    res = run_job(base / "pitstop", steps, standby=1, faults=kill.spec(), during=drain,
                  launch_args=["--hold-for-warm", "60"])
    if res.code != 0:
        print(res.tails())
        return 1
    print()
    print(f"  {'step':>4}  {'uninterrupted':>22}  {'with pitstop':>22}")
    events = {e["step"] for e in res.of("replaced") + res.of("drained")}
    for s in sorted(ref.losses):
        a, b = ref.losses[s], res.losses.get(s)
        if a == b and s not in events and s not in (1, len(ref.losses)) and s % 10:
            continue  # a compact table: first, last, every 10th, each event's step, any difference
        print(f"  {s:>4}  {float.fromhex(a):>22.9f}  {float.fromhex(b) if b else float('nan'):>22.9f}  {'==' if a == b else '!='}")
    print()
    for ev in res.of("replaced"):
        print(f"  unplanned: role {ev['role']} ({ev['old']} -> {ev['new']}) at step {ev['step']}: downtime {ev['downtime_s']:.2f}s "
              f"(detect {ev['detect_s']}s, plan {ev['plan_s']}s, groups {ev['groups_s']}s, state {ev['state_s']}s, "
              f"first step {ev['first_step_s']}s); {ev['rebuilt']} groups rebuilt on the busiest rank, "
              f"{ev['ranks_rebuilding']} of 8 ranks rebuilt anything; the standby was "
              f"{'warmed in the sandbox' if ev.get('warm') else 'cold'}, its first iteration took {ev.get('first_iter_s')}s")
    for ev in res.of("warmed"):
        ok = [c["cls"] for c in ev["classes"] if c["ok"]]
        what = f"replayed the {', '.join(ok)} stage record(s)" if ok else "replayed no record"
        why = {"": "complete", "interrupted": "it got a role first"}.get(ev["stopped"], ev["stopped"])
        print(f"  warmup:    standby pid {ev['pid']} {what} ({why}); resident {ev['rss_bytes'] / 2**20:.0f} MiB")
    for ev in res.of("drained"):
        print(f"  planned:   role {ev['role']} ({ev['old']} -> {ev['new']}) after step {ev['step'] - 1}: pause {ev['pause_s']}s "
              f"(prepared in the background in {ev['prepare_s']}s; first step after {ev['first_step_s']}s)")
    same = res.losses == ref.losses and res.checksums == ref.checksums
    print(f"\n  loss and parameters identical to the uninterrupted run, bit for bit: {same}")
    print(f"  events: {base / 'pitstop' / 'events.jsonl'}   (pitstop status --run-dir {base / 'pitstop'})")
    return 0 if same and res.of("replaced") and res.of("drained") else 1
