"""``pitstop emulate``: tracer and pacing (tier 1), bad input (no process starts), and the
end-to-end run of the Megatron-Core GPT at world 64 and 8,192 (tier 3)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from pitstop.emulation.graph import Comm, slice_graph
from pitstop.emulation.replay import replay
from pitstop.emulation.synthetic import one_f_one_b_traces
from pitstop.emulation.topology import load
from pitstop.emulation.tracer import PacingOracle, TracingOracle, nbytes_of, peer_offset, schedule_of
from pitstop.errors import ConfigError
from pitstop.launch.emulate import EmulateSpec, parse_ranks, tracers
from pitstop.launch.runs import ROOT
from pitstop.layout import ParallelLayout


class G:
    """The parts of a virtual group an oracle reads."""

    def __init__(self, kind, rank=0, size=2):
        self.kind, self._rank, self._size = kind, rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class Nothing:
    def serve(self, group, what, args):
        pass


# --------------------------------------------------------------------------- tier 1
def test_buffer_sizes_and_pipeline_peers():
    x = torch.zeros(4, 8)  # 128 bytes
    assert nbytes_of("allreduce", ([x],)) == 128
    assert nbytes_of("_allgather_base", (torch.zeros(64), x)) == 256  # the gathered output
    assert nbytes_of("_reduce_scatter_base", (torch.zeros(8), x)) == 128  # the scattered input
    assert nbytes_of("barrier", ()) == 0
    assert peer_offset(G("pp", rank=0, size=4), "send", ([x], 1, 0)) == 1
    assert peer_offset(G("pp", rank=2, size=4), "recv", ([x], 1, 0)) == -1
    assert peer_offset(G("pp", rank=0, size=4), "recv", ([x], 3, 0)) == -1  # wraps, as Megatron's prev rank


def test_tracing_oracle_writes_compute_and_comm_in_order():
    t = TracingOracle(Nothing(), role=4, pp_rank=1, pp=2)
    x = torch.zeros(16)
    t.serve(G("world"), "barrier", ())  # set-up: counted, not traced
    t.serve(G("pp", 1, 2), "recv", ([x], 0, 0))
    time.sleep(0.01)
    t.serve(G("tp"), "allreduce", ([x],))
    t.boundary()
    t.serve(G("pp", 1, 2), "recv", ([x], 0, 0))
    t.boundary()
    tr = t.trace(skip=1)
    assert t.world_ops == 1 and str(tr.role_class) == "last@pp1"
    assert len(tr.iterations) == 1 and [type(o).__name__ for o in tr.iterations[0]] == ["Compute", "Comm", "Compute"]
    first = t.iterations[0]
    assert [o.op for o in first if isinstance(o, Comm)] == ["recv", "all_reduce"]
    assert first[1] == Comm("recv", "pp", 64, -1) and first[3] == Comm("all_reduce", "tp", 64)
    assert first[2].duration_s >= 0.01  # the sleep between the two operations is compute


def test_pacing_follows_the_replayed_schedule():
    p = PacingOracle(Nothing(), [[0.05, 0.1]], skip=0)
    t0 = time.perf_counter()
    p.serve(G("tp"), "allreduce", ([torch.zeros(1)],))
    assert time.perf_counter() - t0 >= 0.05
    p.serve(G("tp"), "allreduce", ([torch.zeros(1)],))
    assert time.perf_counter() - t0 >= 0.1 and p.late == 0 and p.late_s == 0.0
    p.serve(G("tp"), "allreduce", ([torch.zeros(1)],))  # one more than replayed: pacing stops, says why
    assert p.overrun and "more than the 2 replayed" in p.overrun
    p.boundary()
    assert p.iteration == 1 and p.index == 0
    t1 = time.perf_counter()
    p.serve(G("tp"), "allreduce", ([torch.zeros(1)],))  # paced again in the next iteration
    assert time.perf_counter() - t1 >= 0.05
    q = PacingOracle(Nothing(), [[10.0]])  # skip=1: the set-up iteration is not paced
    t2 = time.perf_counter()
    q.serve(G("tp"), "allreduce", ([torch.zeros(1)],))
    assert time.perf_counter() - t2 < 1.0
    late = PacingOracle(Nothing(), [[0.0, 0.01]], skip=0)  # the real compute is slower than replayed
    time.sleep(0.05)
    late.serve(G("tp"), "allreduce", ([torch.zeros(1)],))
    late.serve(G("tp"), "allreduce", ([torch.zeros(1)],))
    assert late.late == 2 and late.late_s >= 0.05 + 0.04, (late.late, late.late_s)  # 0.05 + (0.05 - 0.01)


def test_schedule_of_a_replayed_pipeline_is_relative_to_each_iteration():
    layout = ParallelLayout(2, pp=2)
    graph = slice_graph(layout, one_f_one_b_traces(2, 2, iterations=2, fwd_s=0.01, bwd_s=0.02, act_bytes=4096, grad_bytes=4096))
    result = replay(graph, load("cpu-gloo-loopback"))
    for r in range(2):
        sched = schedule_of(result, r)
        assert len(sched) == 2
        ends = result.iteration_times(r)
        for it, times in enumerate(sched):
            assert times == sorted(times) and 0 <= times[0] and times[-1] <= ends[it] + 1e-12
        comm = [t for t in result.timeline(r) if isinstance(t.op, Comm)]
        assert sum(len(s) for s in sched) == len(comm)


# --------------------------------------------------------------------------- bad input, before any process
def test_real_ranks_are_checked_against_the_world():
    assert parse_ranks("8191,0", 8192) == [0, 8191]
    with pytest.raises(ConfigError, match=r"rank\(s\) \[8192\] outside the world 0..8191"):
        parse_ranks("0,8192", 8192)
    with pytest.raises(ConfigError, match="comma-separated integers"):
        parse_ranks("0;1", 8)
    with pytest.raises(ConfigError, match="named twice"):
        parse_ranks("1,1", 8)


def test_tracers_cover_every_stage_with_the_requested_ranks_first():
    layout = ParallelLayout(8192, tp=8, pp=8)
    t = tracers(layout, [0, 8191])
    assert len(t) == 8 and t[0] == 0 and t[-1] == 8191
    assert [layout.coords(r)["pp"] for r in t] == list(range(8))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pitstop.launch.cli", "emulate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_bad_emulate_input_is_refused_before_anything_starts(tmp_path):
    out = tmp_path / "out"
    r = _cli("--world-size", "12", "--tp", "8", "--pp", "1", "--real-ranks", "0", "--out", str(out), "--", "x.py")
    assert r.returncode == 2 and "tp(8)" in r.stderr and "world_size(12)" in r.stderr, r.stderr
    r = _cli("--world-size", "64", "--tp", "2", "--pp", "2", "--real-ranks", "0,64", "--out", str(out), "--", "x.py")
    assert r.returncode == 2 and "outside the world 0..63" in r.stderr, r.stderr
    topo = tmp_path / "t.json"
    topo.write_text(json.dumps({"gpus_per_node": 8, "intra_node": {"alpha_s": 1e-6}}))
    r = _cli("--world-size", "8", "--real-ranks", "0", "--topology", str(topo), "--out", str(out), "--", "x.py")
    assert r.returncode == 2 and "missing key(s) inter_node" in r.stderr, r.stderr
    assert not out.exists() or not any((out / "logs").glob("*")), "a process was started"


# --------------------------------------------------------------------------- tier 3
def _emulate(tmp_path, world, tp, pp, real, *script_args, emu_args=()):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pitstop.launch.cli", "emulate", "--world-size", str(world), "--tp", str(tp),
           "--pp", str(pp), "--real-ranks", real, "--out", str(out), "--timeout", "400", *emu_args, "--",
           "examples/train_gpt.py", "--tp", str(tp), "--pp", str(pp), "--steps", "4", *script_args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads((out / "report.json").read_text()), json.loads((out / "trace.json").read_text()), r.stdout, out


def _check(report, trace, out, world, real):
    assert report["world_size"] == world and report["real_ranks"] == real
    assert [r["rank"] for r in report["ranks"]] == real
    for r in report["ranks"]:
        b = r["breakdown_s"]
        assert b["total"] == pytest.approx(b["compute"] + b["comm"] + b["comm_wait"] + b["bubble"], abs=5e-6)  # each rounded to 1 us
        assert r["replayed_iter_s"] > 0 and r["iter_s"] > 0 and r["peak_rss_bytes"] > 0
        m = json.loads((out / "metrics" / f"r{r['rank']}.json").read_text())
        assert m["phase"] == "paced" and m["overrun"] is None and m["slept_s"] > 0, m  # paced to the replay
    pids = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert set(real) <= pids, (real, sorted(pids)[:10])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_emulate_gpt_at_world_64(tmp_path):
    report, trace, stdout, out = _emulate(tmp_path, 64, 2, 2, "0,63")
    _check(report, trace, out, 64, [0, 63])
    # the memory phase counted each real rank's tensors; the last stage holds another model half
    peaks = [r["peak_tensor_bytes"] for r in report["ranks"]]
    assert all(p and p > 100_000 for p in peaks) and peaks[0] != peaks[1], peaks
    assert report["tracer_ranks"] == [0, 63] and report["classes"] == 2
    assert "err %" in stdout and "63" in stdout
    # the traced first stage sends its activations to the next stage and reduces over tp and dp
    t0 = json.loads((out / "traces" / "r0.json").read_text())
    comms = {(o["comm"], o.get("group")) for it in t0["iterations"] for o in it if "comm" in o}
    assert ("send", "pp") in comms and ("all_reduce", "tp") in comms
    assert any(c[0] in ("reduce_scatter", "all_gather") and c[1] in ("dp", "dp-cp") for c in comms), comms


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_emulate_gpt_at_world_8192_with_two_real_ranks(tmp_path):
    report, trace, _, out = _emulate(tmp_path, 8192, 8, 2, "0,8191", "--num-heads", "8", emu_args=("--no-memory",))
    assert all(r["peak_tensor_bytes"] is None for r in report["ranks"])  # --no-memory: no memory phase
    assert all(r["init"]["groups"] > 0 and r["init"]["init_s"] > 0 for r in report["ranks"])
    _check(report, trace, out, 8192, [0, 8191])
    assert report["distinct_timelines"] <= 8  # 8,192 ranks, a handful of timelines


def test_peak_tracker_counts_live_storages_exactly():
    import gc

    from pitstop.memory import PeakTracker

    tr = PeakTracker()
    with tr:
        a = torch.empty(1024, dtype=torch.uint8)
        v = a.view(32, 32)  # same storage: counted once
        b = torch.empty(2048, dtype=torch.uint8)
        assert (tr.live_bytes, tr.peak_bytes) == (3072, 3072)
        del a
        assert tr.live_bytes == 3072  # the view keeps the storage alive
        del v
        gc.collect()
        assert tr.live_bytes == 2048
        with tr.paused():
            scratch = torch.empty(4096, dtype=torch.uint8)  # an oracle's, not the program's
        lin = torch.nn.Linear(16, 16)
        assert tr.live_bytes == 2048 + (16 * 16 + 16) * 4 and tr.peak_bytes == tr.live_bytes
    del b, scratch, lin


def test_peak_tracker_follows_a_storage_swapped_under_a_live_tensor():
    """``p.data = other`` frees the old storage while the tensor lives on (Megatron does
    this to its parameters): the tracker must see the old storage go, and a reused
    address must not be mistaken for it."""
    from pitstop.memory import PeakTracker

    tr = PeakTracker()
    with tr:
        p = torch.empty(1000, dtype=torch.uint8)
        p.data = torch.empty(10, dtype=torch.uint8)
        assert tr.live_bytes == 10  # the 1000-byte storage died with the swap
        q = torch.empty(1000, dtype=torch.uint8)  # may reuse the freed address
        assert tr.live_bytes == 1010 and tr.peak_bytes == 1010
    del p, q


# --------------------------------------------------------------------------- memory, tier 3
def _real_peaks(tmp_path, name, *script_args):
    from conftest import run_checksums

    recs = run_checksums(tmp_path / name, ["examples/train_gpt.py", *script_args, "--steps", "3", "--checksum",
                                           "--track-memory"], 2, timeout=240)
    return {r: rec["peak_tensor_bytes"] for r, rec in recs.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_emulated_peak_memory_equals_the_real_runs_byte_for_byte(tmp_path, layout):
    """World 2: a real gloo run of both ranks against ``pitstop emulate`` with the rank
    real and its peer virtual. The peak tensor bytes must be equal, not close."""
    from pitstop.launch.emulate import measure_memory

    tp, pp = (2, 1) if layout == "tp2" else (1, 2)
    args = ["--tp", str(tp), "--pp", str(pp)]
    real = _real_peaks(tmp_path, "real", *args)
    rank = 1 if layout == "pp2" else 0  # pp2: the last stage (loss, receives activations)
    spec = EmulateSpec(2, tp, pp, [rank], ["examples/train_gpt.py", *args, "--steps", "3"], tmp_path / "emu",
                       timeout_s=240)
    emulated = measure_memory(spec)
    assert real[rank] > 1_000_000
    assert emulated[rank] == real[rank], (layout, rank, emulated, real)
