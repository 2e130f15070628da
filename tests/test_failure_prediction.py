"""``pitstop emulate --fault``: a standby replacement's downtime, predicted.

Tier 1 (pure): the fault and cost inputs are validated by value, the group build costs are
interpolated, the prediction is the sum its docstring states, looped over every rank of a few
layouts. Tier 2: one real ``pitstop launch`` replacement (a warmed standby, rank 1 SIGKILLed)
gives the control plane's costs; ``pitstop emulate --fault`` then predicts the same replacement,
and the state it says the joiner receives is checked against the snapshot the real run moved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.emulation.failure import FaultSpec, RecoveryCosts, predict
from pitstop.emulation.topology import LinkClass, Topology, from_dict, load
from pitstop.errors import ConfigError, EmulationError, TopologyError
from pitstop.layout import ParallelLayout
from pitstop.plan import plan_replace

ROOT = Path(__file__).resolve().parents[1]


def _topo(builds=None) -> Topology:
    link = LinkClass("intra_node", 1e-5, 1e9)
    return Topology(8, link, LinkClass("inter_node", 5e-5, 1e8), name="t",
                    group_build_s={1: 0.002, 2: 0.004, 4: 0.010} if builds is None else builds)


# ---------------------------------------------------------------------- tier 1
@pytest.mark.parametrize("text, words", [
    ("rank=1", ["'rank=1'", "missing ['step']"]),
    ("rank=a,step=2", ["'rank=a,step=2'", "integers"]),
    ("rank=9,step=2", ["rank(9)", "0..7"]),
    ("rank=1,step=0", ["step(0)", ">= 1"]),
    ("rank=1,step=2,rank=3", ["each once"]),
    ("node=1,step=2", ["expected rank=R,step=S"]),
])
def test_a_bad_fault_is_refused_by_value(text, words):
    with pytest.raises(ConfigError) as e:
        FaultSpec.parse(text, 8)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_fault_parses():
    assert FaultSpec.parse(" rank=7 , step=12 ", 8) == FaultSpec(7, 12)


@pytest.mark.parametrize("data, words", [
    ({"detect_s": 0.1}, ["plan_s missing"]),
    ({"detect_s": None, "plan_s": 0.1}, ["detect_s missing", "not stamped"]),
    ({"detect_s": -1, "plan_s": 0.1}, ["detect_s(-1)", ">= 0"]),
    ({"detect_s": float("nan"), "plan_s": 0.1}, ["detect_s(nan)"]),
    ([1, 2], ["expected an object"]),
])
def test_bad_recovery_costs_are_refused_by_value(data, words):
    with pytest.raises(ConfigError) as e:
        RecoveryCosts.from_dict(data, "x.json")
    for w in words + ["x.json"]:
        assert w in str(e.value), str(e.value)


def test_group_build_costs_interpolate_between_and_beyond_the_measured_sizes():
    t = _topo()
    assert t.group_build_cost(2) == 0.004
    assert t.group_build_cost(3) == pytest.approx(0.007)           # halfway between 2 and 4
    assert t.group_build_cost(8) == pytest.approx(0.010 + 4 * 0.003)  # the last segment's slope
    assert t.group_build_cost(1) == 0.002
    with pytest.raises(TopologyError, match="no group_build_s.*pitstop calibrate"):
        _topo({}).group_build_cost(2)
    # the file form carries it through a round trip, and junk in it is named
    again = from_dict(json.loads(json.dumps(t.to_dict())))
    assert again.group_build_s == t.group_build_s
    bad = t.to_dict()
    bad["group_build_s"] = {"0": 0.1}
    with pytest.raises(TopologyError, match="group size '0'"):
        from_dict(bad, "f.json")
    bad["group_build_s"] = {"2": -0.1}
    with pytest.raises(TopologyError, match=r"group_build_s at 2 ranks\(-0.1\)"):
        from_dict(bad, "f.json")


@pytest.mark.parametrize("world, tp, pp", [(8, 2, 2), (16, 2, 2), (64, 4, 2)])
def test_the_prediction_is_its_stated_sum_for_every_rank(world, tp, pp):
    layout = ParallelLayout(world, tp=tp, pp=pp)
    topo = _topo()
    costs = RecoveryCosts(0.05, 0.07, "test")
    for rank in range(world):
        for build in (0.0, 10.0):  # the joiner's build hidden behind its groups, then the other way round
            out = predict(layout, FaultSpec(rank, 3), topo, costs, 10_000_000, build, 0.25)
            plan = plan_replace(layout, (rank,))
            assert all(rank in g.ranks for g in plan.rebuilt)
            groups = sum(topo.group_build_cost(len(g.ranks)) for g in plan.rebuilt)
            src = plan.param_sources[rank]
            # the peer holds the same tp/pp coordinates, one data-parallel step away
            assert layout.coords(src)["tp"] == layout.coords(rank)["tp"] and src != rank
            link = topo.intra_node if src // 8 == rank // 8 else topo.inter_node
            state = link.alpha_s + 10_000_000 / link.bandwidth_bytes_per_s
            want = 0.05 + 0.07 + max(groups, build) + state + 0.25
            assert out["predicted_downtime_s"] == pytest.approx(want, abs=1e-4), (rank, out)
            assert out["groups_rebuilt"] == len(plan.rebuilt)
            assert sum(out["groups_rebuilt_by_size"].values()) == len(plan.rebuilt)
            assert out["state_source_rank"] == src and out["link"] == link.name


def test_no_data_parallel_peer_is_said_not_guessed():
    with pytest.raises(EmulationError, match=r"no data-parallel peer \(dp=1\).*checkpoint"):
        predict(ParallelLayout(4, tp=2, pp=2), FaultSpec(1, 2), _topo(), RecoveryCosts(0.1, 0.1), 1, 0.1, 0.1)


def test_recovery_costs_come_from_a_runs_first_replacement_and_junk_is_named(tmp_path):
    from pitstop.launch.emulate import load_recovery_costs

    ev = tmp_path / "events.jsonl"
    ev.write_text(json.dumps({"event": "started"}) + "\n\n"
                  + json.dumps({"event": "replaced", "detect_s": 0.02, "plan_s": 0.05}) + "\n"
                  + json.dumps({"event": "replaced", "detect_s": 9, "plan_s": 9}) + "\n")
    got = load_recovery_costs(tmp_path)
    assert (got.detect_s, got.plan_s) == (0.02, 0.05) and "line 3" in got.source
    (tmp_path / "c.json").write_text(json.dumps({"detect_s": 0.5, "plan_s": 0.25}))
    assert load_recovery_costs(tmp_path / "c.json").plan_s == 0.25
    ev.write_text("{not json\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        load_recovery_costs(ev)
    ev.write_text(json.dumps({"event": "restarted"}) + "\n")
    with pytest.raises(ConfigError, match="no 'replaced' event"):
        load_recovery_costs(ev)
    with pytest.raises(ConfigError, match="no such file"):
        load_recovery_costs(tmp_path / "nope")


def _emulate(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pitstop.cli", "emulate", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("argv, words", [
    (["--fault", "rank=1,step=2"], ["--fault needs --recovery-costs"]),
    (["--recovery-costs", "x.json"], ["only with --fault"]),
    (["--fault", "rank=5,step=2", "--recovery-costs", "x.json"], ["rank(5)", "0..1"]),
])
def test_emulate_refuses_a_fault_it_cannot_predict_before_starting_anything(tmp_path, argv, words):
    out = tmp_path / "out"
    res = _emulate("--world-size", "2", "--real-ranks", "0", "--out", str(out), *argv, "--", "examples/train_gpt.py",
                   timeout=60)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    for w in words:
        assert w in res.stderr, res.stderr[-2000:]
    assert not out.exists()


def test_emulate_refuses_a_topology_without_group_build_costs(tmp_path):
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"detect_s": 0.1, "plan_s": 0.1}))
    res = _emulate("--world-size", "2", "--real-ranks", "0", "--out", str(tmp_path / "o"), "--fault", "rank=1,step=2",
                   "--recovery-costs", str(costs), "--", "examples/train_gpt.py", timeout=60)
    assert res.returncode == 2 and "no group_build_s" in res.stderr, res.stderr[-2000:]


# ---------------------------------------------------------------------- tier 2
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_emulate_fault_predicts_a_real_replacement_from_another_runs_costs(tmp_path):
    """A real replacement at world 2 (its control-plane costs and the snapshot its peer held),
    then the emulator's prediction of it: the state it would copy is the real snapshot's size,
    and the prediction adds up from the real costs, the calibrated groups and the replayed step."""
    from pitstop.launch.runs import run_job
    from pitstop.runtime.faults import Fault

    real = run_job(tmp_path / "real", 6, standby=1, faults=Fault.kill(rank=1).at(step=3, phase="backward").spec(),
                   nproc=2, gpt=["examples/train_gpt.py", "--checksum"], launch_args=["--hold-for-warm", "600"],
                   timeout=300)
    ev = (real.of("replaced") or [None])[0]
    assert real.code == 0 and ev is not None and ev["warm"], real.tails()
    held = {s["rank"]: s["buddy_bytes"] for s in real.stats}  # rank 0 holds rank 1's snapshot (a ring of 2)

    topo = tmp_path / "topo.json"
    cal = subprocess.run([sys.executable, "-m", "pitstop.cli", "calibrate", "--out", str(topo), "--sizes",
                          "4096,1048576,4194304", "--repeats", "3"], capture_output=True, text=True, timeout=240)
    assert cal.returncode == 0, cal.stderr[-2000:]
    out = tmp_path / "em"
    res = _emulate("--world-size", "2", "--real-ranks", "0", "--fault", "rank=1,step=3", "--recovery-costs",
                   str(tmp_path / "real"), "--topology", str(topo), "--out", str(out), "--no-memory", "--",
                   "examples/train_gpt.py", "--steps", "6")
    assert res.returncode == 0, res.stderr[-4000:] + "".join(
        p.read_text()[-1500:] for p in sorted((out / "logs").rglob("*.log")))
    rep = json.loads((out / "report.json").read_text())
    assert sorted(r["rank"] for r in rep["ranks"]) == [0, 1]  # the faulted rank became a real one
    f = rep["failure"]
    b = f["breakdown"]
    assert (b["detect_s"], b["plan_s"]) == (round(ev["detect_s"], 4), round(ev["plan_s"], 4))
    assert f["predicted_downtime_s"] == pytest.approx(
        b["detect_s"] + b["plan_s"] + max(b["groups_s"], b["build_s"]) + b["state_s"] + b["step_s"], abs=5e-4)
    assert b["build_s"] > 0 and b["groups_s"] > 0
    # the snapshot the emulated rank would hand over is the one the real run moved: its data and
    # RNG header exactly, less the real header's reports (a few hundred bytes of logged losses)
    assert 0 <= held[0] - f["state_bytes"] < 2048, (held, f["state_bytes"])
    replayed = next(r for r in rep["ranks"] if r["rank"] == 1)
    assert b["step_s"] > 0 and f["step_replayed_iteration"] == 3
    assert "predicted downtime" in res.stdout
    assert replayed["replayed_iter_s"] > 0


# ---------------------------------------------------------------------- what-if
from pitstop.emulation.whatif import WhatIf  # noqa: E402


@pytest.mark.parametrize("text, words", [
    ("dp=0", ["dp('0')", ">= 1"]),
    ("dp=x", ["dp('x')"]),
    ("world=8", ["KEY=VALUE", "dp, topology"]),
    ("dp=2,dp=4", ["each once"]),
    ("", ["name at least one"]),
])
def test_a_bad_what_if_is_refused_by_value(text, words):
    with pytest.raises(ConfigError) as e:
        WhatIf.parse(text)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_what_if_changes_dp_and_refuses_what_needs_a_new_trace():
    rec = ParallelLayout(16, tp=2, pp=2)
    got = WhatIf.parse("dp=16,topology=h200-nvlink-ib").layout(rec)
    assert (got.world_size, got.tp, got.pp, got.dp) == (64, 2, 2, 16)
    assert WhatIf.parse("topology=h200-nvlink-ib").layout(rec) is rec
    assert WhatIf.parse("tp=2,dp=1").layout(rec).world_size == 4  # the recorded tp, restated
    with pytest.raises(ConfigError, match=r"tp\(4\) differs from the recorded tp\(2\).*pitstop emulate --tp 4"):
        WhatIf.parse("tp=4,pp=2").layout(rec)


def test_a_what_if_replays_the_same_traces_with_the_new_dp_groups():
    """Synthetic traces of a 2-stage job at dp 2 replayed at dp 1 and dp 8: the data-parallel
    all-reduce costs nothing at dp 1 (a group of one), more at dp 8 (ring: 2(n-1)/n of the bytes),
    and everything else is the same program."""
    from pitstop.emulation.graph import slice_graph
    from pitstop.emulation.replay import replay
    from pitstop.emulation.synthetic import one_f_one_b_traces
    from pitstop.emulation.whatif import summarise

    traces = one_f_one_b_traces(2, 4, iterations=3, fwd_s=0.01, bwd_s=0.02, act_bytes=1 << 20,
                                grad_bytes=64 << 20, optim_s=0.005)
    topo = load("h200-nvlink-ib")
    rec = ParallelLayout(4, pp=2)
    comm = {}
    for dp in (1, 2, 8):
        layout = WhatIf.parse(f"dp={dp}").layout(rec)
        res = replay(slice_graph(layout, traces), topo)
        row = summarise(res, layout, [0, layout.world_size - 1])
        assert [r["rank"] for r in row] == [0, layout.world_size - 1]
        comm[dp] = row[0]["breakdown_s"]["comm"]
        assert row[0]["breakdown_s"]["compute"] == pytest.approx(4 * 0.03 + 0.005)
    assert comm[1] < comm[2] < comm[8], comm


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_what_if_replays_a_real_recording_whose_programs_do_not_depend_on_dp(tmp_path):
    """A real emulation at world 4 (tp2 dp2) with ``--what-if dp=1``, and a second one recorded at
    world 2 (tp2 dp1) directly: the what-if's premise holds on the real program -- the rank's
    communication of 1 KiB or more, operation by operation (kind, group, bytes), is the same at both
    dp; only a few tiny ones differ (Megatron's optimizer checks: at dp 1 one all_reduce of 4 bytes,
    at dp 2 two all_gathers of 8 and 16), which the what-if keeps as recorded -- and the what-if
    reports the world it was asked for."""
    from pitstop.emulation.graph import Comm, Trace

    def run(world: int, *extra: str) -> dict:
        out = tmp_path / f"w{world}"
        res = _emulate("--world-size", str(world), "--tp", "2", "--real-ranks", "0", "--out", str(out), "--no-memory",
                       *extra, "--", "examples/train_gpt.py", "--tp", "2", "--steps", "4")
        assert res.returncode == 0, res.stderr[-4000:]
        return {"report": json.loads((out / "report.json").read_text()), "stdout": res.stdout,
                "trace": Trace.from_json(json.loads((out / "traces" / "r0.json").read_text()))}

    four = run(4, "--what-if", "dp=1", "--what-if", "topology=h200-nvlink-ib")
    two = run(2)
    def comms(t, big: bool):
        return [[(op.op, op.group_kind, op.nbytes) for op in it if isinstance(op, Comm) and (op.nbytes >= 1024) == big]
                for it in t.iterations[1:]]

    bulk = comms(four["trace"], True) + comms(two["trace"], True)
    assert bulk[0] and all(c == bulk[0] for c in bulk), "a rank's large collectives changed with dp"
    small4, small2 = comms(four["trace"], False), comms(two["trace"], False)
    for a, b in zip(small4, small2):
        assert len(set(a) ^ set(b)) <= 4 and sum(n for _, _, n in set(a) ^ set(b)) <= 64, (a, b)
    w_dp, w_net = four["report"]["what_if"]
    assert (w_dp["world_size"], [r["rank"] for r in w_dp["ranks"]]) == (2, [0, 1])
    assert w_dp["ranks"][0]["iter_s"] > 0 and w_dp["ranks"][0]["peak_tensor_bytes"] is None
    assert (w_net["world_size"], w_net["topology"]) == (4, "h200-nvlink-ib")
    # on an NVLink network the same program's communication is cheaper than on loopback gloo
    assert w_net["ranks"][0]["breakdown_s"]["comm"] < four["report"]["ranks"][0]["breakdown_s"]["comm"]
    assert "what-if 'dp=1': world 2" in four["stdout"]


def test_recovery_costs_from_the_scale_bench_take_the_row_at_the_emulated_world(tmp_path):
    """`--recovery-costs` on `pitstop bench scale`'s JSON: the row at the emulated world size,
    else the nearest finished one, and the source names which (a world-8 run's costs would
    say nothing of 8,192 ranks' control plane)."""
    import json

    import pytest

    from pitstop.errors import ConfigError
    from pitstop.launch.emulate import load_recovery_costs

    def row(n, detect, path, **kw):
        return {"backend": "tcpstore", "ranks": n, "machines": n // 8, "detect_machine_s": detect,
                "control_path_killed_s": path, **kw}

    f = tmp_path / "scale.json"
    f.write_text(json.dumps({"rows": [row(64, 0.1, 0.2), row(1024, 0.3, 0.4), row(8192, 9.0, 9.0, error="x"),
                                      {**row(8192, 0.5, 0.6), "backend": "etcd"}]}))
    c = load_recovery_costs(f, 1024)
    assert (c.detect_s, c.plan_s) == (0.3, 0.4) and "at 1024 simulated ranks" in c.source
    c = load_recovery_costs(f, 8192)  # the 8,192 row failed and etcd's is another backend: the nearest
    assert (c.detect_s, c.plan_s) == (0.3, 0.4) and "nearest to world 8192, at 1024" in c.source
    c = load_recovery_costs(f, 48)
    assert (c.detect_s, c.plan_s) == (0.1, 0.2)
    f.write_text(json.dumps({"rows": [row(64, 0.1, 0.2, error="roster")]}))
    with pytest.raises(ConfigError, match="no finished tcpstore row"):
        load_recovery_costs(f, 64)
