"""Checkpoint-restart with Megatron-Core dist_checkpointing on pitstop's groups (CPU/gloo).

World 8, tp2 pp2 dp2, dropout on (so RNG state matters):

* A: 6 steps uninterrupted;
* B: 3 steps, save at step 3, exit;
* C: fresh processes and a fresh control store, load step 3, run 4..6.

C's per-step losses and final per-rank parameter checksums equal A's bitwise.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import ROOT, wait_done
from pitstop.launch.local import LocalJob

pytest.importorskip("megatron.core")

WORKER = str(ROOT / "tests" / "workers" / "ckpt_worker.py")
TRAIN = ["--tp", "2", "--pp", "2", "--steps", "6", "--dropout", "0.1"]


def _run(tmp_path: Path, name: str, *own: str) -> dict:
    """One run on a fresh LocalJob (own store), as a real relaunch has; per-rank records."""
    out = tmp_path / f"out_{name}"
    job = LocalJob(tmp_path / name)
    try:
        ctx = job.start(name, [WORKER, "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(out), *own, *TRAIN],
                        range(8), 8)
        wait_done(job, ctx, timeout=240)
    finally:
        job.close()
    recs = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("rank_*.json")}
    assert sorted(recs) == list(range(8)), f"{name}: records from ranks {sorted(recs)}"
    return recs


def _losses(recs: dict) -> dict:
    """step -> loss_hex, from every last-stage rank (they all hold the DP-averaged loss)."""
    out: dict = {}
    for r in recs.values():
        for step, hx in r["steps"].items():
            assert out.setdefault(int(step), hx) == hx, f"ranks disagree on step {step}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_from_checkpoint_is_bitwise_identical(tmp_path):
    from pitstop.runtime import checkpoint

    a = _run(tmp_path, "a")
    b = _run(tmp_path, "b", "--stop-after", "3", "--save-at", "3")
    assert checkpoint.latest_step(tmp_path / "ckpt") == 3
    meta = checkpoint.read_meta(tmp_path / "ckpt")
    assert meta["layout"]["world_size"] == 8 and meta["layout"]["dp"] == 2
    assert meta["extra"] == {"consumed_samples": 3 * 2 * 2 * 2}
    assert not list((tmp_path / "ckpt").glob("*.tmp"))
    c = _run(tmp_path, "c", "--resume")

    la, lb, lc = _losses(a), _losses(b), _losses(c)
    assert sorted(la) == [1, 2, 3, 4, 5, 6]
    assert {s: la[s] for s in (1, 2, 3)} == lb
    assert sorted(lc) == [4, 5, 6]
    assert {s: la[s] for s in (4, 5, 6)} == lc
    assert {r: a[r]["param_sha256"] for r in a} == {r: c[r]["param_sha256"] for r in c}
    assert all(c[r]["extra"] == meta["extra"] for r in c)

    save_s = max(r["save_s"] for r in b.values())
    load_s = max(r["load_s"] for r in c.values())
    print(json.dumps({"save_s": round(save_s, 3), "load_s": round(load_s, 3)}))


def test_missing_checkpoint_errors_name_the_directory(tmp_path):
    from pitstop.runtime import checkpoint

    assert checkpoint.latest_step(tmp_path) is None
    with pytest.raises(checkpoint.CheckpointNotFoundError, match=re.escape(str(tmp_path / "latest"))):
        checkpoint.load(tmp_path, [], None)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match=re.escape(str(tmp_path))):
        checkpoint.read_meta(tmp_path)
    (tmp_path / "latest").write_text("garbage\n")
    with pytest.raises(checkpoint.CheckpointError, match="expected a step number"):
        checkpoint.latest_step(tmp_path)
    (tmp_path / "latest").write_text("7\n")
    (tmp_path / "iter_0000007").mkdir()  # a save that died before dist_checkpointing finished
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="iter_0000007 is missing or incomplete"):
        checkpoint.load(tmp_path, [], None)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="iter_0000007 has no pitstop.json"):
        checkpoint.read_meta(tmp_path)


def _draws():
    import random

    import numpy as np
    import torch

    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_rng_is_written_as_json_and_restored_and_an_old_pickled_file_still_loads(tmp_path):
    """The checkpoint's RNG file is the snapshot's JSON form (one capture for both); a rank's
    streams come back exactly. A checkpoint an earlier pitstop wrote (``rank_NNNNN.pt``, its
    own keys) still restores the same streams."""
    import random

    import numpy as np
    import torch

    from pitstop.runtime import checkpoint

    (tmp_path / "rng").mkdir()
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    checkpoint._write_rng(checkpoint._rng_file(tmp_path, 0))
    assert checkpoint._rng_file(tmp_path, 0).name == "rank_00000.json"
    json.loads(checkpoint._rng_file(tmp_path, 0).read_text())  # JSON, not a pickle
    want = _draws()
    checkpoint._read_rng(tmp_path, 0)
    assert _draws() == want

    from megatron.core import tensor_parallel

    legacy = tmp_path / "old"
    (legacy / "rng").mkdir(parents=True)
    old = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), "cuda": None,
           "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    torch.save(old, legacy / "rng" / "rank_00002.pt")
    want = _draws()
    checkpoint._read_rng(legacy, 2)
    assert _draws() == want
    with pytest.raises(checkpoint.CheckpointError, match="no RNG state for rank 1"):
        checkpoint._read_rng(legacy, 1)


def test_a_scripts_checkpoint_declaration_is_read_checked_and_junk_refused(tmp_path):
    """The controller's fallback resumes from the checkpoints world rank 0 declared (Megatron-LM's
    ``--save``), read over the store: a marker in an absolute directory gives its step; a
    relative directory, a path for a marker, a marker that is not a step number, an unsealed
    value, each is refused or reported, and the fallback then has no checkpoint. A real
    TCPStore and the real sealed channel."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from pitstop import protocol
    from pitstop.launch.restart import Restarts
    from pitstop.runtime import keys
    from pitstop.runtime.config import RuntimeConfig

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    refused = []
    ch = protocol.Channel(store, b"t" * 32, on_refused=lambda key, why: refused.append((key, why)))
    me = SimpleNamespace(cfg=RuntimeConfig(), ch=ch, run_dir=tmp_path)
    latest = lambda c: Restarts(c).latest_checkpoint()  # noqa: E731 - the controller's restart piece
    assert latest(me) == (None, "the script declared no checkpoints of its own")

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "latest_checkpointed_iteration.txt").write_text("12\n")
    ch.put(keys.CHECKPOINT, {"dir": str(d), "marker": "latest_checkpointed_iteration.txt"})
    assert latest(me)[0] == 12 and not refused

    for body in ({"dir": "ckpt", "marker": "latest_checkpointed_iteration.txt"},
                 {"dir": str(d), "marker": "../../etc/passwd"},
                 {"dir": str(d), "marker": ".."}):
        ch.put(keys.CHECKPOINT, body)
        assert latest(me) == (None, "the script's checkpoint declaration was refused"), body
    assert len(refused) == 3 and all("expected an absolute directory and a file name" in why for _, why in refused)

    (d / "latest_checkpointed_iteration.txt").write_text("release\n")  # Megatron-LM's name for a release checkpoint
    ch.put(keys.CHECKPOINT, {"dir": str(d), "marker": "latest_checkpointed_iteration.txt"})
    step, where = latest(me)
    assert step is None and "'release'" in where and "expected a step number" in where

    store.set(keys.CHECKPOINT, json.dumps({"dir": str(d), "marker": "x"}))  # not sealed with the job token
    assert latest(me) == (None, "the script declared no checkpoints of its own")
    assert len(refused) == 4 and refused[-1][0] == keys.CHECKPOINT
