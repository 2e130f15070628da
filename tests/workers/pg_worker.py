"""Worker for tests/test_pg.py: the store-backed world group, composites, bad replace."""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from pitstop.errors import GroupError, RosterError
from pitstop.groups import GroupRegistry
from pitstop.store import SharedConnection
from pitstop.layout import ParallelLayout
from pitstop.pg import init_world
from pitstop.store import connect_from_env

T = timedelta(seconds=60)


def background_prepare(out_dir):
    """Stayers 0..2 prepare role 3's next generation in a background thread while their
    main thread sits in a blocking ``wait`` on the same store client (as the training
    thread waits for a step verdict). The wait's key is set only once the prepare has
    finished, so a prepare that rendezvouses through the main thread's connection
    (whose lock the wait holds) deadlocks until the wait times out. Rank 3 plays its
    own joiner: it builds generation 0 with the others, then a fresh registry at
    generation 1."""
    import threading
    import time

    store = connect_from_env(T)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_world(store, rank, world, T)
    layout = ParallelLayout(world, tp=2)
    res = {"rank": rank}
    if rank == world - 1:
        GroupRegistry(layout, store, timeout=T).build()
        reg = GroupRegistry(layout, store, generation=1, timeout=T)
        reg.build()
    else:
        reg = GroupRegistry(layout, store, timeout=T)
        reg.build()
        out = {}

        def prepare():
            try:
                out["pending"] = reg.prepare(world - 1)
            except Exception as exc:  # noqa: BLE001 - reported below
                out["error"] = repr(exc)
            connect_from_env(T).set(f"pgtest/prepared/{rank}", "1")

        t0 = time.monotonic()
        threading.Thread(target=prepare, daemon=True).start()
        try:
            store.wait([f"pgtest/prepared/{rank}"], timedelta(seconds=20))
            res["main_wait_error"] = None
        except Exception as exc:  # noqa: BLE001 - the deadlock shows as this wait's timeout
            res["main_wait_error"] = repr(exc)
        res["prepare_s"] = time.monotonic() - t0
        res["prepare_error"] = out.get("error")
        if "pending" in out:
            reg.commit(out["pending"])
    res["generation"] = reg.generation
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=reg.group("dp"))
    res["dp_sum"] = t.item()
    res["dp_ranks"] = dist.get_process_group_ranks(reg.group("dp"))
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    reg.destroy()
    dist.destroy_process_group()


def deferred_joiner(out_dir):
    """Rank 3 is a joiner whose registry is deferred: its ``build()`` must return before any
    peer has started building the next generation (the stayers wait for its word first; a
    build that rendezvoused in the foreground would wait for them: a deadlock). Its groups
    exist, registered, but empty; with the fence local an operation completes in place;
    with the fence open and no communicator yet it is refused by name. ``attach`` then
    waits for the background build, and the very same group objects talk to the stayers,
    which built their side concurrently (``prepare``)."""
    from pitstop.pg import FENCE

    store = connect_from_env(T)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_world(store, rank, world, T)
    layout = ParallelLayout(world, tp=2)
    reg = GroupRegistry(layout, store, timeout=T)
    reg.build()  # generation 0, everyone (rank 3 as the old process of role 3)
    res = {"rank": rank, "opened_at_build": reg.connections.opened, "rendezvous": reg.rendezvous_count()}
    if rank == world - 1:
        FENCE.local = True
        spare = SharedConnection(store)  # as a standby does while it waits (worker._open_spare_connections)
        spare.reserve(1)
        res["joiner_spare"] = spare.opened
        reg = GroupRegistry(layout, store, generation=1, timeout=T, deferred=True, connections=spare)
        reg.build()
        res["deferred_after_build"] = reg.deferred
        store.set("pgtest/joiner-built", "1")  # only now do the stayers start their side
        dp = reg.group("dp")
        res["dp_ranks_before_attach"] = dist.get_process_group_ranks(dp)
        t = torch.tensor([5.0])
        dist.all_reduce(t, group=dp)  # local: nothing is sent, the buffer is left as it is
        res["local_allreduce"] = t.item()
        FENCE.local = False
        try:
            dist.all_reduce(torch.tensor([1.0]), group=dp)
            res["open_before_attach"] = None
        except GroupError as exc:
            res["open_before_attach"] = str(exc)
        FENCE.local = True
        res["attach_wait_s"] = reg.attach()
        FENCE.local = False
        res["same_object"] = reg.group("dp") is dp
        res["deferred_after_attach"] = reg.deferred
        res["joiner_opened"] = reg.connections.opened
    else:
        store.wait(["pgtest/joiner-built"], timedelta(seconds=30))
        reg.commit(reg.prepare(world - 1))
    res["generation"] = reg.generation
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=reg.group("dp"))
    res["dp_sum"] = t.item()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=reg.group("tp"))
    res["tp_sum"] = t.item()
    # a second replacement of role 3: the stayers' rendezvous reuse the connections of the first
    res["pool_after_1"] = len(reg.connections)
    res["opened_after_1"] = reg.connections.opened
    if rank == world - 1:
        FENCE.local = True
        reg2 = GroupRegistry(layout, store, generation=2, timeout=T, deferred=True)
        reg2.build()
        store.set("pgtest/joiner-built-2", "1")
        reg2.attach()
        FENCE.local = False
        reg.destroy()
        reg = reg2
    else:
        store.wait(["pgtest/joiner-built-2"], timedelta(seconds=30))
        reg.commit(reg.prepare(world - 1))
        res["pool_after_2"] = len(reg.connections)
        res["opened_after_2"] = reg.connections.opened
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=reg.group("dp"))
    res["dp_sum_2"], res["generation_2"] = t.item(), reg.generation
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    reg.destroy()
    dist.destroy_process_group()


def abandon(out_dir):
    """Rank 1 never joins; rank 0, its fence armed, starts a reduce-scatter on the dp group
    (gloo's wait ignores its timeout there) and an all-reduce on the world group (a store
    wait for a key rank 1 never writes). Another thread marks each broken 0.5 s later, as
    the heartbeat's watcher does when the controller announces a failure: both waits must
    give up then, and say so in the fence, instead of at the 60 s timeout."""
    import threading
    import time

    from pitstop.pg import FENCE, world_group

    store = connect_from_env(T)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_world(store, rank, world, T)
    reg = GroupRegistry(ParallelLayout(world), store, timeout=T, fence=FENCE)
    reg.build()
    if rank == 1:
        store.wait(["pgtest/abandon-done"], T)
        os._exit(0)
    res = {"rank": rank}
    FENCE.armed = True
    for name, group, call in [
        ("reduce_scatter", reg.group("dp"), lambda g: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4), group=g)),
        ("world", world_group(), lambda g: dist.all_reduce(torch.ones(2))),
    ]:
        FENCE.reset()
        threading.Timer(0.5, group.mark_broken).start()
        t0 = time.monotonic()
        call(group)
        res[f"{name}_s"] = time.monotonic() - t0
        res[f"{name}_errors"] = list(FENCE.errors)
    world_group().rewind(world_group().seq, 1)  # a new epoch clears the mark
    res["world_broken_after_rewind"] = world_group()._broken
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
        json.dump(res, f)
    store.set("pgtest/abandon-done", "1")
    os._exit(0)


class _Globals:
    """Where the compiled function finds its group, as Megatron's layers find theirs in
    ``parallel_state`` globals (what the registry's install writes)."""
    tp = None


def _tp_sum(x):
    y = x * 2
    dist.all_reduce(y, group=_Globals.tp)
    return y + 1


def compiled_replace(out_dir):
    """``torch.compile`` across a replacement: every rank compiles a TP all-reduce with
    generation 0's group; then role 3 is replaced (rank 3 plays its own joiner, with a fresh
    registry at generation 1, as a standby does after its warmup sandbox), and the same
    compiled function runs with generation 1's groups. Rebuilt or not, every rank's group
    carries the name ``pitstop:tp``, so dynamo's guard on ``group_name`` holds: no recompile,
    and the collective reaches the new communicator (the sums say so)."""
    import torch._dynamo as dynamo
    from torch.distributed import distributed_c10d as c10d

    store = connect_from_env(T)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_world(store, rank, world, T)
    layout = ParallelLayout(world, tp=2)
    f = torch.compile(_tp_sum, backend="eager")
    reg = GroupRegistry(layout, store, timeout=T)
    reg.build()
    _Globals.tp = reg.group("tp")
    res = {"rank": rank, "names": [reg.group("tp").group_name]}
    res["sums"] = [f(torch.tensor([float(rank + 1)])).item()]
    if rank == world - 1:
        reg.destroy()  # the leaver's (or the sandbox's) groups are gone, names freed
        reg = GroupRegistry(layout, store, generation=1, timeout=T)
        reg.build()
    else:
        old = reg.group("tp")
        reg.replace(world - 1)
        res["tp_rebuilt"] = reg.group("tp") is not old
    _Globals.tp = reg.group("tp")
    res["names"].append(reg.group("tp").group_name)
    res["uid"] = reg.group("tp").uid
    try:
        res["resolves"] = c10d._resolve_process_group("pitstop:tp") is reg.group("tp")
    except Exception as exc:  # noqa: BLE001 - not registered under the stable name
        res["resolves"] = repr(exc)[:200]
    res["sums"].append(f(torch.tensor([float(10 * (rank + 1))])).item())
    res["graphs"] = int(dynamo.utils.counters["stats"]["unique_graphs"])
    with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as fh:
        json.dump(res, fh)
    dist.barrier()
    reg.destroy()
    dist.destroy_process_group()


def main():
    out_dir = sys.argv[1]
    if sys.argv[2:] == ["compiled-replace"]:
        return compiled_replace(out_dir)
    if sys.argv[2:] == ["abandon"]:
        return abandon(out_dir)
    if sys.argv[2:] == ["background-prepare"]:
        return background_prepare(out_dir)
    if sys.argv[2:] == ["deferred-joiner"]:
        return deferred_joiner(out_dir)
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
    # a one-element float sum adds up as a flat gloo group of the same members does; summed
    # inner (tp) then outer (dp) it differs in the last bit for some values
    flat = dist.ProcessGroupGloo(dist.PrefixStore("flat-gloo/", store), rank, world, T)
    same_flat = same_two_step = 0
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        v = (torch.rand(world, generator=g) * torch.logspace(-3, 3, world)[torch.randperm(world, generator=g)])[rank]
        a, b, c = (torch.tensor([float(v)]) for _ in range(3))
        dist.all_reduce(a, group=comp)
        flat.allreduce([b]).wait()
        dist.all_reduce(c, group=reg.group("tp"))
        dist.all_reduce(c, group=reg.group("dp"))
        same_flat += int(torch.equal(a, b))
        same_two_step += int(torch.equal(c, b))
    res["composite_sum_as_flat"] = [same_flat, same_two_step]
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
