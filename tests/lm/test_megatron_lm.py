"""Tier 3: Megatron-LM's own loop (``megatron.training.pretrain``, megatron-core 0.19) under pitstop.

``examples/pretrain_gpt.py`` is a Megatron-LM script with pitstop's one import line. World 8
(tp2 pp2 dp2), the distributed optimizer, overlapped grad reduce and param gather, dropout 0.1
and ``--manual-gc``, on CPU. The ground truth is a plain ``torchrun`` of the same script, where
every pitstop hook passes through (no pitstop store, groups, session or launcher):

* an uninterrupted ``pitstop launch`` logs the same losses as Megatron-LM prints them and ends
  with the same parameters, bit for bit, on every rank;
* so does a run whose rank 5 is SIGKILLed in step 3's backward pass and replaced by a standby,
  and the controller's ``replaced`` event says the replacement happened; the same with
  ``--bf16``, against a plain bf16 run;
* so does a drain of rank 2 onto a standby;
* and, with no standby, a SIGKILL and a restart from Megatron-LM's own ``--save`` checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from importlib.metadata import version as _version
from packaging.version import Version

# the second lane (Makefile: .venv-lm); a lane without megatron-core 0.19 is a broken install, not a skip
if not Version("0.19") <= Version(_version("megatron-core")) < Version("0.20"):
    raise RuntimeError(f"tests/lm run on megatron-core 0.19.x (make venv-lm), found {_version('megatron-core')}")

from pitstop.bench import megatron_lm as bench  # noqa: E402  (the bench runs the same job)
from pitstop.bench.megatron_lm import args_for, drain_at_once, launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "pretrain_gpt.py")
STEPS = 20
ARGS = args_for(STEPS)
ENV = dict(os.environ, **bench.ENV)

_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+)")


def _parse(text: str):
    """(the losses Megatron-LM logged, by iteration; each rank's parameter checksum)."""
    losses = {int(m.group(1)): m.group(2) for m in _LOSS.finditer(text)}
    sums = {}
    for line in text.splitlines():
        if line.startswith('{"rank"'):
            d = json.loads(line)
            sums[d["rank"]] = d["param_sha256"]
    return losses, sums


def _tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


def _logs(run_dir: Path) -> str:
    """Every process's stdout, and the tail of each one's stderr (printed when a test fails)."""
    out = []
    for f in sorted(run_dir.glob("logs/*/*/*/*/std*.log")):
        text = f.read_text(errors="replace")
        out.append(f"==== {f.relative_to(run_dir)}\n" + (text if f.name == "stdout.log" else _tail(text, 25)))
    return "\n".join(out)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same script under plain torchrun: Megatron-LM alone, the ground truth."""
    return _plain(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def plain_log5(tmp_path_factory):
    return _plain(tmp_path_factory.mktemp("plain-log5"), ["--log-interval", "5"], every=5)


@pytest.fixture(scope="module")
def plain_bf16(tmp_path_factory):
    return _plain(tmp_path_factory.mktemp("plain-bf16"), ["--bf16"])


def _plain(d: Path, extra=(), every: int = 1):
    out = d / "out.log"
    # each rank's output to a file of its own (-r 3): eight processes writing one stream can
    # run two checksum lines together
    with open(out, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                               "--log-dir", str(d / "ranks"), "-r", "3", SCRIPT, *ARGS, *extra], stdout=f,
                              stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, timeout=400)
    text = out.read_text(errors="replace") + "\n".join(
        f.read_text(errors="replace") for f in sorted((d / "ranks").glob("**/std*.log")))
    assert proc.returncode == 0, _tail(text, 120)
    losses, sums = _parse(text)
    assert sorted(losses) == sorted({1, *range(every, STEPS + 1, every)}), _tail(text, 120)
    assert len(sums) == 8 and len(set(sums.values())) == 4, sums  # dp peers hold the same parameters
    return losses, sums


def _launch(run_dir: Path, standby: int, fault: str = "", during=None, restarts: int = 0, extra=(), warmup=False):
    """``pitstop launch`` of the script (the bench's launcher); ``during(run_dir)`` runs while the job does."""
    try:
        code, err, events = launch(run_dir, STEPS, standby, fault=fault, during=during, restarts=restarts,
                                   extra=tuple(extra), root=ROOT, warmup=warmup)
    except BaseException:
        print(_logs(run_dir)[-20000:])
        raise
    logs = _logs(run_dir)
    assert code == 0, f"{_tail(err)}\n{json.dumps(events)[-3000:]}\n{logs[-20000:]}"
    losses, sums = _parse(logs)
    return losses, sums, events, logs


def _pids(logs: str) -> dict:
    """Each rank's process id, from the checksum lines of the processes that ended the run."""
    return {json.loads(line)["rank"]: json.loads(line)["pid"] for line in logs.splitlines() if line.startswith('{"rank"')}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_uninterrupted_pitstop_run_is_megatron_lm_bit_for_bit(plain, tmp_path):
    losses, sums, events, logs = _launch(tmp_path / "run", standby=0)
    assert [e["event"] for e in events if e["event"] in ("failure", "replaced", "done")] == ["done"]
    assert losses == plain[0], logs[-10000:]
    assert sums == plain[1], logs[-10000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sigkill_in_the_backward_pass_is_replaced_bit_for_bit(plain, tmp_path):
    from pitstop.runtime.faults import Fault

    fault = Fault.kill(rank=5).at(step=3, phase="backward")
    losses, sums, events, logs = _launch(tmp_path / "run", standby=1, fault=fault.spec())
    replaced = [e for e in events if e["event"] == "replaced"]
    assert len(replaced) == 1 and replaced[0]["role"] == 5 and "SIGKILL" in replaced[0]["reason"], events
    assert not [e for e in events if e["event"] in ("fallback", "failed", "abandoned")], events
    # the joiner, a process that did not exist before the kill, computed rank 5's last steps
    pids = _pids(logs)
    assert replaced[0]["new"].endswith(f":{pids[5]}") and not replaced[0]["old"].endswith(f":{pids[5]}"), \
        (pids, replaced)
    assert losses == plain[0], logs[-10000:]
    assert sums == plain[1], logs[-10000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_warmed_standby_replaces_a_rank_bit_for_bit(plain, tmp_path):
    """Warmup on (the default): ranks 0 and 4 record Megatron-LM's set-up and iteration 1; the
    standby runs the script's own ``pretrain`` in its sandbox as each (first and last stage),
    answered from those records, and goes back to waiting with Megatron-LM's globals restored.
    Then rank 5 dies in step 6's backward pass; the warmed standby takes its role bit for bit."""
    from pitstop.runtime.faults import Fault

    fault = Fault.kill(rank=5).at(step=6, phase="backward")
    losses, sums, events, logs = _launch(tmp_path / "run", standby=1, fault=fault.spec(), warmup=True)
    assert {e["cls"]: e["role"] for e in events if e["event"] == "recorded"} == {"first": 0, "last": 4}, events
    warmed = [e for e in events if e["event"] == "warmed"]
    assert len(warmed) == 1 and warmed[0]["ok"] and warmed[0]["stopped"] == "", warmed
    classes = warmed[0]["classes"]
    assert [c["cls"] for c in classes] == ["first", "last"], classes
    for c in classes:
        # the sandbox computed iteration 1 itself: every operation's own inputs equal the recorder's
        assert c["ok"] and c["local_checked"] > 0 and c["local_equal"] == c["local_checked"], c
        assert c["out"]["update_successful"] is True, c
    assert classes[0]["out"]["grad_norm"] == classes[1]["out"]["grad_norm"], classes
    # ... and its loss is the one Megatron-LM alone logged for iteration 1
    assert f"{classes[1]['out']['loss']:.6E}" == plain[0][1], (classes[1], plain[0][1])
    replaced = [e for e in events if e["event"] == "replaced"]
    assert len(replaced) == 1 and replaced[0]["role"] == 5 and replaced[0]["warm"] is True, events
    pids = _pids(logs)
    assert replaced[0]["new"] == f"vm:{warmed[0]['pid']}" or replaced[0]["new"].endswith(f":{warmed[0]['pid']}")
    assert replaced[0]["new"].endswith(f":{pids[5]}"), (pids, replaced)
    assert losses == plain[0], logs[-10000:]
    assert sums == plain[1], logs[-10000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_a_sigkill_of_the_logging_rank_is_replaced_bit_for_bit(plain, plain_bf16, tmp_path):
    """``--bf16``: Megatron's Float16Module, bf16 parameters with the distributed optimizer's
    fp32 main copies, which the snapshot carries; the joiner's bf16 parameters come back from
    the all-gather of those. The victim is rank 7, the last pipeline rank, which Megatron-LM
    logs from: its joiner's lines are the uninterrupted run's (its first iteration is not
    logged as a job's first, whose next line averages two iterations)."""
    from pitstop.runtime.faults import Fault

    fault = Fault.kill(rank=7).at(step=3, phase="backward")
    losses, sums, events, logs = _launch(tmp_path / "run", standby=1, fault=fault.spec(), extra=["--bf16"])
    replaced = [e for e in events if e["event"] == "replaced"]
    assert len(replaced) == 1 and replaced[0]["role"] == 7, events
    assert re.search(r"^\s*bf16 \.+ True$", logs, re.M), logs[-5000:]  # Megatron-LM's own argument dump
    assert plain_bf16[0] != plain[0]  # bf16 arithmetic is in effect
    assert losses == plain_bf16[0], logs[-10000:]
    assert sums == plain_bf16[1], logs[-10000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_at_log_interval_5_the_joiner_carries_megatron_lms_running_loss_sum(plain_log5, tmp_path):
    """``--log-interval 5``: Megatron-LM prints the mean of the last five iterations, from a
    running sum on the last pipeline rank. Rank 7, that rank, dies in step 8's backward pass;
    the joiner starts from its dp peer's sums as they stood after step 7, so the line of
    iteration 10 still averages iterations 6 to 10 and equals Megatron-LM's own."""
    from pitstop.runtime.faults import Fault

    fault = Fault.kill(rank=7).at(step=8, phase="backward")
    losses, sums, events, logs = _launch(tmp_path / "run", standby=1, fault=fault.spec(),
                                         extra=["--log-interval", "5"])
    replaced = [e for e in events if e["event"] == "replaced"]
    assert len(replaced) == 1 and replaced[0]["role"] == 7 and replaced[0]["step"] == 8, events
    pids = _pids(logs)
    assert replaced[0]["new"].endswith(f":{pids[7]}"), (pids, replaced)
    assert sorted(losses) == [1, 5, 10, 15, 20], losses
    assert losses == plain_log5[0], logs[-10000:]
    assert sums == plain_log5[1], logs[-10000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_drain_hands_the_role_over_bit_for_bit(plain, tmp_path):
    """The drain is asked for as soon as the job runs: the controller starts it once the roster
    is up, the standby builds role 2 beside the training (phase 1) and takes it over at a vote.
    Megatron-LM's loop does world operations between its steps (timers, logging), so the switch
    happens where the next ``train_step`` begins (``Session(switch_at_next_step=True)``)."""
    losses, sums, events, logs = _launch(tmp_path / "run", standby=1, during=drain_at_once(2))
    drained = [e for e in events if e["event"] == "drained"]
    assert len(drained) == 1 and drained[0]["role"] == 2, events
    assert not [e for e in events if e["event"] in ("failure", "replaced", "fallback", "failed")], events
    # rank 2's checksum comes from the joiner, a process other than the one that started as rank 2
    pids = _pids(logs)
    assert drained[0]["new"].endswith(f":{pids[2]}") and not drained[0]["old"].endswith(f":{pids[2]}"), \
        (pids, drained)
    assert losses == plain[0], logs[-10000:]
    assert sums == plain[1], logs[-10000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_with_no_standby_the_job_restarts_from_megatron_lms_own_checkpoint(plain, tmp_path):
    """No standby: rank 5 dies in step 6's backward pass, and the controller restarts every
    process from the last checkpoint Megatron-LM saved itself (``--save``, every 4 steps), which
    Megatron-LM's own ``--load`` reads back. The run then ends as the uninterrupted one."""
    from pitstop.runtime.faults import Fault

    ckpt = tmp_path / "ckpt"
    fault = Fault.kill(rank=5).at(step=6, phase="backward")
    run = tmp_path / "run"
    _, sums, events, logs = _launch(run, standby=0, fault=fault.spec(), restarts=1,
                                    extra=["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "4"])
    fb = [e for e in events if e["event"] == "fallback"]
    assert len(fb) == 1 and fb[0]["mode"] == "checkpoint-restart" and fb[0]["resume_step"] == 4, events
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS - STEPS % 4), events
    assert [e["event"] for e in events if e["event"] in ("restarted", "done")] == ["restarted", "done"], events
    # the restarted processes loaded it through Megatron-LM's own --load (rank 0 says so)
    assert re.search(r"successfully loaded checkpoint from \S+ \[.*\] at iteration 4\b", logs), logs[-5000:]
    # the losses the restarted processes logged (the last pipeline rank, 7, logs them)
    restarted = "\n".join(f.read_text(errors="replace") for f in run.glob("logs/w7-e1/*/*/*/stdout.log"))
    losses = _parse(restarted)[0]
    assert sorted(losses) == list(range(5, STEPS + 1)), restarted[-5000:]
    # Megatron-LM's own restart logs a process's first iteration without resetting its sum, so
    # the next line is the mean of both (training_log: should_reset = not is_first_iteration)
    assert float(losses.pop(6)) == pytest.approx((float(plain[0][5]) + float(plain[0][6])) / 2, rel=0, abs=1.5e-6)
    assert losses == {i: v for i, v in plain[0].items() if i >= 5 and i != 6}, restarted[-5000:]
    assert sums == plain[1], logs[-10000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pitstop_emulate_runs_megatron_lms_pretrain_at_world_16_on_two_processes(tmp_path):
    """``pitstop emulate -- pretrain_gpt.py``: world 16 (tp2 pp2 dp4), real ranks 0 and 15,
    every other rank virtual. Rank 15 is a tp rank 1 whose data comes by broadcast from a
    virtual tp rank 0; Megatron-LM's loop still logs finite losses, and the report has both
    real ranks' measured and replayed iteration times and their peak tensor memory."""
    out = tmp_path / "emu"
    args = list(ARGS)
    args[args.index("--train-iters") + 1] = "3"
    args.remove("--checksum")
    proc = subprocess.run([sys.executable, "-m", "pitstop.cli", "emulate", "--world-size", "16", "--tp", "2", "--pp", "2",
                           "--real-ranks", "0,15", "--out", str(out), "--timeout", "300", "--", SCRIPT, *args],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=800)
    logs = "\n".join(f"==== {f}\n{_tail(f.read_text(errors='replace'), 40)}" for f in sorted(out.glob("logs/**/std*.log")))
    assert proc.returncode == 0, f"{_tail(proc.stderr)}\n{logs[-20000:]}"
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 16 and [r["rank"] for r in report["ranks"]] == [0, 15], report
    for r in report["ranks"]:
        assert r["iter_s"] > 0 and r["replayed_iter_s"] > 0 and r["peak_tensor_bytes"] > 0, r
    assert report["ranks"][1]["coords"]["tp"] == 1, report["ranks"][1]
    # Megatron-LM itself ran at world 16 (its argument dump), and rank 15 logged every iteration finite
    traced = "\n".join(f.read_text(errors="replace") for f in out.glob("logs/trace/*/*/*/stdout.log"))
    assert re.search(r"^\s*world_size \.+ 16$", traced, re.M), traced[-3000:]
    losses = _parse(traced)[0]
    assert sorted(losses) == [1, 2, 3] and all(0 < float(v) < 100 for v in losses.values()), losses
