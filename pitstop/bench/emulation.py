"""``pitstop bench emulation``: how faithful is emulation, and what does it cost at scale?

**Fidelity** (one row per layout: TP2, PP2, DP2 at world 2, CPU). The ground truth
is a real run of ``examples/train_gpt.py``: two processes, each pinned to its own
core with one thread, exchanging real data over gloo. The emulation is ``pitstop
emulate --world-size 2 --real-ranks 0 --trace-all --fit-network``: its trace phase
*is* that real run (both ranks real and traced; a group whose members are all real
talks over a real gloo communicator), and the network model's link is fitted to the
collectives that run measured. Rank 1 is virtual in the paced and memory phases::

    real (trace)   r0 (core 0) <-- gloo --> r1 (core 1), traced   real_iter_s -> graph, fitted link -> replay
    paced          r0 (core 0), r1 virtual (replayed)             emulated_iter_s
    plain          r0 <-- gloo --> r1, pitstop groups, no tracer  plain_real_iter_s (the tracer's cost)
    memory         real: r0 + r1 --track-memory;  emulated: r0, r1 virtual    *_peak_bytes

Iteration time is rank 0's median loop-body time after the first step (which pays
lazy set-up). Peak bytes come from the tensor tracker in runs of their own, so
counting never slows a timed run.

**Scale**: world 8192, TP8 PP8 DP128, one real rank (0). ``setup_s`` is the
virtualised initialisation (joining the world of 8192 and pitstop's
``initialize_model_parallel``) on that rank; ``overhead_pct`` is what the emulator
adds to the paced step beyond the replayed iteration (the paced step returns at the
replayed times, so any excess is the emulator's own cost); ``emulator_rss_bytes`` is
the real rank's peak resident memory in the paced phase, model included.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from pitstop.launch.emulate import EmulateSpec, emulate
from pitstop.launch.local import run_plain

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "train_gpt.py")

CONFIGS: Dict[str, Dict[str, Any]] = {
    "tp2": {"tp": 2, "pp": 1, "args": ["--tp", "2"]},
    "pp2": {"tp": 1, "pp": 2, "args": ["--pp", "2"]},
    "dp2": {"tp": 1, "pp": 1, "args": []},
}
GOALS = {"avg_error_pct": 0.5, "overhead_pct": 10.0}


def _real(run_dir: Path, name: str, argv: List[str], timeout: float) -> Dict[int, Dict[str, Any]]:
    """A plain world-2 run (no controller): each rank's ``--checksum`` line."""
    return run_plain(run_dir, argv + ["--checksum"], 2, timeout)


def _median_after_first(xs: Sequence[float]) -> float:
    return statistics.median(xs[1:] or xs)


def fidelity_row(run_dir: Path, config: str, steps: int, timeout: float) -> Dict[str, Any]:
    c = CONFIGS[config]
    argv = [SCRIPT, *c["args"], "--steps", str(steps), "--pin-core"]
    d = run_dir / config
    plain = _real(d / "real", "real", argv, timeout)
    real_mem = _real(d / "real-memory", "real-memory", argv + ["--track-memory"], timeout)
    spec = EmulateSpec(2, c["tp"], c["pp"], [0], argv, d / "emulate", trace_ranks=[0, 1], timeout_s=timeout,
                       fit_network=True)
    report = emulate(spec)
    rep = report["ranks"][0]
    real_s = _median_after_first(json.loads((d / "emulate" / "metrics" / "trace-r0.json").read_text())["iter_s"])
    plain_s = _median_after_first(plain[0]["iter_s"])
    err = 100 * (rep["iter_s"] - real_s) / real_s
    return {
        "config": config,
        "real_iter_s": round(real_s, 6),
        "emulated_iter_s": rep["iter_s"],
        "replayed_iter_s": rep["replayed_iter_s"],
        "error_pct": round(abs(err), 3),
        "signed_error_pct": round(err, 3),
        "plain_real_iter_s": round(plain_s, 6),
        "plain_vs_traced_pct": round(100 * (plain_s - real_s) / real_s, 3),
        "fitted_link": report["intra_node_link"],
        "real_peak_bytes": real_mem[0]["peak_tensor_bytes"],
        "emulated_peak_bytes": rep["peak_tensor_bytes"],
        "peak_equal": real_mem[0]["peak_tensor_bytes"] == rep["peak_tensor_bytes"],
        "real_rank1_peak_bytes": real_mem[1]["peak_tensor_bytes"],
    }


def scale_row(run_dir: Path, steps: int, timeout: float) -> Dict[str, Any]:
    world, tp, pp = 8192, 8, 8
    argv = [SCRIPT, "--tp", str(tp), "--pp", str(pp), "--num-layers", str(pp), "--num-heads", "8",
            "--steps", str(steps), "--pin-core"]
    t0 = time.perf_counter()
    report = emulate(EmulateSpec(world, tp, pp, [0], argv, run_dir / "scale", timeout_s=timeout))
    r = report["ranks"][0]
    return {
        "config": f"world {world} tp{tp} pp{pp} dp{world // tp // pp}, real rank 0",
        "setup_s": r["init"]["init_s"],
        "setup_rss_bytes": r["init"]["init_rss_bytes"],
        "groups": r["init"]["groups"],
        "paced_iter_s": r["iter_s"],
        "replayed_iter_s": r["replayed_iter_s"],
        "overhead_pct": round(100 * (r["iter_s"] - r["replayed_iter_s"]) / r["replayed_iter_s"], 3),
        # not circular: operations whose real arrival came after their replayed end, and by how much
        "late_ops": r["paced"]["late_ops"],
        "late_total_s": r["paced"]["late_total_s"],
        "emulator_rss_bytes": r["peak_rss_bytes"],
        "launcher_max_rss_bytes": report["launcher_max_rss_bytes"],
        "peak_tensor_bytes": r["peak_tensor_bytes"],
        "distinct_timelines": report["distinct_timelines"],
        "replay_s": report["replay_s"],
        "tracer_ranks": report["tracer_ranks"],
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def run(run_dir: Path, steps: int = 10, configs: Sequence[str] = tuple(CONFIGS), scale: bool = True,
        timeout: float = 900.0) -> Dict[str, Any]:
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    rows = [fidelity_row(run_dir, c, steps, timeout) for c in configs]
    out: Dict[str, Any] = {"fidelity": rows}
    if rows:
        avg = statistics.mean(r["error_pct"] for r in rows)
        out["fidelity_summary"] = {
            "avg_error_pct": round(avg, 3), "goal_avg_error_pct": GOALS["avg_error_pct"],
            "error_met": avg <= GOALS["avg_error_pct"], "peaks_equal": all(r["peak_equal"] for r in rows),
        }
    if scale:
        s = scale_row(run_dir, steps, timeout)
        s["goal_overhead_pct"] = GOALS["overhead_pct"]
        s["overhead_met"] = s["overhead_pct"] <= GOALS["overhead_pct"]
        out["scale"] = s
    out["gpu"] = None  # filled only where a GPU ran it (see BENCHMARKS.md)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def main(run_dir: str, steps: int, configs: Optional[str], scale: bool) -> Dict[str, Any]:
    names = [c for c in (configs or ",".join(CONFIGS)).split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        from pitstop.errors import ConfigError

        raise ConfigError(f"--configs: unknown {bad}; expected a subset of {','.join(CONFIGS)}")
    return run(Path(run_dir), steps, names, scale)
