"""GPU only: the registry on NCCL, with gloo twins for Megatron's *_GLOO globals."""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from pitstop.groups import GroupRegistry
from pitstop.layout import ParallelLayout
from pitstop.pg import init_world
from pitstop.store import connect_from_env


def abort(out_dir):
    """Rank 1 dies after the communicator is up; rank 0's next all-reduce waits on the GPU for it.
    Marking the group broken (what the heartbeat thread does when the controller announces the
    fault) must abort the NCCL communicator, so the CUDA stream is free again: a later
    ``synchronize`` returns instead of waiting forever behind the kernel."""
    import threading
    import time

    from pitstop.pg import FENCE

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    store = connect_from_env()
    init_world(store, rank, world, timedelta(seconds=120))
    reg = GroupRegistry(ParallelLayout(world, tp=world), store, backend="nccl", timeout=timedelta(seconds=120))
    reg.build()
    tp = reg.group("tp")
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t, group=tp)
    torch.cuda.synchronize()
    store.add("nccltest/up", 1)
    while store.add("nccltest/up", 0) < world:
        time.sleep(0.05)
    if rank == 1:
        os._exit(0)  # the peer is gone: its half of the next all-reduce never comes
    FENCE.armed = True  # a training step runs
    x = torch.ones(1 << 20, device="cuda")
    work = dist.all_reduce(x, group=tp, async_op=True)  # on the stream, waiting for rank 1
    threading.Timer(2.0, tp.mark_broken).start()  # the fault's announcement
    work.wait()
    done = threading.Event()
    t0 = time.monotonic()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
    free = done.wait(90)
    res = {"stream_free": free, "sync_s": round(time.monotonic() - t0, 3), "aborted": bool(getattr(tp, "aborted", False)),
           "poisoned": FENCE.poisoned}
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
        json.dump(res, f)
    os._exit(0 if free else 1)


def one(out_dir):
    """World 1 on one GPU: the registry builds an NCCL communicator through pitstop's own
    path (a generation prefix, a guarded group), runs an all-reduce on it, and the memory
    NCCL takes outside the caching allocator is measured around that first collective
    (where torch creates the communicator); then the group is marked broken, which must
    abort the communicator, and destroyed."""
    from pitstop.memory import cuda_memory_report

    torch.cuda.set_device(0)
    store = connect_from_env()
    init_world(store, 0, 1, timedelta(seconds=60))
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    before = cuda_memory_report()
    reg = GroupRegistry(ParallelLayout(1), store, backend="nccl", timeout=timedelta(seconds=60))
    reg.build()
    tp = reg.group("tp")
    dist.all_reduce(x, group=tp)
    torch.cuda.synchronize()
    after = cuda_memory_report()
    name = getattr(tp, "group_name", "")
    tp.mark_broken()
    res = {"sum": x[0].item(), "backend": tp._get_backend_name(), "group_name": name,
           "aborted": bool(getattr(tp, "aborted", False)),
           "nccl_outside_allocator_bytes": after["outside_allocator_bytes"] - before["outside_allocator_bytes"],
           "before": before, "after": after, "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}
    reg.destroy()
    with open(os.path.join(out_dir, "result_0.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _held_back(tp, seconds_of_sleep: float = 1.0):
    """Issue an all-reduce that NCCL's stream runs only after a GPU sleep on a stream of its
    own: whatever is issued on the communicator next runs behind it."""
    s1 = torch.cuda.Stream()
    a = torch.ones(1 << 10, device="cuda")
    with torch.cuda.stream(s1):
        torch.cuda._sleep(int(3e9 * seconds_of_sleep))  # about a second on an H200
        return dist.all_reduce(a, group=tp, async_op=True)


def _one_gpu_group():
    torch.cuda.set_device(0)
    store = connect_from_env()
    init_world(store, 0, 1, timedelta(seconds=60))
    reg = GroupRegistry(ParallelLayout(1), store, backend="nccl", timeout=timedelta(seconds=60))
    reg.build()
    tp = reg.group("tp")
    dist.all_reduce(torch.ones(1, device="cuda"), group=tp)  # the communicator exists
    torch.cuda.synchronize()
    return reg, tp


def stream(out_dir):
    """World 1 on one GPU: a guarded wait orders the *caller's* CUDA stream after the NCCL
    operation and does not block the host. NCCL's ``Work.wait()`` makes the calling thread's
    current stream wait; a wait done in a helper thread (gloo's dead-peer path) would order
    that thread's default stream instead, and the caller would read the output early.

    The operation checked is issued from stream S2 and runs behind one held back on the GPU
    (:func:`_held_back`); S2 has no sleep of its own, so it reads the output correctly only
    if the wait made S2 wait for the operation. Results are written after each case."""
    import time

    from pitstop.pg import FENCE

    reg, tp = _one_gpu_group()
    FENCE.armed = True  # as in a training step
    res = {}
    s2 = torch.cuda.Stream()
    n = 1 << 20
    for what in ("reduce_scatter_tensor", "all_reduce"):
        with torch.cuda.stream(s2):
            inp = torch.arange(n, device="cuda", dtype=torch.float32) + 1
            out = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        first = _held_back(tp)
        with torch.cuda.stream(s2):
            t0 = time.monotonic()
            if what == "reduce_scatter_tensor":
                work = dist.reduce_scatter_tensor(out, inp, group=tp, async_op=True)
            else:
                out.copy_(inp)
                work = dist.all_reduce(out, group=tp, async_op=True)
            t1 = time.monotonic()
            err = None
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001
                err = str(exc).splitlines()[0][:200]
            host_wait_s = time.monotonic() - t1
            seen = out.clone()
            busy = not first.is_completed()
        torch.cuda.synchronize()
        expect = torch.arange(n, device="cuda", dtype=torch.float32) + 1
        res[what] = {"host_wait_s": round(host_wait_s, 4), "issue_s": round(t1 - t0, 4),
                     "gpu_busy_when_wait_returned": busy, "correct": bool(torch.equal(seen, expect)), "error": err,
                     "poisoned": FENCE.poisoned}
        with open(os.path.join(out_dir, "result_0.json"), "w") as f:
            json.dump(res, f)
    FENCE.armed = False
    reg.destroy()
    dist.destroy_process_group()


def timedwait(out_dir):
    """What NCCL does with a *timed* wait that expires while the operation is still queued
    on the GPU (the wait a gloo group is polled with): written at once, then the process
    ends before NCCL's watchdog takes it down."""
    import time

    reg, tp = _one_gpu_group()
    first = _held_back(tp)
    work = tp.inner.allreduce([torch.ones(4, device="cuda")])
    t0 = time.monotonic()
    err = None
    try:
        ok = work.wait(timedelta(milliseconds=50))
    except Exception as exc:  # noqa: BLE001
        ok, err = None, str(exc).splitlines()[0][:300]
    res = {"returned": ok, "wait_s": round(time.monotonic() - t0, 4), "error": err,
           "gpu_busy_after": not first.is_completed()}
    try:
        tp.inner.allreduce([torch.ones(4, device="cuda")]).wait()
        res["next_op_error"] = None
    except Exception as exc:  # noqa: BLE001
        res["next_op_error"] = str(exc).splitlines()[0][:300]
    with open(os.path.join(out_dir, "result_0.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)


def main():
    if sys.argv[2:] == ["abort"]:
        return abort(sys.argv[1])
    if sys.argv[2:] == ["one"]:
        return one(sys.argv[1])
    if sys.argv[2:] == ["stream"]:
        return stream(sys.argv[1])
    if sys.argv[2:] == ["timedwait"]:
        return timedwait(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    store = connect_from_env()
    init_world(store, rank, world, timedelta(seconds=120))
    reg = GroupRegistry(ParallelLayout(world, tp=world), store, backend="nccl")
    reg.build()
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t, group=reg.group("tp"))
    g = torch.ones(1)
    dp_gloo = reg.gloo_group("dp")
    dist.all_reduce(g, group=dp_gloo)
    res = {"tp_sum": t.item(), "tp_backend": reg.group("tp")._get_backend_name(),
           "dp_gloo_backend": dp_gloo._get_backend_name(), "dp_gloo_sum": g.item()}
    with open(os.path.join(sys.argv[1], f"result_{rank}.json"), "w") as f:
        json.dump(res, f)
    reg.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
