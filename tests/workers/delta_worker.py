"""Worker for the live-delta test: build groups, replace one role by a standby, check sums.

Roles:  ``--as worker`` (one per rank, generation 0) or ``--as standby --role R``.
Each process writes ``result_<rank>_<who>.json`` into ``--out``; the test asserts on them.
Sync between processes goes through the control store (no sleeps).
"""

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from pitstop.groups import GroupRegistry
from pitstop.layout import ParallelLayout
from pitstop.pg import init_world
from pitstop.plan import plan_replace
from pitstop.roster import ProcessInfo
from pitstop.store import connect_from_env

T = timedelta(seconds=60)


def value(rank: int, who: str) -> float:
    # the standby's contribution differs from the leaver's, so sums prove who took part
    return rank * 10.0 + (1.0 if who == "standby" else 0.0)


def check_all(reg: GroupRegistry, rank: int, who: str, replaced: set) -> dict:
    """All-reduce over every group; compare with the expected sum of members' values."""
    out = {}
    for kind, e in reg.entries().items():
        t = torch.tensor([value(rank, who)], dtype=torch.float64)
        dist.all_reduce(t, group=e.group)
        expect = sum(value(r, "standby" if r in replaced else "worker") for r in e.ranks)
        out[kind] = {"got": t.item(), "expect": expect, "ranks": e.ranks, "gen": e.generation}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--as", dest="who", choices=["worker", "standby"], required=True)
    ap.add_argument("--role", type=int, default=None)
    ap.add_argument("--replace", type=int, required=True, help="role that the standby takes over")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    layout = ParallelLayout(world, tp=a.tp, pp=a.pp)
    store = connect_from_env(T)
    rank = int(os.environ["RANK"]) if a.who == "worker" else a.role
    result = {"rank": rank, "who": who if (who := a.who) else None, "pid": os.getpid()}

    if a.who == "standby":
        store.set("standby/up", str(os.getpid()))
        store.wait(["roster/1"], T)  # the controller assigns the role
        init_world(store, rank, world, T)
        reg = GroupRegistry(layout, store, generation=1, timeout=T)
        reg.build()
        result["built"] = sorted(reg.entries())
        result["check_after"] = check_all(reg, rank, "standby", {a.replace})
        store.add("phase/after", 1)
        store.wait(["phase/done"], T)
    else:
        init_world(store, rank, world, T)
        assert dist.get_rank() == rank and dist.get_world_size() == world
        reg = GroupRegistry(layout, store, timeout=T)
        reg.build()
        result["check_before"] = check_all(reg, rank, "worker", set())
        # c10d bookkeeping on the tp group
        tp = reg.group("tp")
        ranks = layout.group_of("tp", rank)
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=ranks[-1], group=tp)
        result["c10d"] = {
            "get_rank": dist.get_rank(tp), "get_world_size": dist.get_world_size(tp),
            "ranks": dist.get_process_group_ranks(tp), "expect_ranks": ranks,
            "broadcast": b.item(), "expect_broadcast": float(ranks[-1]),
        }
        ids_before = {k: id(e.group) for k, e in reg.entries().items()}
        objs_before = {k: e.group for k, e in reg.entries().items()}
        store.add("phase/before", 1)
        if rank == a.replace:
            # the leaver: waits until everyone checked, then leaves (exits)
            store.wait(["roster/1"], T)
            result["left"] = True
            with open(os.path.join(a.out, f"result_{rank}_{a.who}.json"), "w") as f:
                json.dump(result, f)
            os._exit(0)
        store.wait(["roster/1"], T)
        rep = reg.replace(a.replace, ProcessInfo("localhost", int(store.get("standby/up"))))
        plan = plan_replace(layout, (a.replace,), 0, 1)
        result["report"] = {
            "rebuilt": sorted(k[0] for k in rep.rebuilt), "kept": sorted(k[0] for k in rep.kept),
            "plan_rebuilt": sorted(plan.rebuilt_kinds(rank)), "generation": rep.generation,
            "seconds": rep.seconds,
        }
        result["kept_same_object"] = {
            k[0]: (reg.entries()[k[0]].group is objs_before[k[0]]) and id(reg.entries()[k[0]].group) == ids_before[k[0]]
            for k in rep.kept
        }
        result["rebuilt_new_object"] = {
            k[0]: reg.entries()[k[0]].group is not objs_before[k[0]] for k in rep.rebuilt
        }
        result["check_after"] = check_all(reg, rank, "worker", {a.replace})
        result["reaped"] = reg.reap()
        store.add("phase/after", 1)
        store.wait(["phase/done"], T)
    with open(os.path.join(a.out, f"result_{rank}_{a.who}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
