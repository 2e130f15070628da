"""Tier 4 (GPU only): the group registry on NCCL. Skipped without CUDA; CI has none."""

import json

import pytest
import torch

from conftest import ROOT, wait_done

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                       reason="needs CUDA and NCCL"),
]


@pytest.mark.timeout(120)
def test_one_gpu_registry_builds_uses_and_aborts_an_nccl_communicator(job, tmp_path):
    """What one GPU can check of the NCCL path: pitstop's registry builds a guarded NCCL
    communicator, an all-reduce on it is right, marking it broken aborts it. The memory NCCL
    takes outside the caching allocator is reported (``scripts/gpu_check`` keeps it)."""
    import os

    ctx = job.start("nccl-one", [str(ROOT / "tests" / "workers" / "nccl_worker.py"), str(tmp_path), "one"], range(1), 1)
    wait_done(job, ctx, timeout=100)
    res = json.loads((tmp_path / "result_0.json").read_text())
    dest = os.environ.get("PITSTOP_GPU_CHECK_OUT")
    if dest:
        with open(os.path.join(dest, "nccl.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res))
    assert res["sum"] == 1.0 and res["backend"] == "nccl", res
    assert res["group_name"].startswith("pitstop:g0:"), res
    assert res["aborted"] is True, res


@pytest.mark.timeout(180)
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs two GPUs: NCCL refuses two ranks on one device ('Duplicate GPU detected', seen on an H200)")
def test_registry_on_nccl_with_gloo_twins(job, tmp_path):
    world = 2
    ctx = job.start("nccl", [str(ROOT / "tests" / "workers" / "nccl_worker.py"), str(tmp_path)], range(world), world)
    wait_done(job, ctx, timeout=150)
    for r in range(world):
        res = json.loads((tmp_path / f"result_{r}.json").read_text())
        assert res["tp_sum"] == world and res["tp_backend"] == "nccl"
        assert res["dp_gloo_backend"] == "gloo" and res["dp_gloo_sum"] == 1.0


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one NCCL rank each)")
def test_a_dead_peers_pending_nccl_operation_is_aborted_not_abandoned(job, tmp_path):
    """Issue 11 item 6: a stayer's all-reduce waits on the GPU for a dead rank. When the fault
    is announced the group is marked broken, which aborts the NCCL communicator: the CUDA
    stream is free again (a ``synchronize`` returns), the step is poisoned, nothing hangs."""
    world = 2
    ctx = job.start("nccl-abort", [str(ROOT / "tests" / "workers" / "nccl_worker.py"), str(tmp_path), "abort"],
                    range(world), world)
    wait_done(job, ctx, timeout=200)
    res = json.loads((tmp_path / "result_0.json").read_text())
    assert res["aborted"] is True, res
    assert res["stream_free"] is True, res
    assert res["poisoned"] is True, res
