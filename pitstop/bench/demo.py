"""``make demo``: the main job. World-8 Megatron-Core GPT (tp2 pp2 dp2) on CPU, one standby.

1. an uninterrupted run of the same job, for comparison;
2. the pitstop run: after step 1 (recorded) the standby replays it in its sandbox; rank 5 is
   SIGKILLed in the backward pass of step 3 and the warmed standby takes over; after step 6
   rank 2 is drained to a standby (the pool refills);
3. the same job on machines: one ``pitstop launch`` per machine, four machines of two ranks
   and two standby machines, each on its own loopback address (127.0.0.2 ... 127.0.0.7);
   machine 2 is SIGKILLed (its agent's process group) and a standby machine takes its two
   roles, then machine 3 is drained onto the other standby machine;
4. a summary: each event's downtime, the groups rebuilt and kept, and whether every
   step's loss and every rank's final parameters matched the uninterrupted run bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path

from pitstop.launch.events import EVENTS
from pitstop.launch.controller import request_drain
from pitstop.launch.runs import machine_addr, run_job, start_machines, wait_for_event, wait_for_step
from pitstop.runtime.faults import Fault


def run_demo(steps: int = 80, run_dir: str = "runs/demo") -> int:
    base = Path(run_dir) / time.strftime("%Y%m%d-%H%M%S")
    print(f"pitstop demo: world 8 (tp2 pp2 dp2) Megatron-Core GPT on CPU, {steps} steps; runs in {base}", flush=True)
    print("  [1/3] uninterrupted run ...", flush=True)
    ref = run_job(base / "uninterrupted", steps)
    if ref.code != 0:
        print(ref.tails())
        return 1
    drain_after = 6
    kill = Fault.kill(rank=5).at(step=min(3, steps), phase="backward")
    print(f"  [2/3] pitstop run: kill rank 5 at step {kill.step} ({kill.phase}), drain rank 2 after step {drain_after} ...",
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
    print(f"  events: {base / 'pitstop' / EVENTS}   (pitstop status --run-dir {base / 'pitstop'})")
    ok = same and bool(res.of("replaced")) and bool(res.of("drained"))
    return 0 if ok and _machines(base / "machines", steps, ref) else 1


def _machines(run_dir: Path, steps: int, ref) -> bool:
    """Step 3: the same job on 4 machines + 2 standby machines, a machine killed and a host drained."""
    print(f"\n  [3/3] on machines: 4 x 2 ranks + 2 standby machines ({machine_addr(0)} ... {machine_addr(5)}); "
          f"machine 2 killed after step 5, machine 3 drained after step 15 ...", flush=True)
    m = start_machines(run_dir, steps, "4:6", launch_args=["--heartbeat-timeout", "10", "--hold-for-warm", "120"])
    try:
        wait_for_event(run_dir, "warmed", n=4, timeout=900)
        wait_for_step(run_dir, 5, timeout=900)
        m.kill_machine(2)
        wait_for_event(run_dir, "replaced", timeout=900)
        wait_for_step(run_dir, 15, timeout=900)
        request_drain(run_dir, host=machine_addr(3))
    finally:
        res = m.wait(1800)
    if res.code != 0:
        print(res.tails())
        return False
    for ev in res.of("machine-lost"):
        print(f"  machine:   machine {ev['node']} lost ({ev.get('cause') or 'agent silent'}), roles {ev['roles']}")
    for ev in res.of("replaced"):
        print(f"  unplanned: roles {ev['roles']} {ev['old']} -> {ev['new']} at step {ev['step']}: "
              f"{ev['downtime_s']}s from detection to the first finished step, {ev['rebuilt']} groups rebuilt")
    for ev in res.of("drained"):
        print(f"  planned:   roles {ev['roles']} {ev['old']} -> {ev['new']} after step {ev['step'] - 1}: "
              f"pause {ev['pause_s']}s (steady iteration {ev.get('steady_iter_s')}s)")
    same = res.losses == ref.losses and res.checksums == ref.checksums
    print(f"\n  on machines, loss and parameters identical to the uninterrupted run, bit for bit: {same}")
    print(f"  events: {run_dir / EVENTS}")
    return same and bool(res.of("replaced")) and bool(res.of("drained"))
