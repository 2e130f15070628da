"""Tier 2: a live delta on a world-8 tp2 pp2 dp2 job, with real processes and gloo.

A standby process takes over role 5 through ``GroupRegistry.replace`` while the old
process of role 5 leaves; rebuilt groups must include the standby, kept groups must
be the very same objects and still work.
"""

import json

import pytest

from conftest import ROOT, wait_counter, wait_done
from pitstop.layout import ParallelLayout
from pitstop.plan import plan_replace, realization
from pitstop.roster import ProcessInfo, Roster

WORKER = str(ROOT / "tests" / "workers" / "delta_worker.py")
ROLE = 5


@pytest.mark.timeout(240)
def test_standby_takes_over_only_the_delta(job, tmp_path):
    world = 8
    layout = ParallelLayout(world, tp=2, pp=2)
    common = ["--replace", str(ROLE), "--out", str(tmp_path)]
    workers = job.start("workers", [WORKER, "--as", "worker", *common], range(world), world)
    wait_counter(job, "phase/before", world)
    standby = job.start("standby", [WORKER, "--as", "standby", "--role", str(ROLE), *common], [ROLE], world)
    job.store.wait(["standby/up"])
    roster = Roster(0, tuple(ProcessInfo("localhost", p) for p in workers.pids().values()))
    new = roster.replace(ROLE, ProcessInfo("localhost", int(job.store.get("standby/up"))))
    job.store.set("roster/1", new.to_json())
    wait_counter(job, "phase/after", world)  # 7 stayers + the standby
    job.store.set("phase/done", "1")
    wait_done(job, workers)
    wait_done(job, standby)

    results = {}
    for r in range(world):
        who = "standby" if r == ROLE else "worker"
        results[r] = json.loads((tmp_path / f"result_{r}_{who}.json").read_text())
    plan = plan_replace(layout, (ROLE,))

    # before: every group of every rank summed correctly
    for r in range(world):
        if r == ROLE:
            continue
        for kind, c in results[r]["check_before"].items():
            assert c["got"] == c["expect"], (r, kind, c)
    # c10d bookkeeping
    for r in range(world):
        if r == ROLE:
            continue
        c = results[r]["c10d"]
        assert c["ranks"] == c["expect_ranks"]
        assert c["get_rank"] == c["expect_ranks"].index(r)
        assert c["get_world_size"] == 2
        assert c["broadcast"] == c["expect_broadcast"]
    # the standby built exactly the groups of every kind that holds the role
    sb = results[ROLE]
    assert sb["built"] == sorted(layout.groups_of(ROLE))
    assert len(sb["built"]) == len(layout.groups_of(ROLE))
    # after: sums include the standby's distinct contribution, on every rank and kind
    for r in range(world):
        for kind, c in results[r]["check_after"].items():
            assert c["got"] == c["expect"], (r, kind, c)
    for kind, c in sb["check_after"].items():
        assert c["gen"] == 1
    # stayers rebuilt exactly the planned kinds, kept the rest as the same objects
    total_rebuilt_comms = set()
    for r in range(world):
        if r == ROLE:
            continue
        rep = results[r]["report"]
        assert rep["rebuilt"] == rep["plan_rebuilt"] == sorted(plan.rebuilt_kinds(r))
        assert all(results[r]["kept_same_object"].values()), results[r]["kept_same_object"]
        assert all(results[r]["rebuilt_new_object"].values())
        assert set(rep["kept"]).isdisjoint(rep["rebuilt"])
        # the old groups were retired, not leaked: one per rebuilt communicator or composite
        assert results[r]["reaped"] == sum(1 for k in rep["rebuilt"] if realization(layout, k).how != "alias")
        for kind, c in results[r]["check_after"].items():
            assert c["gen"] == (1 if kind in rep["rebuilt"] else 0), (r, kind)
            if kind in rep["rebuilt"] and realization(layout, kind).how == "comm":
                total_rebuilt_comms.add((kind, tuple(c["ranks"])))
            if ROLE in c["ranks"] and realization(layout, kind).how == "comm":
                assert kind in rep["rebuilt"]
    # the job-wide delta: one rebuilt communicator per comm kind that holds the role
    assert total_rebuilt_comms == {(g.kind, g.ranks) for g in plan.rebuilt if len(g.ranks) > 1}
