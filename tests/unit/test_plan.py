"""Tier 1: the delta plan is local (only groups holding a replaced role) and self-consistent.

Pure, one process, no torch.distributed.
"""

from __future__ import annotations

import random

import pytest

from pitstop.errors import LayoutError, RosterError
from pitstop.layout import ParallelLayout
from pitstop.plan import (
    DeltaPlan,
    GroupRef,
    Realization,
    comm_kinds,
    job_group_count,
    plan_delta,
    plan_replace,
    realization,
)
from pitstop.roster import ProcessInfo, Roster

PLAN_LAYOUTS = [
    ParallelLayout(8, tp=2, pp=2),
    ParallelLayout(16, tp=2, pp=2, cp=2),
    ParallelLayout(16, ep=2),
    ParallelLayout(64, tp=2, pp=4),
    ParallelLayout(16, tp=2, ep=2, etp=1, dist_opt_instances=2),
]


def _ids(lay):
    return lay.describe()


def product(lay, inner, outer, rank):
    """Ranks reached by reducing over ``inner`` then ``outer``, starting from ``rank``."""
    return {x for o in lay.group_of(outer, rank) for x in lay.group_of(inner, o)}


# ---------------------------------------------------------------------- per-rank partition
@pytest.mark.parametrize("lay", PLAN_LAYOUTS, ids=_ids)
def test_every_role_every_rank(lay):
    world = lay.world_size
    comms = comm_kinds(lay)
    real = {k: realization(lay, k) for k in lay.kinds()}
    mine = {r: lay.groups_of(r) for r in range(world)}
    for role in range(world):
        plan = plan_replace(lay, (role,))
        assert plan.replaced == (role,) and (plan.old_generation, plan.new_generation) == (0, 1)

        # Exactly one rebuilt group per comm kind that holds the role: the role's own.
        kinds = [g.kind for g in plan.rebuilt]
        assert len(kinds) == len(set(kinds))
        assert set(kinds) == {k for k in comms if lay.group_of(k, role) is not None}
        for g in plan.rebuilt:
            assert role in g.ranks and list(g.ranks) == lay.group_of(g.kind, role)
        assert plan.ranks_involved == frozenset(r for g in plan.rebuilt for r in g.ranks)

        rebuilding = set()
        for r in range(world):
            rb, kp = plan.rebuilt_kinds(r), plan.kept_kinds(r)
            assert len(rb) == len(set(rb)) and len(kp) == len(set(kp))
            assert not set(rb) & set(kp)
            assert set(rb) | set(kp) == set(mine[r]), (role, r)
            if set(rb) & set(comms):
                rebuilding.add(r)
            if r == role:
                assert set(rb) == set(mine[r]), "the joiner rebuilds all of its kinds"
                continue
            for kind, group in mine[r].items():
                how = real[kind]
                if how.how == "comm":
                    want = role in group
                else:  # alias / composite: rebuilt iff one of its parts is
                    want = any(role in lay.group_of(p, r) for p in how.parts)
                assert (kind in rb) == want, (role, r, kind, how)
        assert rebuilding == set(plan.ranks_involved), role
        assert role in plan.ranks_involved


def test_partition_example_world8():
    lay = ParallelLayout(8, tp=2, pp=2)
    plan = plan_replace(lay, (5,))  # role 5: tp1 dp0 pp1
    # tp [4,5], tp-pp [0,1,4,5], dp/dp-cp [5,7], pp/embd [1,5]; pos-embd [1] does not hold 5.
    assert plan.ranks_involved == frozenset({0, 1, 4, 5, 7})
    assert {g.kind: g.ranks for g in plan.rebuilt}["tp-pp"] == (0, 1, 4, 5)
    assert "pos-embd" not in {g.kind for g in plan.rebuilt}
    rb4 = set(plan.rebuilt_kinds(4))
    assert {"tp", "tp-pp", "etp", "tp-ep", "tp-ep-pp", "tp-dp", "intra-dist-opt"} <= rb4
    assert {"dp", "pp", "dp-cp", "edp"} <= set(plan.kept_kinds(4))
    # Rank 2 (tp0 dp1 pp0) shares no communicator with role 5; its world-wide composites
    # are products of communicators that do not hold 5, so it keeps everything.
    assert plan.rebuilt_kinds(2) == ()
    assert set(plan.kept_kinds(2)) == set(lay.groups_of(2))


# ---------------------------------------------------------------------- scaling
@pytest.mark.parametrize(
    "lay",
    [ParallelLayout(8192, tp=8, pp=8), ParallelLayout(1024, tp=8, pp=4)],
    ids=_ids,
)
def test_plan_is_local_at_scale(lay):
    rng = random.Random(7)
    w = lay.world_size
    roles = sorted({0, 1, 7, 8, w // 2, w - 1} | {rng.randrange(w) for _ in range(4)})
    bound = lay.tp * lay.pp + lay.dp * lay.cp
    for role in roles:
        plan = plan_replace(lay, (role,))
        assert len(plan.rebuilt) <= 16, [g.kind for g in plan.rebuilt]
        assert len(plan.ranks_involved) <= bound
        # At ep 1, etp == tp: exactly the model-parallel group plus the dp-cp group.
        assert plan.ranks_involved == frozenset(lay.group_of("tp-pp", role)) | frozenset(
            lay.group_of("dp-cp", role)
        )
        assert not any(len(g.ranks) == w for g in plan.rebuilt), "no world-wide communicator"
    assert job_group_count(lay) > 10 * 16


# ---------------------------------------------------------------------- realisation
def test_tp_dp_alias_at_tp1():
    lay = ParallelLayout(8, pp=2)
    assert realization(lay, "tp-dp") == Realization("tp-dp", "alias", ("dp",))
    assert realization(lay, "tp-dp-cp") == Realization("tp-dp-cp", "alias", ("dp",))
    for r in range(8):
        assert lay.group_of("tp-dp", r) == lay.group_of("dp", r)
    assert "tp-dp" not in comm_kinds(lay) and "dp" in comm_kinds(lay)


def test_tp_dp_composite_at_tp2_dp2():
    lay = ParallelLayout(4, tp=2)
    assert lay.dp == 2
    assert realization(lay, "tp-dp") == Realization("tp-dp", "composite", ("tp", "dp"))
    for r in range(4):
        assert product(lay, "tp", "dp", r) == set(lay.group_of("tp-dp", r)) == {0, 1, 2, 3}


def test_alias_of_inner_at_dp1():
    lay = ParallelLayout(8, tp=2, cp=2, pp=2)
    assert lay.dp == 1
    assert realization(lay, "tp-dp-cp") == Realization("tp-dp-cp", "alias", ("tp-cp",))
    assert realization(lay, "tp-dp") == Realization("tp-dp", "alias", ("tp",))


@pytest.mark.parametrize(
    "lay",
    PLAN_LAYOUTS
    + [
        ParallelLayout(4, tp=2),
        ParallelLayout(8, pp=2),
        ParallelLayout(16, cp=2, pp=2),
        ParallelLayout(32, tp=2, cp=2, ep=2, dist_opt_instances=2),
        ParallelLayout(48, tp=2, pp=2, cp=3, ep=4, etp=1),
    ],
    ids=_ids,
)
def test_realisations_cover_their_groups(lay):
    comms = comm_kinds(lay)
    seen = set()
    for kind in lay.kinds():
        r = realization(lay, kind)
        seen.add(r.how)
        assert r.kind == kind and r.how in ("comm", "alias", "composite")
        assert (kind in comms) == (r.how == "comm"), kind
        for p in r.parts:
            assert p in comms, (kind, p)
        for rank in range(lay.world_size):
            g = lay.group_of(kind, rank)
            if r.how == "alias":
                assert g == lay.group_of(r.parts[0], rank), (kind, rank)
            elif r.how == "composite":
                inner, outer = r.parts
                assert product(lay, inner, outer, rank) == set(g), (kind, rank)
                assert len(g) == len(lay.group_of(inner, rank)) * len(lay.group_of(outer, rank))
                assert len(lay.group_of(inner, rank)) > 1 and len(lay.group_of(outer, rank)) > 1
    assert "comm" in seen
    if lay.dist_opt_instances > 1:
        assert realization(lay, "intra-dist-opt").parts[-1] == "intra-edp"


def test_realization_rejects_unknown_kind():
    with pytest.raises(LayoutError, match="'tq'"):
        realization(ParallelLayout(8, tp=2), "tq")


# ---------------------------------------------------------------------- rosters
def roster(world, standbys=2):
    return Roster(
        0,
        tuple(ProcessInfo(f"node{i // 4}", 1000 + i) for i in range(world)),
        tuple(ProcessInfo("spare", 9000 + i) for i in range(standbys)),
    )


def test_plan_delta_equals_plan_replace():
    lay = ParallelLayout(16, tp=2, pp=2, cp=2)
    old = roster(16)
    new = old.replace(5, old.standbys[0])
    plan = plan_delta(lay, old, new)
    assert isinstance(plan, DeltaPlan)
    assert plan == plan_replace(lay, (5,), 0, 1)
    newer = new.replace(4, old.standbys[1])  # 4 and 5 share their tp and tp-pp groups
    both = plan_delta(lay, old, newer)
    assert both.replaced == (4, 5)
    assert both == plan_replace(lay, (4, 5), 0, 2)
    assert set(both.ranks_involved) == set(plan.ranks_involved) | set(
        plan_replace(lay, (4,)).ranks_involved
    )
    # A group holding both roles is rebuilt once.
    assert len(both.rebuilt) == len(set(both.rebuilt))
    kinds = [g.kind for g in both.rebuilt]
    assert kinds.count("tp") == 1 and kinds.count("tp-pp") == 1 and kinds.count("dp") == 2
    assert GroupRef("tp", (4, 5)) in both.rebuilt


def test_plan_delta_without_change_is_empty():
    lay = ParallelLayout(8, tp=2, pp=2)
    old = roster(8)
    plan = plan_delta(lay, old, old.with_standby(ProcessInfo("spare", 1)))
    assert plan.replaced == () and plan.rebuilt == () and plan.ranks_involved == frozenset()
    assert plan.rebuilt_kinds(3) == () and set(plan.kept_kinds(3)) == set(lay.groups_of(3))


def test_plan_delta_wrong_world_size():
    lay = ParallelLayout(8, tp=2, pp=2)
    small = roster(4)
    with pytest.raises(RosterError) as e:
        plan_delta(lay, small, small.replace(1, small.standbys[0]))
    assert "4" in str(e.value) and "8" in str(e.value)
    old = roster(8)
    with pytest.raises(RosterError):
        plan_delta(lay, old, roster(4))


def test_plan_replace_bad_role():
    lay = ParallelLayout(8, tp=2, pp=2)
    with pytest.raises(LayoutError, match="8"):
        plan_replace(lay, (8,))


# ---------------------------------------------------------------------- parameter sources
@pytest.mark.parametrize(
    "lay",
    [ParallelLayout(8, tp=2, pp=2), ParallelLayout(32, tp=2, pp=2, cp=2), ParallelLayout(16, ep=2)],
    ids=_ids,
)
def test_param_source_is_a_dp_peer(lay):
    for role in range(lay.world_size):
        src = plan_replace(lay, (role,)).param_sources[role]
        assert src is not None and src != role
        a, b = lay.coords(role), lay.coords(src)
        assert (a["tp"], a["cp"], a["pp"]) == (b["tp"], b["cp"], b["pp"])
        assert a["dp"] != b["dp"]
        assert src in lay.group_of("dp", role)


def test_param_source_none_at_dp1():
    for lay in (ParallelLayout(4, tp=2, pp=2), ParallelLayout(8, tp=2, pp=2, cp=2)):
        assert lay.dp == 1
        plan = plan_replace(lay, (3,))
        assert plan.param_sources == {3: None}


def test_param_source_skips_other_replaced_roles():
    lay = ParallelLayout(8, tp=2, pp=2)  # dp groups [0,2] [1,3] [4,6] [5,7]
    plan = plan_replace(lay, (0, 2, 5))
    assert plan.param_sources == {0: None, 2: None, 5: 7}
    lay = ParallelLayout(16, tp=2, pp=2)  # dp4: [0,2,4,6] ...
    assert plan_replace(lay, (0, 2)).param_sources == {0: 4, 2: 4}


# --------------------------------------------------------------------------- several roles lost together
def test_the_delta_of_several_roles_is_the_union_each_group_once():
    """Every pair of roles of world 8 (tp2 pp2 dp2), and a whole two-rank machine: the plan's
    communicators are exactly the union of the single-role plans, none twice."""
    from itertools import combinations

    from pitstop.plan import plan_replace

    lay = ParallelLayout(8, tp=2, pp=2)
    for a, b in combinations(range(8), 2):
        both = plan_replace(lay, (a, b))
        union = set(plan_replace(lay, (a,)).rebuilt) | set(plan_replace(lay, (b,)).rebuilt)
        assert set(both.rebuilt) == union, (a, b)
        assert len(both.rebuilt) == len(set(both.rebuilt)), (a, b)
        assert both.ranks_involved == frozenset(r for g in union for r in g.ranks)
        for r in range(8):  # every rank rebuilds exactly the kinds that hold a or b
            if r in (a, b):
                continue
            want = {g.kind for g in union if r in g.ranks}
            assert want <= set(both.rebuilt_kinds(r)), (a, b, r)


def test_roles_whose_shard_copies_die_with_them_are_unrecoverable():
    from pitstop.plan import ring_neighbours, unrecoverable

    lay = ParallelLayout(8, tp=2, pp=2)          # dp-cp groups: {0,2} {1,3} {4,6} {5,7}
    assert unrecoverable(lay, "dp-cp", (4, 5)) == []        # one machine of tp2: two dp groups
    assert unrecoverable(lay, "dp-cp", (0, 5)) == []
    bad = unrecoverable(lay, "dp-cp", (4, 6))
    assert len(bad) == 2 and "role 4: its shard's only copy was on role 6" in bad[0], bad
    assert ring_neighbours(lay, "dp-cp", 4) == (6, 6)
    lay4 = ParallelLayout(8, tp=1, pp=2)         # dp 4: rings of four
    assert unrecoverable(lay4, "dp-cp", (0, 2)) == []        # not neighbours: both copies survive
    assert unrecoverable(lay4, "dp-cp", (0, 1)) == ["role 0: its shard's only copy was on role 1, lost in the same failure"]
    lay1 = ParallelLayout(4, tp=2, pp=2)         # dp 1
    assert "no data-parallel peer" in unrecoverable(lay1, "dp-cp", (3,))[0]
