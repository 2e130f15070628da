"""Worker for tests/test_pg.py: the store-backed world group, composites, bad replace."""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from pitstop.errors import GroupError, RosterError
from pitstop.groups import GroupRegistry
from pitstop.layout import ParallelLayout
from pitstop.pg import init_world
from pitstop.store import connect_from_env

T = timedelta(seconds=60)


def main():
    out_dir = sys.argv[1]
    store = connect_from_env(T)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_world(store, rank, world, T)
    res = {"rank": rank}
    # world group through the store
    dist.barrier()
    t = torch.tensor([rank + 1.0, 10.0 * rank])
    dist.all_reduce(t)
    res["world_sum"] = t.tolist()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res["world_max"] = t.item()
    b = torch.tensor([7.0 if rank == 2 else -1.0])
    dist.broadcast(b, src=2)
    res["world_bcast"] = b.item()
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(outs, torch.tensor([rank, rank * rank]))
    res["world_gather"] = [o.tolist() for o in outs]
    dist.barrier()
    # registry on tp2 x dp2: the tp-dp composite
    layout = ParallelLayout(world, tp=2)
    reg = GroupRegistry(layout, store, timeout=T)
    reg.build()
    comp = reg.group("tp-dp")
    res["composite_type"] = type(comp).__name__
    t = torch.tensor([2.0 ** rank], dtype=torch.float64)
    dist.all_reduce(t, group=comp)
    res["composite_sum"] = t.item()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comp)
    res["composite_max"] = t.item()
    res["composite_ranks"] = dist.get_process_group_ranks(comp)
    res["composite_rank"] = dist.get_rank(comp)
    try:
        dist.all_gather([torch.zeros(1)] * world, torch.zeros(1), group=comp)
        res["composite_gather_error"] = None
    except GroupError as exc:
        res["composite_gather_error"] = str(exc)
    # a replace of a role that does not exist touches nothing
    before = {k: (e.group, e.generation) for k, e in reg.entries().items()}
    try:
        reg.replace(world + 3)
        res["bad_replace"] = None
    except RosterError as exc:
        res["bad_replace"] = str(exc)
    after = {k: (e.group, e.generation) for k, e in reg.entries().items()}
    res["untouched"] = all(before[k][0] is after[k][0] and before[k][1] == after[k][1] for k in before) and before.keys() == after.keys()
    res["generation"] = reg.generation
    # destroy one group: the others keep working
    tp = reg.group("tp")
    dist.destroy_process_group(tp)
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=reg.group("dp"))
    res["after_destroy_dp_sum"] = t.item()
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()  # nobody tears down its gloo pairs while a peer still uses them
    reg.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
