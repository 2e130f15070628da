"""One rank of ``pitstop bench groups``: time Megatron's init, pitstop's init, a delta rebuild.

Run by the bench launcher with torchrun's environment; prints one JSON line of
this rank's timings (seconds) on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    tp, pp, role = (int(v) for v in sys.argv[1:4])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import megatron.core.parallel_state as ps

    from pitstop.groups import GroupRegistry
    from pitstop.integrations import megatron as pm

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    t0 = time.perf_counter()
    ps.initialize_model_parallel(tp, pp)
    dist.barrier()  # Megatron's init ends when every rank has every group
    megatron_s = _max(time.perf_counter() - t0)
    ps.destroy_model_parallel()

    store = dist.PrefixStore("bench", c10d._get_default_store())
    dist.barrier()
    t0 = time.perf_counter()
    reg = pm.initialize_model_parallel(tp, pp, store=store)
    pitstop_s = _max(time.perf_counter() - t0)

    if rank == role:
        # this process plays the joiner, which in a real replacement is a fresh process:
        # tear its old groups down before the clock starts
        pm.restore()
        reg.destroy()
    dist.barrier()
    t0 = time.perf_counter()
    if rank == role:
        reg = GroupRegistry(reg.layout, store, generation=1)
        reg.build()
        kinds = sorted(reg.entries())
    else:
        kinds = sorted(k[0] for k in reg.replace(role).rebuilt)
    pm.install(reg)
    delta_s = _max(time.perf_counter() - t0)
    reg.reap()  # off the critical path
    print(json.dumps({"rank": rank, "megatron_init_s": megatron_s, "pitstop_init_s": pitstop_s,
                      "delta_rebuild_s": delta_s, "rebuilt": kinds}), flush=True)
    pm.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
