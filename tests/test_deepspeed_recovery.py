"""Tier 3: standby replacement and drain of a real DeepSpeed engine (ZeRO 0, 1, 2 and 3) on CPU.

World 4, pure data parallel, ``examples/train_deepspeed.py`` under ``pitstop launch``.
Real processes are SIGKILLed by the fault injector at a chosen step and phase; a standby
takes the role with state from the data-parallel peers (the buddy copy of the ZeRO
partition, then DeepSpeed's own all-gather of the parameters); no checkpoint exists.
Every per-step loss and every rank's final state checksum (parameters, its ZeRO partition's
master weights and moments, loss scaler, counters) must be bitwise equal to an uninterrupted
run, in fp32 and in bf16, and no reference to a retired group may survive the swap.
"""

import pytest

pytest.importorskip("deepspeed")

from pitstop.launch.controller import request_drain  # noqa: E402
from pitstop.launch.runs import ROOT, run_job, wait_for_step  # noqa: E402
from pitstop.runtime.faults import Fault  # noqa: E402

SCRIPT = str(ROOT / "examples" / "train_deepspeed.py")
STEPS = 6
# DeepSpeed's import and engine build keep two shared cores busy for seconds; a heartbeat
# missed for 5 s there is load, not a hang
LAUNCH = ["--heartbeat-timeout", "15"]


def _gpt(stage, *extra):
    return [SCRIPT, "--zero-stage", str(stage), "--checksum", *extra]


def _assert_same(res, ref, n_ranks=4):
    """Same losses, same parameters, and rank by rank the same whole state (the example's
    ``param_sha256``: parameters, the rank's ZeRO partition of master weights and moments, the
    loss scaler, the step counters)."""
    assert res.code == 0 and ref.code == 0, res.tails()
    assert sorted(res.losses) == list(range(1, len(ref.losses) + 1)), res.tails()
    assert res.losses == ref.losses, (res.losses, ref.losses)
    models = {d["model_sha256"] for d in ref.stats}
    assert len(models) == 1, ref.stats  # data parallel: every rank holds the same parameters
    assert {d["model_sha256"] for d in res.stats} == models, res.stats
    assert sorted(res.checksums) == list(range(n_ranks)), res.tails()
    assert res.checksums == ref.checksums, (res.checksums, ref.checksums)


def _bf16_reference(run_dir, steps, stage, *extra):
    """The uninterrupted bf16 run; checks the mixed-precision path really ran and that the state
    checksums see each rank's own partition (they differ between ranks at ZeRO 1/2; at ZeRO 0
    every rank holds all master weights)."""
    ref = run_job(run_dir, steps, nproc=4, gpt=_gpt(stage, "--bf16", *extra), timeout=400)
    assert ref.code == 0, ref.tails()
    assert all(d["dtypes"] == {"params": ["torch.bfloat16"], "master": ["torch.float32"]} for d in ref.stats), ref.stats
    assert len(set(ref.checksums.values())) == (1 if stage == 0 else 4), ref.checksums
    return ref


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage,faults,roles", [
    (1, Fault.kill(rank=1).at(step=2, phase="optimizer") + Fault.kill(rank=3).at(step=4, phase="param-gather"), [1, 3]),
    (2, Fault.kill(rank=2).at(step=2, phase="backward") + Fault.kill(rank=0).at(step=4, phase="grad-reduce"), [2, 0]),
    # ZeRO 0 in fp32: DeepSpeed's engine.optimizer is the torch optimizer itself, no wrapper
    (0, Fault.kill(rank=3).at(step=3, phase="optimizer"), [3]),
    # ZeRO-3: partitioned parameters; its engine broadcasts over the world group at the first two
    # forwards (the parameter coordinator's trace), so step 2's kill lands among world operations
    (3, Fault.kill(rank=2).at(step=2, phase="backward") + Fault.kill(rank=0).at(step=4, phase="optimizer"), [2, 0]),
])
def test_zero_sigkill_replacement_is_bitwise_identical(tmp_path, stage, faults, roles):
    ref = run_job(tmp_path / "ref", STEPS, nproc=4, gpt=_gpt(stage), timeout=400)
    # each rank's checksum covers its own partition (so a wrong hand-over could not hide)
    assert len(set(ref.checksums.values())) == (1 if stage == 0 else 4), ref.checksums
    res = run_job(tmp_path / "run", STEPS, standby=2, faults=faults.spec(), nproc=4, gpt=_gpt(stage), timeout=600,
                  launch_args=LAUNCH)
    _assert_same(res, ref)
    rep = res.of("replaced")
    assert [e["role"] for e in rep] == roles, res.tails()
    assert all(e["stale_refs"] == 0 and e["swapped"] > 0 for e in rep), rep
    assert not res.of("restarted") and not res.of("fallback"), res.tails()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_planned_drain_is_bitwise_identical(tmp_path, stage):
    """The drain is asked for once step 1 is logged; ``--step-delay`` keeps the job running
    long enough for the standby to build its engine and the switch to land mid-run. At ZeRO-3
    the leaver hands over its parameter partitions and persistent parameters too."""
    steps, slow = 24, ["--step-delay", "0.5"]
    ref = run_job(tmp_path / "ref", steps, nproc=4, gpt=_gpt(stage, *slow), timeout=400)

    def during(run_dir):
        wait_for_step(run_dir, 1)
        request_drain(run_dir, rank=2)

    res = run_job(tmp_path / "run", steps, standby=1, nproc=4, gpt=_gpt(stage, *slow), timeout=600, during=during,
                  launch_args=LAUNCH)
    _assert_same(res, ref)
    d = res.of("drained")
    assert len(d) == 1 and d[0]["role"] == 2 and d[0]["generation"] == 1, res.tails()
    assert d[0]["pause_s"] is not None and d[0]["pause_s"] < 5 and d[0]["stale_refs"] == 0, d


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [3, 2, 1, 0])
def test_bf16_sigkill_replacement_is_bitwise_identical(tmp_path, stage):
    """bf16 parameters and activations, fp32 master weights and Adam moments: at ZeRO 1/2 in the
    rank's partition, whose bf16 parameters DeepSpeed's ``update_lp_params`` rebuilds; at ZeRO 0
    (DeepSpeed's FP16_UnfusedOptimizer) all of them, rounded into the bf16 parameters by pitstop.
    The joiner takes master weights, moments, loss scaler and counters from the buddy copy.
    Killed mid-backward (gradients half reduced) and just before the optimizer step."""
    ref = _bf16_reference(tmp_path / "ref", STEPS, stage)
    faults = Fault.kill(rank=2).at(step=2, phase="backward") + Fault.kill(rank=0).at(step=4, phase="optimizer")
    res = run_job(tmp_path / "run", STEPS, standby=2, faults=faults.spec(), nproc=4, gpt=_gpt(stage, "--bf16"),
                  timeout=600, launch_args=LAUNCH)
    _assert_same(res, ref)
    rep = res.of("replaced")
    assert [e["role"] for e in rep] == [2, 0], res.tails()
    assert all(e["stale_refs"] == 0 and e["swapped"] > 0 for e in rep), rep
    assert not res.of("restarted") and not res.of("fallback"), res.tails()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_zero2_planned_drain_is_bitwise_identical(tmp_path):
    """The leaver hands its snapshot (fp32 partition, moments, scaler, counters) and its bf16
    flat parameter groups to the joiner at a boundary, as in fp32."""
    steps, slow = 24, ["--step-delay", "0.5"]
    ref = _bf16_reference(tmp_path / "ref", steps, 2, *slow)

    def during(run_dir):
        wait_for_step(run_dir, 1)
        request_drain(run_dir, rank=2)

    res = run_job(tmp_path / "run", steps, standby=1, nproc=4, gpt=_gpt(2, "--bf16", *slow), timeout=600,
                  during=during, launch_args=LAUNCH)
    _assert_same(res, ref)
    d = res.of("drained")
    assert len(d) == 1 and d[0]["role"] == 2 and d[0]["generation"] == 1, res.tails()
    assert d[0]["pause_s"] is not None and d[0]["pause_s"] < 5 and d[0]["stale_refs"] == 0, d


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_without_standby_falls_back_to_deepspeeds_own_checkpoint(tmp_path, stage):
    """No standby: every process restarts and DeepSpeed's ``load_checkpoint`` (of the
    ``save_checkpoint`` pitstop made every 2 steps) resumes the run bit for bit."""
    ref = run_job(tmp_path / "ref", STEPS, nproc=4, gpt=_gpt(stage), timeout=400)
    kill = Fault.kill(rank=1).at(step=4, phase="optimizer")
    res = run_job(tmp_path / "run", STEPS, standby=0, faults=kill.spec(), nproc=4, gpt=_gpt(stage), timeout=600,
                  launch_args=LAUNCH + ["--save-interval", "2"])
    fb = res.of("fallback")
    assert len(fb) == 1 and fb[0]["resume_step"] == 2, res.tails()
    assert (tmp_path / "run" / "checkpoints" / "iter_0000002").is_dir()  # DeepSpeed's own files, pitstop's tag
    _assert_same(res, ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_emulated_zero2_rank_reports_the_real_runs_peak_memory(tmp_path):
    """``pitstop emulate`` of the DeepSpeed job at world 4 with one real rank: its peak tensor
    bytes equal rank 0's in a real world-4 run exactly (ZeRO partitions and buckets depend on
    the world size, so a world-1 run would not do)."""
    from conftest import run_checksums
    from pitstop.launch.emulate import EmulateSpec, measure_memory

    args = ["--zero-stage", "2", "--steps", "3"]
    recs = run_checksums(tmp_path / "real", [SCRIPT, *args, "--checksum", "--track-memory"], 4)
    peaks = {r: rec["peak_tensor_bytes"] for r, rec in recs.items()}
    emulated = measure_memory(EmulateSpec(4, 1, 1, [0], [SCRIPT, *args], tmp_path / "emu", timeout_s=400))
    assert peaks[0] > 1_000_000 and emulated[0] == peaks[0], (emulated, peaks)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage,extra", [(2, ()), (3, ("--bf16",))])
def test_a_standby_warmed_in_the_sandbox_takes_the_role_warm_and_bitwise(tmp_path, stage, extra):
    """Rank 0 records its set-up and step 1; the standby replays them in the sandbox, with its
    own engine on virtual groups, while training holds (``--hold-for-warm``), then tears that
    engine down. The sandbox's own inputs to the recorded operations (its gradients, its
    partition) must equal the recorder's bit for bit: a replayed result is not evidence that the
    sandbox computed anything. Then rank 2 is SIGKILLed; the warmed standby takes the role, and
    nothing the sandbox left in the process (DeepSpeed's counters and globals, ZeRO-3's
    ``ds_id`` numbering, an mpu) may change a bit of the run."""
    gpt = _gpt(stage, *extra)
    ref = run_job(tmp_path / "ref", STEPS, nproc=4, gpt=gpt, timeout=400, launch_args=LAUNCH + ["--no-warmup"])
    kill = Fault.kill(rank=2).at(step=4, phase="backward")
    res = run_job(tmp_path / "run", STEPS, standby=1, faults=kill.spec(), nproc=4, gpt=gpt, timeout=600,
                  launch_args=LAUNCH + ["--hold-for-warm", "300"])
    _assert_same(res, ref)
    rec = res.of("recorded")
    assert [(e["cls"], e["role"]) for e in rec] == [("only", 0)], res.tails()
    warmed = res.of("warmed")
    assert len(warmed) == 1 and warmed[0]["ok"], res.tails()
    (cls,) = warmed[0]["classes"]
    # every recorded operation was asked for by the sandbox's own engine, in order
    assert cls["ok"] and cls["role"] == 0 and cls["ops"] == rec[0]["ops"] > 0, (cls, rec)
    assert cls["local_checked"] > 0 and cls["local_equal"] == cls["local_checked"], cls
    rep = res.of("replaced")
    assert [(e["role"], e["warm"]) for e in rep] == [(2, True)], res.tails()
    assert rep[0]["stale_refs"] == 0 and rep[0]["swapped"] > 0, rep
