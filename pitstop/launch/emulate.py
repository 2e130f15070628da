"""``pitstop emulate``: a job of N ranks, run by a few real processes.

Two phases, each a set of real processes under ``torch.distributed.elastic``::

    1. trace    one real rank per pipeline stage (a requested real rank where it has
                one, else the stage's rank with every other coordinate 0) runs the
                script; their pipeline hand-offs are real, every other peer virtual.
                Each writes its per-iteration timeline.
    2. replay   the traces are sliced into the execution graph of the whole layout
                (stored once per class) and replayed under the topology's alpha-beta
                network model: when every one of the N ranks reaches each operation.
    3. paced    the requested real ranks run the script again; each operation on a
                group with virtual members returns at its replayed end time, so their
                wall clock shows the target-scale iteration, bubbles and waits included.
    4. memory   the requested real ranks run once more, unpaced, with every tensor
                allocation counted (on CPU; a GPU has its allocator's peak). A phase
                of its own, so the counting never slows a timed phase.

Output in ``--out``: ``report.json`` (per real rank: measured and replayed iteration
time, the replayed breakdown, peak memory), ``trace.json`` (Chrome / Perfetto), with
``--chakra`` the whole graph as Chakra execution traces (``chakra/et.<rank>.et``, for
ASTRA-sim), and a table on the terminal. Bad input (a layout that does not divide N, real ranks
outside the world, a topology file with missing fields) is refused before any
process starts.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from pitstop.errors import ConfigError, EmulationError
from pitstop.layout import ParallelLayout

if TYPE_CHECKING:
    from pitstop.emulation.failure import FaultSpec, RecoveryCosts
    from pitstop.emulation.whatif import WhatIf

DEFAULT_TOPOLOGY = "cpu-gloo-loopback"


@dataclass(frozen=True)
class EmulateSpec:
    world_size: int
    tp: int
    pp: int
    real_ranks: List[int]
    argv: List[str]
    out: Path
    topology: str = DEFAULT_TOPOLOGY
    cp: int = 1
    ep: int = 1
    timeout_s: float = 900.0
    trace_ranks: Optional[List[int]] = None
    """Who runs the trace phase (default :func:`tracers`). ``pitstop bench emulation``
    traces a fully real small world: every rank, so the trace is of a real run."""
    memory: bool = True
    """Run the memory phase (peak tensor bytes per real rank)."""
    fit_network: bool = False
    """Fit the topology's link to the collectives the trace phase measured (needs a fully
    real trace phase: every rank traced, so every measured collective is real)."""
    fault: Optional["FaultSpec"] = None
    """Predict a standby replacement of this rank (:mod:`pitstop.emulation.failure`); the rank
    must be one of ``real_ranks`` (its state and build are measured on it)."""
    recovery_costs: Optional["RecoveryCosts"] = None
    """The control plane's measured detection and planning (needed with ``fault``)."""
    chakra: bool = False
    """Also write the target-scale graph as Chakra execution traces (``<out>/chakra/et.<rank>.et``)."""
    chakra_ranks: Optional[List[int]] = None
    """Whose Chakra files (default every rank)."""
    what_if: Sequence["WhatIf"] = ()
    """Replays of the recorded graph under another dp or topology (:mod:`pitstop.emulation.whatif`)."""

    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)


def parse_ranks(text: str, world_size: int) -> List[int]:
    """``"0,8191"`` -> [0, 8191], each checked against the world."""
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--real-ranks {text!r}: expected comma-separated integers, e.g. 0,8191") from None
    if not ranks:
        raise ConfigError(f"--real-ranks {text!r}: name at least one rank")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"--real-ranks {text!r}: rank(s) {bad} outside the world 0..{world_size - 1}")
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"--real-ranks {text!r}: a rank is named twice")
    return sorted(ranks)


def validate(spec: EmulateSpec):
    """Everything that can be checked before a process starts; returns (layout, topology)."""
    from pitstop.emulation import topology as topo

    layout = spec.layout()  # LayoutError names every factor
    parse_ranks(",".join(map(str, spec.real_ranks)), spec.world_size)
    if spec.trace_ranks is not None:
        parse_ranks(",".join(map(str, spec.trace_ranks)), spec.world_size)
        missing = [r for r in tracers(layout, spec.real_ranks) if r not in spec.trace_ranks]
        if missing:
            raise ConfigError(f"trace ranks {spec.trace_ranks} leave out the tracer rank(s) {missing} "
                              "(one per pipeline stage)")
    if spec.fit_network and sorted(spec.trace_ranks or []) != list(range(spec.world_size)):
        raise ConfigError(f"fitting the network to the trace needs every one of the {spec.world_size} ranks "
                          f"traced for real (trace ranks: {spec.trace_ranks})")
    topology = topo.load(spec.topology)
    if spec.fault is not None:
        if spec.fault.rank not in spec.real_ranks:
            raise ConfigError(f"--fault rank={spec.fault.rank} must be a real rank (real ranks: {spec.real_ranks}): "
                              "its state bytes and build time are measured on it")
        if spec.recovery_costs is None:
            raise ConfigError("--fault needs --recovery-costs FILE: the detection and planning times of a real "
                              "replacement (a `pitstop launch` run directory, its events.jsonl, or {detect_s, plan_s})")
        if layout.dp < 2:
            raise ConfigError(f"--fault rank={spec.fault.rank}: dp={layout.dp} leaves no data-parallel peer with the "
                              "role's state; a replacement would restore a checkpoint, which emulate does not predict")
        topology.group_build_cost(1)  # TopologyError now, naming the fix, if it was never measured
    if spec.chakra_ranks is not None:
        parse_ranks(",".join(map(str, spec.chakra_ranks)), spec.world_size)
    if spec.chakra:
        from pitstop.emulation.chakra import _messages

        _messages()  # the protobuf runtime is there, or MissingDependencyError names the extra
    for w in spec.what_if:  # before any process starts: the layout it asks for, its topology file
        w.layout(layout)
        if w.topology is not None:
            topo.load(w.topology)
    if not spec.argv:
        raise ConfigError("pitstop emulate: no script given (-- SCRIPT ARGS...)")
    return layout, topology


def tracers(layout: ParallelLayout, real: Sequence[int]) -> List[int]:
    """One rank per pipeline stage: a requested real rank of that stage, else its coordinate-0 rank."""
    out = []
    for s in range(layout.pp):
        mine = [r for r in real if layout.coords(r)["pp"] == s]
        out.append(mine[0] if mine else layout.rank(pp=s))
    return out


def _run_phase(job, name: str, spec: EmulateSpec, ranks: List[int], phase: str) -> float:
    from pitstop.emulation.runtime import EmulationConfig

    t0 = time.perf_counter()
    cfg = EmulationConfig(spec.world_size, spec.tp, spec.pp, list(ranks), phase, str(spec.out.resolve()), spec.cp, spec.ep)
    ctx = job.start(name, spec.argv, ranks, spec.world_size, extra_env={r: cfg.to_env() for r in ranks})
    res = ctx.wait(timeout=spec.timeout_s, period=0.2)
    if res is None:
        raise EmulationError(f"the {phase} phase ({len(ranks)} real ranks) did not finish in {spec.timeout_s:.0f}s\n"
                             + job.log_tail(ctx))
    if res.is_failed():
        raise EmulationError(f"the {phase} phase failed: {res.failures}\n" + job.log_tail(ctx))
    return time.perf_counter() - t0


def measure_memory(spec: EmulateSpec) -> Dict[int, Optional[int]]:
    """Only the memory phase: each real rank's peak tensor bytes (no trace, no replay)."""
    from pitstop.launch.local import LocalJob

    validate(spec)
    spec.out.mkdir(parents=True, exist_ok=True)
    job = LocalJob(spec.out / "logs")
    try:
        _run_phase(job, "memory", spec, list(spec.real_ranks), "memory")
    finally:
        job.close()
    return {r: json.loads((spec.out / "metrics" / f"memory-r{r}.json").read_text())["peak_tensor_bytes"]
            for r in spec.real_ranks}


def emulate(spec: EmulateSpec) -> Dict[str, Any]:
    """Run both phases and the replay; write the report and the trace; return the report."""
    from pitstop.emulation.chrome_trace import to_chrome_trace
    from pitstop.emulation.graph import Trace, slice_graph
    from pitstop.emulation.replay import replay
    from pitstop.emulation.tracer import schedule_of
    from pitstop.launch.local import LocalJob

    layout, topology = validate(spec)
    out = spec.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    job = LocalJob(out / "logs")
    phases: Dict[str, float] = {}
    try:
        traced = tracers(layout, spec.real_ranks)
        phases["trace_s"] = _run_phase(job, "trace", spec, spec.trace_ranks or traced, "trace")
        traces = [Trace.from_json(json.loads((out / "traces" / f"r{r}.json").read_text())) for r in traced]
        t_graph = time.perf_counter()
        if spec.fit_network:
            topology = _fitted(topology, spec)
        graph = slice_graph(layout, traces)
        result = replay(graph, topology)
        replay_s = time.perf_counter() - t_graph
        (out / "schedules").mkdir(exist_ok=True)
        for r in spec.real_ranks:
            (out / "schedules" / f"r{r}.json").write_text(json.dumps(schedule_of(result, r)))
        phases["paced_s"] = _run_phase(job, "paced", spec, list(spec.real_ranks), "paced")
        if spec.memory:
            phases["memory_s"] = _run_phase(job, "memory", spec, list(spec.real_ranks), "memory")
    finally:
        job.close()
    import resource

    phases["replay_s"] = round(replay_s, 4)
    report = _report(spec, layout, topology, result, traced, replay_s, time.perf_counter() - t0)
    report["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    if spec.fault is not None:
        report["failure"] = predicted_failure(spec, layout, topology, result)
    if spec.what_if:
        report["what_if"] = [what_if(w, layout, topology, traces, report) for w in spec.what_if]
    if spec.chakra:
        from pitstop.emulation.chakra import export

        t_ch = time.perf_counter()
        report["chakra"] = export(result, out / "chakra" / "et", spec.chakra_ranks)
        report["chakra"]["seconds"] = round(time.perf_counter() - t_ch, 3)
    report["launcher_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "trace.json").write_text(json.dumps(to_chrome_trace(result, sorted(set(spec.real_ranks) | set(result.partition.reps)))))
    return report


def what_if(w: "WhatIf", layout: ParallelLayout, topology, traces, report: Dict[str, Any]) -> Dict[str, Any]:
    """The recorded traces sliced into the what-if layout and replayed on its topology."""
    from pitstop.emulation import topology as topo
    from pitstop.emulation.graph import slice_graph
    from pitstop.emulation.replay import replay
    from pitstop.emulation.whatif import ranks_to_report, summarise

    t0 = time.perf_counter()
    new_layout = w.layout(layout)
    new_topology = topology if w.topology is None else topo.load(w.topology)
    result = replay(slice_graph(new_layout, traces), new_topology)
    rows = summarise(result, new_layout, ranks_to_report(new_layout, report["real_ranks"]))
    same_dp = new_layout.dp == layout.dp
    peaks = {r["rank"]: r["peak_tensor_bytes"] for r in report["ranks"]}
    for row in rows:  # memory: the recorded peak where only the network changed
        row["peak_tensor_bytes"] = peaks.get(row["rank"]) if same_dp else None
    return {
        "what_if": w.text,
        "world_size": new_layout.world_size,
        "layout": new_layout.describe(),
        "topology": new_topology.name,
        "ranks": rows,
        "memory": ("the recorded peaks (a network change moves no tensor)" if same_dp else
                   "not predicted: the optimizer's shard moves with dp; emulate that world for its peak"),
        "replay_s": round(time.perf_counter() - t0, 4),
    }


def scale_row_costs(data: Dict[str, Any], world_size: int, source: str) -> "RecoveryCosts":
    """The control plane's costs at ``world_size`` from ``pitstop bench scale``'s JSON: its
    ``tcpstore`` row at that many ranks, else the nearest (by ratio) that finished, and the
    source says which. A lost machine's costs, as ``--fault`` predicts a machine's loss:
    ``detect_machine_s`` (the signal to the controller's detection) and
    ``control_path_killed_s`` (detection to every simulated stayer told)."""
    from pitstop.emulation.failure import RecoveryCosts

    rows = [r for r in data.get("rows", []) if isinstance(r, dict) and r.get("backend") == "tcpstore"
            and "error" not in r and r.get("detect_machine_s") is not None
            and r.get("control_path_killed_s") is not None and isinstance(r.get("ranks"), int)]
    if not rows:
        raise ConfigError(f"--recovery-costs {source}: no finished tcpstore row with detect_machine_s and "
                          "control_path_killed_s (is it `pitstop bench scale --json` output?)")
    row = min(rows, key=lambda r: (abs(math.log(r["ranks"] / world_size)), -r["ranks"]))
    which = "at" if row["ranks"] == world_size else f"nearest to world {world_size}, at"
    return RecoveryCosts(float(row["detect_machine_s"]), float(row["control_path_killed_s"]),
                         f"{source}: bench scale row {which} {row['ranks']} simulated ranks "
                         f"({row['machines']} machines)")


def load_recovery_costs(path: Path, world_size: Optional[int] = None) -> "RecoveryCosts":
    """The control plane's measured costs from ``path``: a ``pitstop launch`` run directory or its
    ``events.jsonl`` (its first ``replaced`` event), a JSON object ``{detect_s, plan_s}``, or
    ``pitstop bench scale``'s JSON (the row at ``world_size`` ranks: :func:`scale_row_costs`),
    which measured the control plane at the emulated scale rather than at a world-8 run's."""
    from pitstop.emulation.failure import RecoveryCosts
    from pitstop.launch.events import EVENTS

    p = Path(path)
    if p.is_dir():
        p = p / EVENTS
    if not p.is_file():
        raise ConfigError(f"--recovery-costs {str(path)!r}: no such file (expected a pitstop launch run directory "
                          f"with {EVENTS}, an {EVENTS}, or a JSON file with detect_s and plan_s)")
    text = p.read_text(errors="replace")
    if p.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            try:
                ev = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                raise ConfigError(f"--recovery-costs {p}: line {n} is not JSON") from None
            if isinstance(ev, dict) and ev.get("event") == "replaced":
                return RecoveryCosts.from_dict(ev, source=f"{p} line {n}")
        raise ConfigError(f"--recovery-costs {p}: no 'replaced' event (the run had no replacement by a standby)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--recovery-costs {p}: not valid JSON at line {exc.lineno}: {exc.msg}") from None
    if isinstance(data, dict) and "rows" in data:
        if world_size is None:
            raise ConfigError(f"--recovery-costs {p}: a bench scale file needs the emulated world size")
        return scale_row_costs(data, world_size, str(p))
    return RecoveryCosts.from_dict(data, source=str(p))


def predicted_failure(spec: EmulateSpec, layout: ParallelLayout, topology, result) -> Dict[str, Any]:
    """The replacement of ``spec.fault.rank`` predicted from this emulation: the role's state bytes
    and build time as its real rank measured them (paced phase), its replayed step S (the last
    replayed iteration's where S is beyond them)."""
    from pitstop.emulation.failure import predict

    r = spec.fault.rank
    m = json.loads((spec.out / "metrics" / f"r{r}.json").read_text())
    missing = [k for k in ("state_bytes", "build_s") if m.get(k) is None]
    if missing:
        raise EmulationError(f"--fault rank={r}: the emulated rank reported no {', '.join(missing)} (does the "
                             "script train through pitstop's session, so its boundaries reach the emulator?)")
    times = result.iteration_times(r)
    it = min(spec.fault.step, len(times)) - 1
    out = predict(layout, spec.fault, topology, spec.recovery_costs, m["state_bytes"], m["build_s"], times[it])
    out["step_replayed_iteration"] = it + 1
    return out


def _fitted(topology, spec: EmulateSpec):
    """The topology with both link classes fitted to the trace phase's measured collectives."""
    from pitstop.emulation.calibrate import fit_link
    from pitstop.emulation.topology import LinkClass, Topology

    rows = [row for r in spec.trace_ranks or [] for it in
            json.loads((spec.out / "traces" / f"r{r}.measured.json").read_text())["iterations"] for row in it]
    link = fit_link(rows)
    fitted = Topology(topology.gpus_per_node, link, LinkClass("inter_node", link.alpha_s, link.bandwidth_bytes_per_s),
                      name=f"{topology.name}+fitted", doc=f"{topology.name} with its links fitted to {len(rows)} "
                      f"collectives measured in the trace phase", calibrated=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      group_build_s=topology.group_build_s)
    (spec.out / "topology-fitted.json").write_text(json.dumps(fitted.to_dict(), indent=1))
    return fitted


def _report(spec, layout, topology, result, traced, replay_s, wall_s) -> Dict[str, Any]:
    ranks = []
    for r in spec.real_ranks:
        m = json.loads((spec.out / "metrics" / f"r{r}.json").read_text())  # the paced run's
        mm = spec.out / "metrics" / f"memory-r{r}.json"
        mem = json.loads(mm.read_text()) if mm.exists() else {}
        measured = m["iter_s"][1:] or m["iter_s"]  # the first iteration pays lazy set-up
        replayed = result.iteration_times(r)
        bd = result.breakdown(r)
        ranks.append({
            "rank": r,
            "coords": layout.coords(r),
            "iter_s": round(statistics.median(measured), 6),
            "replayed_iter_s": round(statistics.median(replayed), 6),
            "error_pct": round(100 * (statistics.median(measured) - statistics.median(replayed)) / statistics.median(replayed), 3),
            "breakdown_s": {k: round(v, 6) for k, v in bd.items()},
            "peak_rss_bytes": m["max_rss_bytes"],
            "peak_tensor_bytes": mem.get("peak_tensor_bytes"),
            "init": {k: m.get(k) for k in ("setup_s", "init_s", "init_rss_bytes", "groups")},
            "paced": {"slept_s": m.get("slept_s"), "late_ops": m.get("late_ops"), "late_total_s": m.get("late_total_s"),
                      "overrun": m.get("overrun")},
            "traced_here": r in traced,
        })
    return {
        "world_size": spec.world_size,
        "layout": layout.describe(),
        "real_ranks": spec.real_ranks,
        "tracer_ranks": traced,
        "topology": topology.name,
        "intra_node_link": {"alpha_s": topology.intra_node.alpha_s,
                            "bandwidth_bytes_per_s": topology.intra_node.bandwidth_bytes_per_s},
        "classes": len(result.graph.programs),
        "distinct_timelines": len(result.partition.reps),
        "replay_s": round(replay_s, 4),
        "wall_s": round(wall_s, 2),
        "ranks": ranks,
    }


def table(report: Dict[str, Any]) -> str:
    lines = [f"pitstop emulate: world {report['world_size']} ({report['layout']}), topology {report['topology']}, "
             f"{report['distinct_timelines']} distinct timelines, replay {report['replay_s']}s",
             f"{'rank':>6} {'iter_s':>10} {'replayed':>10} {'err %':>7} {'compute':>9} {'comm':>8} {'wait':>8} {'bubble':>8} {'tensor MiB':>10} {'rss MiB':>8}"]
    for r in report["ranks"]:
        b = r["breakdown_s"]
        lines.append(f"{r['rank']:>6} {r['iter_s']:>10.4f} {r['replayed_iter_s']:>10.4f} {r['error_pct']:>7.2f} "
                     f"{b.get('compute', 0):>9.4f} {b.get('comm', 0):>8.4f} {b.get('comm_wait', 0):>8.4f} "
                     f"{b.get('bubble', 0):>8.4f} {_mib(r['peak_tensor_bytes']):>10} {r['peak_rss_bytes'] / 2**20:>8.1f}")
    for w in report.get("what_if", []):
        lines.append(f"what-if {w['what_if']!r}: world {w['world_size']}, topology {w['topology']}: "
                     + ", ".join(f"rank {r['rank']} {r['iter_s']:.4f}s" for r in w["ranks"]))
    f = report.get("failure")
    if f:
        b = f["breakdown"]
        lines.append(f"fault rank={f['fault']['rank']} step={f['fault']['step']}: predicted downtime "
                     f"{f['predicted_downtime_s']:.4f}s = detect {b['detect_s']:.4f} + plan {b['plan_s']:.4f} + "
                     f"max(groups {b['groups_s']:.4f} [{f['groups_rebuilt']} rebuilt], build {b['build_s']:.4f}) + "
                     f"state {b['state_s']:.4f} [{f['state_bytes']} B from rank {f['state_source_rank']}] + "
                     f"step {b['step_s']:.4f}")
    return "\n".join(lines)


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"
