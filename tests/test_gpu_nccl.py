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


def _one_gpu(job, tmp_path, mode: str, keep_as: str) -> dict:
    """Run ``tests/workers/nccl_worker.py <mode>`` as world 1; its result, kept as
    ``keep_as`` under ``scripts/gpu_check``'s output folder when that is set."""
    import os

    ctx = job.start(f"nccl-{mode}", [str(ROOT / "tests" / "workers" / "nccl_worker.py"), str(tmp_path), mode],
                    range(1), 1)
    wait_done(job, ctx, timeout=100)
    res = json.loads((tmp_path / "result_0.json").read_text())
    dest = os.environ.get("PITSTOP_GPU_CHECK_OUT")
    if dest:
        with open(os.path.join(dest, keep_as), "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res))
    return res


@pytest.mark.timeout(120)
def test_one_gpu_registry_builds_uses_and_aborts_an_nccl_communicator(job, tmp_path):
    """What one GPU can check of the NCCL path: pitstop's registry builds a guarded NCCL
    communicator, an all-reduce on it is right, marking it broken aborts it. The memory NCCL
    takes outside the caching allocator is reported (``scripts/gpu_check`` keeps it)."""
    res = _one_gpu(job, tmp_path, "one", "nccl.json")
    assert res["sum"] == 1.0 and res["backend"] == "nccl", res
    assert res["group_name"].startswith("pitstop:g0:"), res
    assert res["aborted"] is True, res


@pytest.mark.timeout(120)
def test_a_guarded_nccl_wait_orders_the_callers_stream_and_never_blocks_the_host(job, tmp_path):
    """A guarded wait on NCCL must order the caller's own CUDA stream after the operation
    (what ``Work.wait()`` does in the calling thread) and return at once on the host. The
    helper-thread wait that gloo's send/recv and reduce-scatters need (a dead peer hangs
    them on the host) would order the helper thread's stream instead: the caller, on a side
    stream as Megatron's and DeepSpeed's overlapped reductions are, would read the output
    before NCCL wrote it. The operation is held back on the GPU for about a second, so a
    wrong ordering reads zeros."""
    res = _one_gpu(job, tmp_path, "stream", "nccl-stream.json")
    for what in ("reduce_scatter_tensor", "all_reduce"):
        r = res[what]
        assert r["gpu_busy_when_wait_returned"], res  # the check is live: the GPU still held the operation
        assert r["correct"] and r["error"] is None and not r["poisoned"], res
        assert r["host_wait_s"] < 0.5, res


@pytest.mark.timeout(120)
def test_nccl_timed_wait_on_a_queued_operation(job, tmp_path):
    """Upstream behaviour the guarded wait must avoid, kept as a test that fails when it
    changes: a *timed* ``Work.wait`` on NCCL that expires while the operation is still queued
    on the GPU aborts the communicator. The guarded group polls gloo with 50 ms waits; on
    NCCL it waits untimed (before that, any NCCL operation held up 50 ms broke its group)."""
    res = _one_gpu(job, tmp_path, "timedwait", "nccl-timed-wait.json")
    # seen on an H200 (torch 2.11, NCCL 2.28.9): the expired wait raises the watchdog's
    # timeout and the communicator is aborted; the next operation on it fails
    assert res["returned"] is None and "timing out" in res["error"], res
    assert res["next_op_error"] is not None and "aborted" in res["next_op_error"], res


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
