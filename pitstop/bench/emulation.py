"""``pitstop bench emulation``: how faithful is emulation, and what does it cost at scale?

**Fidelity** (one row per job at world 2, CPU). Ground truth and emulation share nothing::

    ground truth   torchrun --nproc-per-node 2 train_gpt.py --megatron-groups --pin-core, R times
                   plain torch.distributed and Megatron's own parallel_state: no pitstop
                   backend, group or tracer; rank 0's median loop-body time per run, then the
                   median over runs (real_median_s) and their spread (real_spread_pct)
    calibration    pitstop calibrate: this machine's gloo costs per (op, group size, bytes),
                   measured by programs of their own before any row runs; the table keeps
                   each entry's mean (the replay sums costs). The same repetitions' medians
                   make a second table, replayed beside it (``replayed_median_table_s``)
                   through ``--what-if topology=``: which statistic predicts better, in one run
    emulation      pitstop emulate --world-size 2 --real-ranks 0 --topology <calibrated>: rank 0
                   real, rank 1 virtual, as a user runs it; nothing is fitted to the run it predicts

``error_pct`` is ``|emulated_s - real_median_s| / real_median_s``. The spread of the real
runs is the noise floor: an error below it cannot be told from noise, and the summary says
whether the floor allows the goal to be measured at all. Peak bytes come from the tensor
tracker in runs of their own (``--track-memory`` on a plain run, the memory phase on the
emulated side).

**Scale**: world 8192, TP8 PP8 DP128, one real rank (0). ``setup_s`` is the
virtualised initialisation (joining the world of 8192 and pitstop's
``initialize_model_parallel``) on that rank; ``overhead_pct`` is what the emulator
adds to the paced step beyond the replayed iteration (the paced step returns at the
replayed times, so any excess is the emulator's own cost); ``late_ops``/``late_total_s``
count the operations whose real arrival came after their replayed end, and by how much;
``emulator_rss_bytes`` is the real rank's peak resident memory in the paced phase, model included.
With a calibrated topology it also carries ``predicted_failure``: ``pitstop emulate --fault
rank=0,step=4`` at 8192 ranks (no real run of that size exists here to compare with).

**What-if**: an emulation recorded at one world (one real rank) replayed at another dp
(``pitstop emulate --what-if dp=N``), against plain torchrun runs of the world it predicts, which
never went through the emulator; ``direct_emulated_s`` is the emulator run at that world itself.

**Failure** (world 2, dp2): ``pitstop emulate --fault rank=1,step=4`` predicts the downtime of
a warmed standby replacing rank 1 (:mod:`pitstop.emulation.failure`), with the detection and
planning times of one real ``pitstop launch`` replacement (the costs run) and everything else
from the calibration and the emulated rank. It is compared with further real replacements of
the same kill that the prediction never saw (median, spread).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from pitstop.launch.emulate import EmulateSpec, emulate

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "train_gpt.py")

CONFIGS: Dict[str, Dict[str, Any]] = {
    "tp2": {"tp": 2, "pp": 1, "args": ["--tp", "2"]},
    "pp2": {"tp": 1, "pp": 2, "args": ["--pp", "2"]},
    "dp2": {"tp": 1, "pp": 1, "args": []},
    # the deeper model: 8 layers, wider, so compute outweighs the per-operation latency
    "tp2-deep": {"tp": 2, "pp": 1, "args": ["--tp", "2", "--num-layers", "8", "--hidden-size", "256"]},
}
GOALS = {"avg_error_pct": 0.5, "overhead_pct": 10.0}
REPEATS = 5
#: Repetitions per calibration entry: a small collective here costs its transfer or that plus a
#: scheduler slice (~3.5 ms), so its mean needs more samples than ``pitstop calibrate``'s default.
CALIBRATION_REPEATS = 60


def median_table(data: Dict[str, Any], stats: Dict[str, Any]) -> Dict[str, Any]:
    """The calibrated topology ``data`` with each table entry's median in place of its mean
    (the same repetitions), named ``<name>-median``: the bench replays both side by side."""
    out = json.loads(json.dumps(data))
    out["name"] = f"{data['name']}-median"
    out["doc"] = "the same calibration as " + data["name"] + ", each table entry the median of its repetitions"
    table = {op: {n: [[int(b), s["median"]] for b, s in sorted(rows.items(), key=lambda kv: int(kv[0]))]
                  for n, rows in by_n.items()} for op, by_n in stats.items()}
    for link in ("intra_node", "inter_node"):
        out[link]["table"] = table
    return out


def torchrun(run_dir: Path, argv: List[str], nproc: int, timeout: float) -> Dict[int, Dict[str, Any]]:
    """``torchrun --standalone --nproc-per-node N argv``, as a user runs it: each rank's
    ``{"rank": ...}`` line (the example's ``--checksum`` output). Raises with the log's tail."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "torchrun.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
    # each rank's output to a file of its own (--log-dir, --redirects 3): interleaved lines would mix
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), "--log-dir", str(run_dir / "ranks"), "--redirects", "3", *argv],
                              cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    outs = sorted((run_dir / "ranks").rglob("stdout.log"))
    if proc.returncode != 0:
        from pitstop.errors import PitstopError

        tails = "".join(f"--- {p}\n{p.read_text()[-1500:]}" for p in sorted((run_dir / "ranks").rglob("std*.log")))
        raise PitstopError(f"torchrun {' '.join(argv)} exited {proc.returncode}:\n{log.read_text()[-1500:]}{tails}")
    out: Dict[int, Dict[str, Any]] = {}
    for path in outs:
        for line in path.read_text().splitlines():
            if line.startswith('{"rank"'):
                rec = json.loads(line)
                out[rec["rank"]] = rec
    return out


def _median_after_first(xs: Sequence[float]) -> float:
    return statistics.median(xs[1:] or xs)


def fidelity_row(run_dir: Path, config: str, steps: int, timeout: float, topology: str,
                 repeats: int = REPEATS, median_topology: Optional[str] = None) -> Dict[str, Any]:
    from pitstop.emulation.whatif import WhatIf

    c = CONFIGS[config]
    argv = [SCRIPT, *c["args"], "--steps", str(steps), "--pin-core"]
    d = run_dir / config
    plain = argv + ["--megatron-groups", "--checksum"]
    runs = [_median_after_first(torchrun(d / f"real-{i}", plain, 2, timeout)[0]["iter_s"]) for i in range(repeats)]
    real_mem = torchrun(d / "real-memory", plain + ["--track-memory"], 2, timeout)
    # both tables replayed the same way (the what-if's steady median), so only the statistic differs
    whatifs = [WhatIf.parse(f"topology={topology}"), WhatIf.parse(f"topology={median_topology}")] \
        if median_topology else []
    report = emulate(EmulateSpec(2, c["tp"], c["pp"], [0], argv, d / "emulate", topology=topology, timeout_s=timeout,
                                 what_if=whatifs))
    rep = report["ranks"][0]
    real = statistics.median(runs)
    err = 100 * (rep["iter_s"] - real) / real
    extra: Dict[str, Any] = {}
    if median_topology:
        mean, med = (next(r for r in w["ranks"] if r["rank"] == 0)["iter_s"] for w in report["what_if"])
        extra = {"replayed_mean_table_s": mean, "replayed_median_table_s": med,
                 "replayed_error_pct": round(abs(100 * (mean - real) / real), 3),
                 "replayed_median_table_error_pct": round(abs(100 * (med - real) / real), 3)}
    return {
        "config": config,
        "ground_truth": "torchrun",
        "real_median_s": round(real, 6),
        "real_spread_pct": round(100 * (max(runs) - min(runs)) / real, 3),
        "real_runs_s": [round(x, 6) for x in runs],
        "emulated_s": rep["iter_s"],
        "replayed_s": rep["replayed_iter_s"],
        "error_pct": round(abs(err), 3),
        "signed_error_pct": round(err, 3),
        "real_peak_bytes": real_mem[0]["peak_tensor_bytes"],
        "emulated_peak_bytes": rep["peak_tensor_bytes"],
        "peak_equal": real_mem[0]["peak_tensor_bytes"] == rep["peak_tensor_bytes"],
        **extra,
    }


def op_cost_rows(run_dir: Path, config: str, steps: int, timeout: float, topology: str) -> Dict[str, Any]:
    """Each collective of one job's step, its cost inside a training run with every rank real
    beside the calibration's price for it.

    The training side is ``pitstop emulate --trace-all``: both ranks real, each collective timed
    on rank 0 from its issue to its return (the peer's late arrival included, which the replay
    models apart). It runs through pitstop's hybrid backend, where an all-reduce among real
    members is a gloo all-gather of their inputs and a local sum (:mod:`pitstop.emulation.hybrid`),
    so each row also gives the calibration's price of that all-gather (output ``n * bytes``).
    The plain torchrun runs of the fidelity rows time no single operation. It shows where a
    fidelity row's error comes from; nothing here feeds a prediction."""
    from pitstop.emulation import topology as topo

    c = CONFIGS[config]
    argv = [SCRIPT, *c["args"], "--steps", str(steps), "--pin-core"]
    out = run_dir / config / "trace-all"
    emulate(EmulateSpec(2, c["tp"], c["pp"], [0], argv, out, topology=topology, timeout_s=timeout,
                        trace_ranks=[0, 1], memory=False))
    iters = json.loads((out / "traces" / "r0.measured.json").read_text())["iterations"][1:]
    t = topo.load(topology)
    seen: Dict[tuple, List[float]] = {}
    for it in iters:
        for op, n, nbytes, secs in it:
            if n >= 2:
                seen.setdefault((op, int(n), int(nbytes)), []).append(float(secs))
    rows = []
    for (op, n, nbytes), v in sorted(seen.items()):
        priced = t.cost(op, list(range(n)), nbytes)
        mean = statistics.fmean(v)
        row = {"op": op, "group_size": n, "bytes": nbytes, "per_step": round(len(v) / len(iters), 2),
               "in_training_mean_s": round(mean, 6), "in_training_median_s": round(statistics.median(v), 6),
               "calibrated_s": round(priced, 6), "calibrated_over_training": round(priced / mean, 3)}
        if op == "all_reduce":  # what the hybrid backend ran for it
            row["calibrated_as_run_s"] = round(t.cost("all_gather", list(range(n)), n * nbytes), 6)
        rows.append(row)
    return {"config": config, "steps_measured": len(iters), "rows": rows,
            "comm_per_step_in_training_s": round(sum(r["in_training_mean_s"] * r["per_step"] for r in rows), 6),
            "comm_per_step_calibrated_s": round(sum(r["calibrated_s"] * r["per_step"] for r in rows), 6)}


#: What-if rows: a recorded emulation replayed at another dp, against plain runs of that world.
#: (name, recorded world, config, what-if, its world) -- both real sides fit this machine's cores.
WHAT_IF = [("tp2 world 4 -> world 2", 4, "tp2", "dp=1", 2), ("dp2 world 2 -> world 1", 2, "dp2", "dp=1", 1)]


def what_if_rows(run_dir: Path, steps: int, timeout: float, topology: str, fidelity: Sequence[Dict[str, Any]],
                 repeats: int = REPEATS) -> List[Dict[str, Any]]:
    """``pitstop emulate --what-if`` against plain torchrun runs of the world it predicts.

    The recorded emulation runs at the "from" world (one real rank); its graph is replayed at
    the "to" world without a rerun. The real side is the fidelity row's torchrun median where
    that row ran the same job at the same world, else ``repeats`` runs of its own.
    ``direct_emulated_s`` is ``pitstop emulate`` run at the "to" world itself (the fidelity row),
    so the what-if's own error can be told from the emulator's."""
    from pitstop.emulation.whatif import WhatIf

    rows = []
    by_config = {r["config"]: r for r in fidelity}
    for name, world, config, change, to_world in WHAT_IF:
        c = CONFIGS[config]
        argv = [SCRIPT, *c["args"], "--steps", str(steps), "--pin-core"]
        d = run_dir / "what-if" / name.split()[0] / f"world{world}"
        report = emulate(EmulateSpec(world, c["tp"], c["pp"], [0], argv, d / "emulate", topology=topology,
                                     timeout_s=timeout, memory=False, what_if=[WhatIf.parse(change)]))
        w = report["what_if"][0]
        assert w["world_size"] == to_world, (w["world_size"], to_world)
        predicted = w["ranks"][0]["iter_s"]
        same = by_config.get(config) if to_world == 2 else None
        if same is not None:
            runs, source = same["real_runs_s"], f"the {config} fidelity row's torchrun runs"
        else:
            runs = [_median_after_first(torchrun(d / f"real-{i}", argv + ["--megatron-groups", "--checksum"],
                                                 to_world, timeout)[0]["iter_s"]) for i in range(repeats)]
            source = f"{repeats} torchrun runs of world {to_world}"
        real = statistics.median(runs)
        err = 100 * (predicted - real) / real
        rows.append({
            "from": f"{config} world {world} ({report['layout'].split(' (')[0]}), emulated with real rank 0",
            "to": f"{change}: world {to_world} ({w['layout'].split(' (')[0]})",
            "predicted_s": predicted,
            "real_s": round(real, 6),
            "real_spread_pct": round(100 * (max(runs) - min(runs)) / real, 3),
            "real_from": source,
            "error_pct": round(abs(err), 3),
            "signed_error_pct": round(err, 3),
            "direct_emulated_s": same["emulated_s"] if same is not None else None,
            "recorded_s": report["ranks"][0]["replayed_iter_s"],
        })
    return rows


#: The replacement both sides of the failure row meet: world 2 (dp2), rank 1 killed in step 4's backward.
FAULT = {"world_size": 2, "rank": 1, "step": 4, "phase": "backward"}
FAULT_REPEATS = 3


def _replacement(run_dir: Path, steps: int, timeout: float) -> Dict[str, Any]:
    """A real ``pitstop launch`` of the world-2 job with a warmed standby, rank 1 SIGKILLed in
    step 4; returns the controller's ``replaced`` event, with the losses checked against nothing
    (the fidelity rows check losses; this row times)."""
    from pitstop.errors import PitstopError
    from pitstop.launch.runs import run_job
    from pitstop.runtime.faults import Fault

    kill = Fault.kill(rank=FAULT["rank"]).at(step=FAULT["step"], phase=FAULT["phase"])
    res = run_job(run_dir, steps, standby=1, faults=kill.spec(), nproc=FAULT["world_size"], timeout=timeout,
                  gpt=["examples/train_gpt.py", "--checksum", "--pin-core"], launch_args=["--hold-for-warm", "600"])
    ev = (res.of("replaced") or [None])[0]
    if res.code != 0 or ev is None or ev.get("downtime_s") is None:
        raise PitstopError(f"the real replacement in {run_dir} did not happen (exit {res.code}, event {ev}):\n{res.tails()}")
    # per rank, the size of the snapshot it holds for its ring peer (a Snapshot's data and header)
    ev["buddy_bytes"] = {s.get("rank"): s.get("buddy_bytes") for s in res.stats}
    return ev


def failure_row(run_dir: Path, steps: int, timeout: float, topology: str,
                repeats: int = FAULT_REPEATS) -> Dict[str, Any]:
    """``pitstop emulate --fault`` against real replacements of the same fault that it never saw.

    The control plane's detection and planning come from one real replacement (the costs run);
    the prediction is compared with ``repeats`` further real replacements (median; spread)."""
    from pitstop.emulation.failure import FaultSpec, RecoveryCosts
    from pitstop.launch.events import EVENTS

    d = run_dir / "failure"
    costs_ev = _replacement(d / "costs", steps, timeout)
    costs = RecoveryCosts.from_dict(costs_ev, source=str(d / "costs" / EVENTS))
    argv = [SCRIPT, "--steps", str(steps), "--pin-core"]
    report = emulate(EmulateSpec(FAULT["world_size"], 1, 1, [FAULT["rank"]], argv, d / "emulate", topology=topology,
                                 timeout_s=timeout, memory=False, fault=FaultSpec(FAULT["rank"], FAULT["step"]),
                                 recovery_costs=costs))
    pred = report["failure"]
    reals = [_replacement(d / f"real-{i}", steps, timeout) for i in range(repeats)]
    times = [e["downtime_s"] for e in reals]
    real = statistics.median(times)
    mid = reals[times.index(real)] if real in times else reals[0]
    err = 100 * (pred["predicted_downtime_s"] - real) / real
    keys = ("detect_s", "plan_s", "groups_s", "joiner_built_s", "state_s", "first_step_s")
    return {
        "world_size": FAULT["world_size"],
        "fault": f"rank={FAULT['rank']},step={FAULT['step']} ({FAULT['phase']}), warmed standby",
        "predicted_downtime_s": pred["predicted_downtime_s"],
        "real_downtime_s": round(real, 4),
        "real_runs_s": times,
        "real_spread_pct": round(100 * (max(times) - min(times)) / real, 3),
        "error_pct": round(abs(err), 3),
        "signed_error_pct": round(err, 3),
        "predicted_breakdown": pred["breakdown"],
        "real_breakdown": {k: mid.get(k) for k in keys},
        "real_warm": all(e.get("warm") for e in reals),
        "groups_rebuilt": pred["groups_rebuilt"],
        "state_bytes": pred["state_bytes"],
        # the copy of rank 1's state its peer held in the real run (what the joiner received)
        "real_snapshot_bytes": mid["buddy_bytes"].get(pred["state_source_rank"]),
        "costs_from": {"detect_s": costs.detect_s, "plan_s": costs.plan_s,
                       "run": "a separate real replacement of the same job, before the emulation"},
    }


def scale_row(run_dir: Path, steps: int, timeout: float, topology: Optional[str] = None,
              costs: Optional[Any] = None) -> Dict[str, Any]:
    """The world-8192 emulation; with ``topology`` (a calibrated one) and ``costs``, also the
    predicted downtime of a standby replacing its real rank 0 in step 4."""
    from pitstop.emulation.failure import FaultSpec

    world, tp, pp = 8192, 8, 8
    argv = [SCRIPT, "--tp", str(tp), "--pp", str(pp), "--num-layers", str(pp), "--num-heads", "8",
            "--steps", str(steps), "--pin-core"]
    t0 = time.perf_counter()
    fault = FaultSpec(0, FAULT["step"]) if costs is not None else None
    report = emulate(EmulateSpec(world, tp, pp, [0], argv, run_dir / "scale", timeout_s=timeout,
                                 topology=topology or "cpu-gloo-loopback", fault=fault, recovery_costs=costs))
    r = report["ranks"][0]
    return {
        "topology": report["topology"],
        "predicted_failure": report.get("failure"),
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
        timeout: float = 900.0, repeats: int = REPEATS, failure: bool = True, what_if: bool = True) -> Dict[str, Any]:
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    out: Dict[str, Any] = {}
    if configs:
        from pitstop.emulation.calibrate import calibrate_topology

        run_dir.mkdir(parents=True, exist_ok=True)
        topo = run_dir / "calibrated.json"
        tc = time.perf_counter()
        stats: Dict[str, Any] = {}
        data = calibrate_topology(group_sizes=(2,), repeats=CALIBRATION_REPEATS, stats=stats,
                                  command=f"pitstop bench emulation (pitstop calibrate --group-sizes 2 "
                                          f"--repeats {CALIBRATION_REPEATS})")
        topo.write_text(json.dumps(data, indent=1) + "\n")
        median = median_table(data, stats)
        median_topo = run_dir / "calibrated-median.json"
        median_topo.write_text(json.dumps(median, indent=1) + "\n")
        out["calibration"] = {"topology": str(topo), "seconds": round(time.perf_counter() - tc, 1),
                              "repeats": CALIBRATION_REPEATS, "statistic": "mean",
                              "table": data["intra_node"]["table"],
                              "median_table": median["intra_node"]["table"]}
        rows = [fidelity_row(run_dir, c, steps, timeout, str(topo), repeats, str(median_topo)) for c in configs]
        out["fidelity"] = rows
        avg = statistics.mean(r["error_pct"] for r in rows)
        floor = statistics.median(r["real_spread_pct"] for r in rows)
        out["fidelity_summary"] = {
            "avg_error_pct": round(avg, 3), "goal_avg_error_pct": GOALS["avg_error_pct"],
            "avg_replayed_error_pct": round(statistics.mean(r["replayed_error_pct"] for r in rows), 3),
            "avg_replayed_median_table_error_pct":
                round(statistics.mean(r["replayed_median_table_error_pct"] for r in rows), 3),
            "error_met": avg <= GOALS["avg_error_pct"], "peaks_equal": all(r["peak_equal"] for r in rows),
            "repeats": repeats, "noise_floor_pct": round(floor, 3),
            # the goal can be told from noise only where the real runs agree more closely than it
            "goal_measurable": floor <= GOALS["avg_error_pct"],
        }
    if "tp2" in configs:
        out["op_costs"] = op_cost_rows(run_dir, "tp2", steps, timeout, str(topo))
    if configs and what_if:
        out["what_if"] = what_if_rows(run_dir, steps, timeout, str(topo), out["fidelity"], repeats)
    costs = None
    if configs and failure:
        from pitstop.emulation.failure import RecoveryCosts

        f = failure_row(run_dir, steps, timeout, str(topo))
        out["failure"] = f
        costs = RecoveryCosts(f["costs_from"]["detect_s"], f["costs_from"]["plan_s"], "the failure row's costs run")
    if scale:
        s = scale_row(run_dir, steps, timeout, str(topo) if configs else None, costs)
        s["goal_overhead_pct"] = GOALS["overhead_pct"]
        s["overhead_met"] = s["overhead_pct"] <= GOALS["overhead_pct"]
        out["scale"] = s
    out["gpu"] = None  # filled only where a GPU ran it (see BENCHMARKS.md)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def main(run_dir: str, steps: int, configs: Optional[str], scale: bool, repeats: int = REPEATS,
         failure: bool = True, what_if: bool = True) -> Dict[str, Any]:
    names = [c for c in (",".join(CONFIGS) if configs is None else configs).split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        from pitstop.errors import ConfigError

        raise ConfigError(f"--configs: unknown {bad}; expected a subset of {','.join(CONFIGS)}")
    return run(Path(run_dir), steps, names, scale, repeats=repeats, failure=failure, what_if=what_if)
