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


def main():
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
