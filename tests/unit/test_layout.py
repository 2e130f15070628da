"""Tier 1: ParallelLayout's rank math against megatron-core's own RankGenerator.

Pure, one process, no torch.distributed. megatron-core is only the oracle here.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import warnings
from math import gcd

import pytest

from pitstop.errors import LayoutError, UnknownGroupKindError
from pitstop.layout import DIMS, MEGATRON_KINDS, ParallelLayout

SIZES = (1, 2, 3, 4, 8)
MAX_WORLD = 8192

#: Dense kinds checked against ``RankGenerator(tp, ep=1, dp, pp, cp)``; our kind == Megatron token.
DENSE_TOKENS = (
    "tp", "pp", "dp", "cp", "tp-pp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-dp",
    "cp-pp", "tp-cp-pp", "dp-pp", "tp-dp-pp", "dp-cp-pp", "tp-cp-dp-pp", "pp-tp",
)
#: Expert kinds: ours -> Megatron token of ``RankGenerator(tp=etp, ep, dp=edp, pp, cp=1)``.
EXPERT_TOKENS = {
    "ep": "ep",
    "etp": "tp",
    "edp": "dp",
    "tp-ep": "tp-ep",
    "tp-ep-pp": "tp-ep-pp",
    "etp-ep": "tp-ep",
    "ep-pp": "ep-pp",
    "edp-pp": "dp-pp",
    "ep-edp": "ep-dp",
}


@pytest.fixture(scope="module")
def ps():
    """megatron.core.parallel_state (imports torch, but never initialises a process group)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.parallel_state")


# ---------------------------------------------------------------------- the oracle
def megatron_generators(ps, world, tp, pp, cp, ep, etp, order):
    """Both of Megatron's rank generators, or None where initialize_model_parallel would refuse."""
    if world % (tp * pp * cp) or world % (etp * ep * pp):
        return None
    dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)
    try:
        dense = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        expert = ps.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    except RuntimeError:  # a dimension > 1 left out of the order
        return None
    # The two asserts of initialize_model_parallel, verbatim in meaning.
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        return None
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        return None
    return dense, expert


def megatron_groups(ps, lay: ParallelLayout):
    """Every kind our layout builds, as megatron-core builds it."""
    dense, expert = megatron_generators(
        ps, lay.world_size, lay.tp, lay.pp, lay.cp, lay.ep, lay.etp, lay.order
    )
    out = {tok: dense.get_ranks(tok) for tok in DENSE_TOKENS}
    out.update({ours: expert.get_ranks(tok) for ours, tok in EXPERT_TOKENS.items()})
    pp_groups = dense.get_ranks("pp")
    out["embd"] = [ps.default_embedding_ranks(g) for g in pp_groups]
    out["pos-embd"] = [ps.default_position_embedding_ranks(g) for g in pp_groups]

    n = lay.dist_opt_instances
    dp_size, edp_size = lay.world_size // (lay.tp * lay.pp * lay.cp), lay.world_size // (
        lay.etp * lay.ep * lay.pp
    )
    # intra-partial dp-cp: Megatron slices each dp-cp group into n consecutive chunks.
    intra_dp = dp_size * lay.cp // n
    out["intra-dp-cp"] = [
        g[i * intra_dp : (i + 1) * intra_dp] for g in dense.get_ranks("dp-cp") for i in range(n)
    ]
    # intra-partial edp: level 0 of create_hierarchical_groups(ranks, [edp // n, n]),
    # i.e. einops "(l s u) -> (l u) s" with u=1, s=edp//n, l=n: consecutive rows.
    intra_edp = edp_size // n
    out["intra-edp"] = [
        g[i * intra_edp : (i + 1) * intra_edp] for g in expert.get_ranks("dp") for i in range(n)
    ]
    # intra-dist-opt: initialize_model_parallel's loop, literally.
    groups = []
    model_parallel_group_id = 0
    intra_dist_opt_ranks = []
    for ranks in expert.get_ranks("tp-ep-pp"):
        model_parallel_group_id += 1
        intra_dist_opt_ranks.extend(ranks)
        if model_parallel_group_id % intra_edp == 0:
            groups.append(intra_dist_opt_ranks)
            intra_dist_opt_ranks = []
    out["intra-dist-opt"] = groups
    return out


def _divisors(n, among=(1, 2, 3, 4)):
    return [d for d in among if n % d == 0]


def random_layout_args(rng: random.Random):
    """(world, tp, pp, cp, ep, etp, order, dist_opt_instances); most small, some large."""
    while True:
        tp, pp, cp, ep, etp = (rng.choice(SIZES) for _ in range(5))
        dense, expert = tp * pp * cp, etp * ep * pp
        base = dense * expert // gcd(dense, expert)
        u = rng.random()
        cap = 64 if u < 0.75 else 512 if u < 0.975 else MAX_WORLD
        if base > cap:
            continue
        world = base * rng.randint(1, cap // base)
        sizes = {"tp": max(tp, etp), "cp": cp, "ep": ep, "pp": pp,
                 "dp": max(world // dense, world // expert)}
        dims = list(DIMS)
        rng.shuffle(dims)
        if rng.random() < 0.25:  # Megatron appends dimensions of size 1 left out of the order
            dims = [d for d in dims if sizes[d] > 1 or rng.random() < 0.5] or ["tp"]
        order = "-".join(dims)
        m = gcd((world // dense) * cp, world // expert)
        n = 1 if rng.random() < 0.6 else rng.choice(_divisors(m))
        return world, tp, pp, cp, ep, etp, order, n


def assert_layout_matches(ps, lay: ParallelLayout, sample_ranks=()):
    want = megatron_groups(ps, lay)
    assert set(lay.kinds()) <= set(want), "every kind the layout builds must be checked"
    assert set(MEGATRON_KINDS) <= set(lay.kinds())
    for kind, groups in want.items():
        got = lay.group_ranks(kind)
        assert got == groups, f"{lay.describe()}: kind {kind!r} differs from megatron-core"
        # Every rank is in exactly one group (embd/pos-embd: at most one).
        flat = [r for g in got for r in g]
        assert len(flat) == len(set(flat))
        if kind not in ("embd", "pos-embd"):
            assert sorted(flat) == list(range(lay.world_size)), kind
    for r in sample_ranks:
        for kind, groups in want.items():
            holding = [g for g in groups if r in g]
            assert lay.group_of(kind, r) == (holding[0] if holding else None), (kind, r)


# ---------------------------------------------------------------------- oracle tests
EXPLICIT = [
    dict(world_size=8192, tp=8, pp=8),  # TP8 PP8 DP128
    dict(world_size=8192, tp=8, pp=8, ep=8, etp=1),
    dict(world_size=8, tp=2, pp=2),
    dict(world_size=16, tp=2, pp=2, cp=2),
    dict(world_size=16, ep=2),
    dict(world_size=64, tp=2, pp=4),
    dict(world_size=48, tp=2, pp=2, cp=3, ep=4, etp=1, order="tp-cp-ep-dp-pp"),
    dict(world_size=32, tp=2, pp=2, cp=2, ep=2, order="tp-pp-cp-ep-dp"),
    dict(world_size=64, tp=2, pp=2, cp=2, ep=4, etp=2, dist_opt_instances=2),
    dict(world_size=24, pp=2, cp=3, ep=3, order="pp-dp-cp-tp-ep"),
    dict(world_size=8, tp=1, pp=2, etp=2, order="tp-dp-pp"),  # order ends in pp, edp != dp
]


@pytest.mark.parametrize("kw", EXPLICIT, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_explicit_layouts_match_megatron(ps, kw):
    lay = ParallelLayout(**kw)
    w = lay.world_size
    assert_layout_matches(ps, lay, sample_ranks=sorted({0, 1, w // 3, w // 2, w - 1}))


def test_8192_tp8_pp8_dp128_shape():
    lay = ParallelLayout(8192, tp=8, pp=8)
    assert (lay.dp, lay.edp, lay.etp) == (128, 128, 8)
    tp, dp, pp = lay.group_ranks("tp"), lay.group_ranks("dp"), lay.group_ranks("pp")
    assert (len(tp), len(dp), len(pp)) == (1024, 64, 1024)
    assert tp[0] == list(range(8)) and dp[0] == list(range(0, 1024, 8))
    assert pp[0] == list(range(0, 8192, 1024))
    assert lay.group_ranks("embd")[5] == [5, 7173] and lay.group_ranks("pos-embd")[5] == [5]
    (ido,) = lay.group_ranks("intra-dist-opt")  # one instance: all of tp-ep-pp x edp
    assert ido[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 1024] and sorted(ido) == list(range(8192))


def test_random_layouts_match_megatron(ps):
    rng = random.Random(20240611)
    valid = invalid = large = 0
    while valid < 320:
        world, tp, pp, cp, ep, etp, order, n = random_layout_args(rng)
        kw = dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order, dist_opt_instances=n)
        if megatron_generators(ps, world, tp, pp, cp, ep, etp, order) is None:
            # Megatron refuses it, so must we: with a LayoutError, never AssertionError.
            with pytest.raises(LayoutError):
                ParallelLayout(world, **kw)
            invalid += 1
            continue
        lay = ParallelLayout(world, **kw)
        large += world > 512
        assert_layout_matches(ps, lay, sample_ranks=[rng.randrange(world) for _ in range(3)])
        valid += 1
    # The generator really covers the interesting corners.
    assert invalid > 0 and large >= 5


def test_acceptance_agrees_with_megatron(ps):
    """On a grid of small layouts (full and partial orders), we refuse exactly what Megatron refuses."""
    orders = ["-".join(p) for p in itertools.permutations(DIMS)] + [
        "tp-dp-pp", "tp-pp", "pp-dp", "dp-tp-pp", "tp-cp-dp-pp", "tp-ep-dp-pp",
    ]
    disagree, accepted = [], 0
    for world, tp, pp, cp, ep, etp in itertools.product(
        (8, 12), (1, 2), (1, 2), (1, 2), (1, 2), (1, 2)
    ):
        for order in orders:
            ok_megatron = megatron_generators(ps, world, tp, pp, cp, ep, etp, order) is not None
            try:
                ParallelLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
                ok_ours = True
            except LayoutError:
                ok_ours = False
            accepted += ok_ours
            if ok_ours != ok_megatron:
                disagree.append((world, tp, pp, cp, ep, etp, order, ok_megatron))
    assert not disagree, disagree[:5]
    assert accepted > 100


# ---------------------------------------------------------------------- coordinates
COORD_LAYOUTS = [
    ParallelLayout(8, tp=2, pp=2),
    ParallelLayout(16, tp=2, pp=2, cp=2),
    ParallelLayout(16, ep=2),
    ParallelLayout(64, tp=2, pp=4),
    ParallelLayout(48, tp=2, pp=2, cp=3, ep=4, etp=1),
    ParallelLayout(32, tp=2, pp=2, cp=2, ep=2, order="tp-pp-cp-ep-dp"),
    ParallelLayout(96, tp=3, pp=2, ep=2, etp=2, order="tp-ep-dp-pp"),
    ParallelLayout(64, tp=2, pp=2, cp=2, ep=4, etp=2, dist_opt_instances=2),
]


@pytest.mark.parametrize("lay", COORD_LAYOUTS, ids=lambda lay: lay.describe())
def test_coords_round_trip_and_group_index(lay):
    index = {}  # (coordinate name, rank) -> index of rank in its group
    for name, kind in (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"),
                       ("etp", "etp"), ("ep", "ep"), ("edp", "edp")):
        for g in lay.group_ranks(kind):
            for i, r in enumerate(g):
                index[name, r] = i
    seen = set()
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert set(c) == {"tp", "cp", "dp", "pp", "etp", "ep", "edp"}
        for name, v in c.items():
            assert v == index[name, r], (r, name)
        dense = lay.rank(tp=c["tp"], cp=c["cp"], dp=c["dp"], pp=c["pp"])
        expert = lay.rank(etp=c["etp"], ep=c["ep"], edp=c["edp"], pp=c["pp"])
        assert dense == r and expert == r
        seen.add((c["tp"], c["cp"], c["dp"], c["pp"]))
    assert len(seen) == lay.world_size


@pytest.mark.parametrize("lay", COORD_LAYOUTS, ids=lambda lay: lay.describe())
def test_groups_of_every_rank(lay):
    all_groups = {k: lay.group_ranks(k) for k in lay.kinds()}
    for r in range(lay.world_size):
        mine = lay.groups_of(r)
        for kind, groups in all_groups.items():
            holding = [g for g in groups if r in g]
            assert len(holding) <= 1
            if holding:
                assert mine[kind] == holding[0], (r, kind)
                assert lay.group_of(kind, r) == holding[0]
            else:
                assert kind in ("embd", "pos-embd") and kind not in mine
        assert set(mine) <= set(all_groups)


def test_dist_opt_instances_adds_intra_kinds():
    assert "intra-dp-cp" not in ParallelLayout(16, tp=2).kinds()
    lay = ParallelLayout(16, tp=2, dist_opt_instances=2)
    assert {"intra-dp-cp", "intra-edp"} <= set(lay.kinds())
    assert lay.group_ranks("intra-dp-cp")[:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert lay.group_ranks("intra-dist-opt") == [list(range(8)), list(range(8, 16))]


# ---------------------------------------------------------------------- invalid input
def test_world_not_divisible_names_every_factor():
    with pytest.raises(LayoutError) as e:
        ParallelLayout(12, tp=2, pp=4)
    assert str(e.value) == "tp(2) * pp(4) * cp(1) does not divide world_size(12)"
    assert isinstance(e.value, ValueError) and not isinstance(e.value, AssertionError)


def test_expert_not_divisible_names_every_factor():
    with pytest.raises(LayoutError) as e:
        ParallelLayout(12, tp=2, ep=4)
    assert str(e.value) == "etp(2) * ep(4) * pp(1) does not divide world_size(12)"


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(world_size=0), ["world_size(0)"]),
        (dict(world_size=8, tp=0), ["tp(0)"]),
        (dict(world_size=8, pp=-2), ["pp(-2)"]),
        (dict(world_size=8, cp=True), ["cp(True)"]),
        (dict(world_size=8, ep="2"), ["ep('2')"]),
        (dict(world_size=8, etp=0), ["etp(0)"]),
        (dict(world_size=8.0), ["world_size(8.0)"]),
        (dict(world_size=8, tp=2, dist_opt_instances=0), ["dist_opt_instances(0)"]),
        (dict(world_size=8, tp=2, dist_opt_instances=3), ["dist_opt_instances(3)", "dp(4)"]),
        (dict(world_size=8, vpp=2), ["vpp(2)", "pp(1)"]),
        (dict(world_size=8, pp=2, vpp=0), ["vpp(0)"]),
        (dict(world_size=8, order="tp-xx-dp"), ["'tp-xx-dp'", "xx"]),
        (dict(world_size=8, order="tp-tp-dp"), ["'tp-tp-dp'", "repeats"]),
        (dict(world_size=8, order=5), ["order(5)"]),
        (dict(world_size=8, tp=2, order="dp-pp"), ["'dp-pp'", "tp(2)"]),
        (dict(world_size=8, tp=2, pp=2, etp=1, order="pp-tp-cp-ep-dp"), ["does not end in pp"]),
        (dict(world_size=8, tp=1, pp=2, cp=2, etp=2, order="tp-ep-dp-pp-cp"), ["stride"]),
    ],
)
def test_invalid_layout_raises_layout_error(kw, words):
    with pytest.raises(LayoutError) as e:
        ParallelLayout(**kw)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("kind", ["tq", "tp-ep-cp", "", "tp-tp", "etp-tp", "intra-foo", None, 3])
def test_unknown_kind(kind):
    lay = ParallelLayout(8, tp=2, pp=2)
    with pytest.raises(UnknownGroupKindError) as e:
        lay.group_ranks(kind)
    assert isinstance(e.value, LayoutError) and isinstance(e.value, ValueError)
    assert repr(kind) in str(e.value)
    with pytest.raises(UnknownGroupKindError):
        lay.group_of(kind, 0)


def test_unknown_kind_message_names_it():
    with pytest.raises(UnknownGroupKindError, match="'tq'"):
        ParallelLayout(8, tp=2).group_ranks("tq")


@pytest.mark.parametrize("rank", [-1, 8, True, "0", 1.0])
def test_bad_rank(rank):
    lay = ParallelLayout(8, tp=2, pp=2)
    with pytest.raises(LayoutError, match="rank"):
        lay.coords(rank)
    with pytest.raises(LayoutError):
        lay.group_of("tp", rank)


def test_bad_coordinates():
    lay = ParallelLayout(8, tp=2, pp=2)
    with pytest.raises(LayoutError, match=r"tp\(2\) out of range 0\.\.1"):
        lay.rank(tp=2)
    with pytest.raises(LayoutError, match="mix"):
        lay.rank(tp=0, ep=0)
    with pytest.raises(LayoutError, match="mix"):
        lay.rank(xp=0)
    with pytest.raises(LayoutError):
        lay.rank(dp=True)


# ---------------------------------------------------------------------- imports
def test_core_modules_import_no_torch():
    code = (
        "import pitstop.layout, pitstop.plan, pitstop.roster, sys; "
        "bad = sorted(m for m in sys.modules if m.startswith('torch') or m.startswith('megatron')); "
        "assert not bad, bad"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
