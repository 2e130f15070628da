"""``pitstop demo``: the world-8 Megatron-Core GPT on CPU/gloo with pitstop-owned groups.

For now this is the foundation's job: train ``examples/train_gpt.py`` at tp2 pp2 dp2
and print each step's loss as it arrives. Standby replacement joins it later.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pitstop
from pitstop.errors import PitstopError
from pitstop.launch.local import LocalJob

EXAMPLE = Path(pitstop.__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def run_demo(steps: int, nproc: int, tp: int, pp: int, run_dir: str, timeout: float = 900) -> int:
    from pitstop.layout import ParallelLayout

    layout = ParallelLayout(nproc, tp=tp, pp=pp)  # bad input fails here, before any process starts
    if not EXAMPLE.exists():
        raise PitstopError(f"{EXAMPLE} not found: `pitstop demo` runs from a source checkout (pip install -e .)")
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    loss_file = run / "loss.jsonl"
    loss_file.unlink(missing_ok=True)
    print(f"pitstop demo: training GPT with {layout.describe()} for {steps} steps; logs in {run}/")
    job = LocalJob(run)
    t0 = time.perf_counter()
    ctx = job.start(
        "train",
        [str(EXAMPLE), "--tp", str(tp), "--pp", str(pp), "--steps", str(steps), "--loss-file", str(loss_file), "--pitstop"],
        range(nproc), nproc,
    )
    seen = 0
    try:
        while True:
            res = ctx.wait(timeout=0.5, period=0.1)
            if loss_file.exists():
                lines = loss_file.read_text().splitlines()
                for line in lines[seen:]:
                    rec = json.loads(line)
                    print(f"  step {rec['step']:>3}  loss {rec['loss']:.6f}  grad_norm {rec.get('grad_norm', float('nan')):.4f}")
                seen = len(lines)
            if res is not None:
                break
            if time.perf_counter() - t0 > timeout:
                raise PitstopError(f"demo did not finish in {timeout:.0f}s\n{job.log_tail(ctx)}")
        if res.is_failed():
            print(job.log_tail(ctx))
            print(f"pitstop demo: FAILED ({sorted(res.failures)} exited non-zero)")
            return 1
    finally:
        job.close()
    print(f"pitstop demo: {seen} steps in {time.perf_counter() - t0:.1f}s, groups owned by pitstop (generation 0)")
    return 0 if seen == steps else 1
