"""Tier 4 (GPU only): the tensor counter that emulation uses on CPU, against CUDA's allocator.

Emulation reports a rank's peak as the bytes of tensor storages alive at once
(:class:`pitstop.memory.PeakTracker`), because on CPU there is no allocator statistic.
On a GPU the caching allocator keeps its own peak. The two must agree up to what the
allocator adds by itself, or the CPU figure would not predict a GPU run:

    allocator peak = counted peak + block rounding (512 B)

once cuBLAS's workspaces (which torch takes from the caching allocator and no operator
returns: one per thread that multiplies, so the forward's and autograd's backward
thread's) exist before the count starts. The test measures them and reports them: an
emulated GPU peak adds them to the counted one.

Skipped without CUDA; ``scripts/gpu_check`` runs it on a GPU machine.
"""

import json
import os

import pytest
import torch

from pitstop.memory import PeakTracker, cuda_memory_report

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _train_steps(steps: int, width: int, depth: int) -> float:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(256, width, device="cuda")
    loss = None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return float(loss.detach())


@pytest.mark.timeout(120)
def test_counted_peak_matches_the_cuda_allocators_peak(tmp_path):
    """An MLP trained with Adam for 3 steps (parameters, grads, moments, activations, all
    created under the tracker, backward's too: autograd's CUDA thread inherits the mode):
    the allocator's peak is at least the counted one and exceeds it by no more than the
    block rounding."""
    before = torch.cuda.memory_allocated()
    a = torch.randn(64, 64, device="cuda")
    torch.nn.functional.linear(a, a, a[0]).sum().item()  # cuBLAS and cuBLASLt: their workspaces now exist
    torch.cuda.synchronize()
    workspace_main = torch.cuda.memory_allocated() - before - a.nbytes
    # backward runs in autograd's CUDA thread, whose own cuBLAS handle gets its own workspace
    # (seen on an H200: 32 MiB more, exactly, when this warm-up was missing)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    torch.nn.functional.linear(a, w).sum().backward()
    torch.cuda.synchronize()
    del a, w
    workspace = torch.cuda.memory_allocated() - before
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    tracker = PeakTracker()
    with tracker:
        _train_steps(3, width=2048, depth=8)
    rep = cuda_memory_report()
    allocator_peak = rep["allocator_peak_bytes"] - base
    counted = tracker.peak_bytes
    gap = allocator_peak - counted
    out = {"counted_peak_bytes": counted, "allocator_peak_bytes": allocator_peak, "gap_bytes": gap,
           "cublas_workspace_bytes": workspace, "cublas_workspace_main_thread_bytes": workspace_main, "gap_pct": round(100.0 * gap / allocator_peak, 4), **rep}
    dest = os.environ.get("PITSTOP_GPU_CHECK_OUT")
    if dest:
        with open(os.path.join(dest, "memory.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    assert counted > 100 * 2**20, out  # the model's own bytes were seen (8 x 2048^2 fp32 x 4 copies)
    assert counted <= allocator_peak, out
    # blocks are rounded to 512 B: at most 512 B per live storage; the model has < 200 of them
    assert gap <= 200 * 512, out
