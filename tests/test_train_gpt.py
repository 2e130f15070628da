"""Tier 3: the real Megatron-Core GPT (DDP, distributed optimizer, 1F1B pipeline) on CPU.

World 8, tp2 pp2 dp2, pitstop-owned groups: two runs give bitwise-identical per-step
losses and parameter checksums, and they match a run on Megatron's own groups
(bitwise at step 1; to 1e-5 after, as the composed grad-norm reduction sums in
another order).
"""

import json
from pathlib import Path

import pytest

from conftest import ROOT, wait_done
from pitstop.launch.local import LocalJob

pytest.importorskip("megatron.core")

SCRIPT = str(ROOT / "examples" / "train_gpt.py")
STEPS = 4


def _run(name, tmp_path, *extra):
    # a fresh job (and control store) per run, as a real launch has
    job = LocalJob(tmp_path / name)
    try:
        return _train(job, name, tmp_path, *extra)
    finally:
        job.close()


def _train(job, name, tmp_path, *extra):
    loss_file = tmp_path / f"{name}.jsonl"
    ctx = job.start(name, [SCRIPT, "--tp", "2", "--pp", "2", "--steps", str(STEPS), "--loss-file", str(loss_file),
                           "--checksum", *extra], range(8), 8)
    wait_done(job, ctx, timeout=240)
    losses = [json.loads(l) for l in loss_file.read_text().splitlines()]
    sums = {}
    for path in ctx.stdouts.values():
        for line in Path(path).read_text().splitlines():
            if line.startswith('{"rank"'):
                rec = json.loads(line)
                sums[rec["rank"]] = rec["param_sha256"]
    return losses, sums


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_world8_gpt_is_bitwise_deterministic_on_pitstop_groups(tmp_path):
    a_loss, a_sum = _run("a", tmp_path, "--pitstop")
    b_loss, b_sum = _run("b", tmp_path, "--pitstop")
    m_loss, m_sum = _run("m", tmp_path, "--megatron-groups")
    assert [r["step"] for r in a_loss] == list(range(1, STEPS + 1))
    assert len(a_sum) == 8
    assert [r["loss_hex"] for r in a_loss] == [r["loss_hex"] for r in b_loss]
    assert a_sum == b_sum
    # the model learns: loss falls over the run
    assert a_loss[-1]["loss"] < a_loss[0]["loss"]
    # pitstop's groups give Megatron's numbers up to reduction order: the grad-norm
    # all-reduce over the world-spanning group is composed (tp-ep-pp, then edp), so the
    # fp32 norm may differ from Megatron's flat world all-reduce in its last bits.
    for a, m in zip(a_loss, m_loss):
        assert a["loss"] == pytest.approx(m["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-5)
    assert a_loss[0]["loss_hex"] == m_loss[0]["loss_hex"]  # same init, same data, same groups' ranks


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compile_trains_like_eager(tmp_path):
    """``--compile`` compiles every transformer layer on CPU (world 2: tp1 pp2, so both the
    first and the last stage's layers compile) and trains to eager's numbers within fp32
    rounding (inductor fuses differently, so not bit for bit)."""
    def run(name, *extra):
        job = LocalJob(tmp_path / name)
        try:
            loss_file = tmp_path / f"{name}.jsonl"
            ctx = job.start(name, [SCRIPT, "--pp", "2", "--steps", "3", "--loss-file", str(loss_file), *extra], range(2), 2)
            wait_done(job, ctx, timeout=500)
            logs = "".join(Path(p).read_text() for p in ctx.stderrs.values())
            return [json.loads(l) for l in loss_file.read_text().splitlines()], logs
        finally:
            job.close()

    eager, _ = run("eager")
    compiled, logs = run("compiled", "--compile")
    assert logs.count("compiled 2 transformer layers") == 2, logs[-3000:]
    assert [r["step"] for r in compiled] == [1, 2, 3]
    for e, c in zip(eager, compiled):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-5) and c["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-4)
