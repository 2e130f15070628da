"""Tier 4 (GPU only): the Megatron GPT example under ``pitstop launch`` on CUDA and NCCL.

One GPU holds one rank, so this is world 1: the runtime's iteration boundary (snapshot,
vote, commit) runs on CUDA tensors and NCCL communicators, twice, with the same seed.
cuBLAS is made deterministic (``CUBLAS_WORKSPACE_CONFIG``) so the two runs must agree
bit for bit; a replacement on NCCL needs a second GPU (``test_gpu_nccl``). Skipped
without CUDA; ``scripts/gpu_check`` runs it.
"""

import json
import os

import pytest
import torch

from pitstop.launch.runs import ROOT, run_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCRIPT = [str(ROOT / "examples" / "train_gpt.py"), "--tp", "1", "--pp", "1", "--checksum"]


@pytest.mark.timeout(400)
def test_world1_gpt_on_cuda_is_bitwise_repeatable_under_pitstop(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    a = run_job(tmp_path / "a", 8, nproc=1, gpt=SCRIPT, timeout=180)
    b = run_job(tmp_path / "b", 8, nproc=1, gpt=SCRIPT, timeout=180)
    assert a.code == 0, a.tails()
    assert b.code == 0, b.tails()
    assert sorted(a.losses) == list(range(1, 9)), a.tails()
    assert a.losses == b.losses, (a.losses, b.losses)
    assert a.checksums == b.checksums and len(a.checksums) == 1, (a.checksums, b.checksums)
    dest = os.environ.get("PITSTOP_GPU_CHECK_OUT")
    if dest:
        with open(os.path.join(dest, "train.json"), "w") as f:
            json.dump({"losses": a.losses, "checksums": a.checksums, "stats": a.stats[-3:]}, f, indent=1)
