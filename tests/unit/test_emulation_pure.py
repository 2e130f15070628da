"""Tier 1: emulation's pure half -- topology, cost model, slicing, replay, Chrome trace.

One process, no torch.distributed. Timings use powers of two so float arithmetic is
exact and results are compared with ``==``.
"""

from __future__ import annotations

import json
import warnings

import pytest

from pitstop.emulation.calibrate import fit_alpha_beta, fit_link
from pitstop.emulation.chrome_trace import to_chrome_trace
from pitstop.emulation.graph import (
    Comm, Compute, RoleClass, Trace, dump_traces, load_traces, slice_graph, stage_kind,
)
from pitstop.emulation.replay import replay
from pitstop.emulation.synthetic import one_f_one_b_traces
from pitstop.emulation.topology import (
    COLLECTIVES, LinkClass, Topology, collective_cost, from_dict, load, p2p_cost,
)
from pitstop.errors import ReplayError, TopologyError, TraceError
from pitstop.layout import ParallelLayout

A = 2.0 ** -10  # alpha, s
BW = 2.0 ** 20  # bytes/s
MB = 1 << 20


def topo(gpn: int = 8, alpha: float = A, bw: float = BW, inter_alpha=None, inter_bw=None) -> Topology:
    return Topology(gpn, LinkClass("intra_node", alpha, bw),
                    LinkClass("inter_node", alpha if inter_alpha is None else inter_alpha,
                              bw if inter_bw is None else inter_bw))


def good_dict() -> dict:
    return {"name": "t", "gpus_per_node": 4,
            "intra_node": {"alpha_s": 1e-6, "bandwidth_bytes_per_s": 1e11},
            "inter_node": {"alpha_s": 5e-6, "bandwidth_bytes_per_s": 1e10}}


# ---------------------------------------------------------------------- topology
def test_shipped_topologies_load():
    h = load("h200-nvlink-ib")
    assert h.gpus_per_node == 8
    assert h.intra_node.bandwidth_bytes_per_s == 450e9 and h.inter_node.bandwidth_bytes_per_s == 50e9
    assert "NDR" in h.doc
    g = load("cpu-gloo-loopback")
    assert g.calibrated and "pitstop.emulation.calibrate" in g.calibrated
    assert g.intra_node.alpha_s == g.inter_node.alpha_s > 0


def test_topology_json_and_toml_files(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(good_dict()))
    t = load(p)
    assert t.inter_node == LinkClass("inter_node", 5e-6, 1e10)
    assert from_dict(t.to_dict()) == t
    q = tmp_path / "t.toml"
    q.write_text('gpus_per_node = 2\n[intra_node]\nalpha_s = 1e-6\nbandwidth_bytes_per_s = 2e9\n'
                 '[inter_node]\nalpha_s = 2e-6\nbandwidth_bytes_per_s = 1e9\n')
    assert load(q).inter_node.bandwidth_bytes_per_s == 1e9


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(bandwidth=3), ["'bandwidth'", "gpus_per_node", "inter_node"]),
    (lambda d: d["intra_node"].update(beta=1), ["intra_node", "'beta'", "alpha_s, bandwidth_bytes_per_s"]),
    (lambda d: d.pop("inter_node"), ["missing", "inter_node"]),
    (lambda d: d["intra_node"].pop("alpha_s"), ["intra_node", "missing", "alpha_s"]),
    (lambda d: d["intra_node"].update(alpha_s=-1.0), ["intra_node.alpha_s(-1.0)", ">= 0", "seconds"]),
    (lambda d: d["inter_node"].update(bandwidth_bytes_per_s=0), ["inter_node.bandwidth_bytes_per_s(0)", "> 0"]),
    (lambda d: d["inter_node"].update(bandwidth_bytes_per_s="fast"), ["bandwidth_bytes_per_s('fast')"]),
    (lambda d: d.update(gpus_per_node=0), ["gpus_per_node(0)", "integer >= 1"]),
    (lambda d: d.update(gpus_per_node=True), ["gpus_per_node(True)"]),
    (lambda d: d.update(intra_node=5), ["intra_node(5)", "alpha_s"]),
])
def test_topology_bad_input_names_key_and_expectation(tmp_path, mutate, words):
    d = good_dict()
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(TopologyError) as exc:
        load(p)
    for w in words:
        assert w in str(exc.value)
    assert str(p) in str(exc.value)


def test_topology_bad_files(tmp_path):
    with pytest.raises(TopologyError, match="does not exist.*h200-nvlink-ib"):
        load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"gpus_per_node\": 8,")
    with pytest.raises(TopologyError, match="not valid JSON at line 1"):
        load(bad)
    yml = tmp_path / "t.yaml"
    yml.write_text("x")
    with pytest.raises(TopologyError, match="'.yaml'.*expected .json or .toml"):
        load(yml)


def test_link_classes_and_group_link():
    t = topo(gpn=4, alpha=A, bw=BW, inter_alpha=8 * A, inter_bw=BW / 4)
    assert t.link_class(0, 3).name == "intra_node" and t.link_class(3, 4).name == "inter_node"
    assert t.group_link([4, 5, 6, 7]) is t.intra_node
    assert t.group_link([0, 4, 8]) is t.inter_node
    # Spanning nodes with two members on one node: worst of both (here inter in both).
    assert (t.group_link([0, 1, 4]).alpha_s, t.group_link([0, 1, 4]).bandwidth_bytes_per_s) == (8 * A, BW / 4)
    # An odd topology whose intra link has the worse bandwidth: elementwise worst.
    odd = topo(gpn=2, alpha=A, bw=BW / 8, inter_alpha=2 * A, inter_bw=BW)
    link = odd.group_link([0, 1, 2])
    assert (link.alpha_s, link.bandwidth_bytes_per_s) == (2 * A, BW / 8)
    # Topology.cost picks the group's link: a spanning dp group pays the inter link.
    assert t.cost("all_reduce", [0, 4], MB) == 2 * 1 / 2 * 4.0 + 2 * 8 * A
    assert t.p2p_cost(0, 1, MB) == A + 1.0 and t.p2p_cost(3, 4, MB) == 8 * A + 4.0


# ---------------------------------------------------------------------- measured tables
def tabled(table: dict) -> Topology:
    d = good_dict()
    d["intra_node"]["table"] = table
    return from_dict(json.loads(json.dumps(d)))


def test_a_measured_table_is_interpolated_between_its_sizes_and_extended_past_them():
    """nccl-tests style rows: linear between measured sizes, flat below the smallest (latency),
    along the last slope above the largest; the alpha-beta model where the table has no row."""
    t = tabled({"all_reduce": {"2": [[1024, 4 * A], [MB, 64 * A], [2 * MB, 96 * A]]},
                "send": {"2": [[0, A], [MB, 2.0]]}})
    assert t.cost("all_reduce", [0, 1], 1024) == 4 * A
    assert t.cost("all_reduce", [0, 1], MB) == 64 * A
    assert t.cost("all_reduce", [0, 1], MB + MB // 2) == 80 * A            # halfway: halfway
    assert t.cost("all_reduce", [0, 1], 16) == 4 * A                       # below: the latency floor
    assert t.cost("all_reduce", [0, 1], 4 * MB) == 160 * A                 # above: the last slope (32 A per MB)
    assert t.p2p_cost(0, 1, MB // 2) == A + (2.0 - A) / 2
    # no row for all_gather: the alpha-beta model, as without a table
    plain = from_dict(good_dict())
    assert t.cost("all_gather", [0, 1], MB) == plain.cost("all_gather", [0, 1], MB)
    # a group size the table lacks: the nearest row scaled by the model's ratio between the sizes
    want = 64 * A * plain.cost("all_reduce", [0, 1, 2, 3], MB) / plain.cost("all_reduce", [0, 1], MB)
    assert t.cost("all_reduce", [0, 1, 2, 3], MB) == pytest.approx(want, rel=1e-12)
    # the inter-node link has no table: the model; and the file form round-trips the table
    assert t.cost("all_reduce", [0, 8], MB) == plain.cost("all_reduce", [0, 8], MB)
    assert from_dict(t.to_dict()).intra_node.table == t.intra_node.table


@pytest.mark.parametrize("table, words", [
    ({"allreduce": {"2": [[1, 1e-3], [2, 2e-3]]}}, ["'allreduce'", "all_reduce", "send"]),
    ({"all_reduce": {"1": [[1, 1e-3], [2, 2e-3]]}}, ["group size '1'", ">= 2"]),
    ({"all_reduce": {"2": [[1, 1e-3]]}}, ["all_reduce[2]", ">= 2 points"]),
    ({"all_reduce": {"2": [[4, 1e-3], [2, 2e-3]]}}, ["sizes [4, 2]", "strictly ascending"]),
    ({"all_reduce": {"2": [[1, 1e-3], [2, 0]]}}, ["at 2 bytes(0)", "> 0", "seconds"]),
    ({"all_reduce": {"2": [[1, 1e-3], [2.5, 2e-3]]}}, ["sizes [1, 2.5]", "integers"]),
    ({"all_reduce": []}, ["all_reduce([])", "non-empty"]),
    ([1, 2], ["table([1, 2])", "group size"]),
])
def test_a_bad_measured_table_is_refused_by_its_entry(table, words):
    with pytest.raises(TopologyError) as exc:
        tabled(table)
    for w in words:
        assert w in str(exc.value), str(exc.value)


# ---------------------------------------------------------------------- cost model
def test_cost_formulas_hand_computed():
    link = LinkClass("x", A, BW)  # 1 MiB takes exactly 1 s
    assert collective_cost("all_reduce", 4, MB, link) == 1.5 + 6 * A       # 2*3/4 * 1 + 2*3 alpha
    assert collective_cost("all_gather", 4, MB, link) == 0.75 + 3 * A       # 3/4 * 1 + 3 alpha
    assert collective_cost("reduce_scatter", 4, MB, link) == 0.75 + 3 * A
    assert collective_cost("broadcast", 4, MB, link) == 1.0 + 3 * A         # bytes*beta + (n-1) alpha
    assert collective_cost("all_to_all", 8, MB, link) == 0.875 + 7 * A      # 7/8 * 1 + 7 alpha
    assert collective_cost("barrier", 5, MB, link) == 3 * A                 # ceil(log2 5) alpha
    assert p2p_cost(MB // 2, link) == 0.5 + A
    for op in COLLECTIVES:
        assert collective_cost(op, 1, MB, link) == 0.0
    with pytest.raises(TopologyError, match="unknown collective 'allreduce'.*all_reduce"):
        collective_cost("allreduce", 4, MB, link)


def test_fit_alpha_beta_recovers_a_line():
    sizes = [1024, 65536, 1 << 20, 1 << 24]
    times = [A + s / BW for s in sizes]
    alpha, beta = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(A, rel=1e-9) and beta == pytest.approx(1 / BW, rel=1e-9)
    with pytest.raises(Exception, match="2 distinct sizes"):
        fit_alpha_beta([5, 5], [1.0, 1.0])


def test_fit_link_recovers_the_link_from_measured_collectives():
    """Rows measured in a fully real trace: the fit inverts the cost model the replay uses,
    averages repeats of one operation, and leaves p2p and barriers out."""
    link = LinkClass("intra_node", A, BW)
    ops = [("all_reduce", 2, 4096), ("all_reduce", 4, 1 << 20), ("all_gather", 2, 1 << 16), ("reduce_scatter", 8, 1 << 22)]
    rows = [(op, n, b, collective_cost(op, n, b, link)) for op, n, b in ops]
    # a repeat measured 10 % slower and 10 % faster: the mean is the model's
    rows += [(op, n, b, t * f) for (op, n, b, t), f in zip(rows[:2], (1.1, 0.9))] + [(op, n, b, t * f) for (op, n, b, t), f in zip(rows[:2], (0.9, 1.1))]
    rows += [("send", 2, 1 << 20, 99.0), ("recv", 2, 1 << 20, 99.0), ("barrier", 2, 0, 99.0)]
    fitted = fit_link(rows)
    assert fitted.alpha_s == pytest.approx(A, rel=1e-9)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(BW, rel=1e-9)
    with pytest.raises(Exception, match="needs >= 2 distinct collectives"):
        fit_link([("all_reduce", 2, 8, 1e-4), ("send", 2, 8, 1e-4)])


# ---------------------------------------------------------------------- slicing
def trace(stage: str, ops, iterations: int = 1, pp_rank=None, tag: str = "") -> Trace:
    return Trace(0, RoleClass(stage, pp_rank, tag), (tuple(ops),) * iterations)


STAGE_OPS = {
    "first": [Compute(1.0), Comm("all_reduce", "tp", 64), Comm.send(MB, +1), Comm.recv(MB, +1),
              Comm("all_reduce", "dp", MB), Comm("all_reduce", "embd", 8)],
    "middle": [Comm.recv(MB, -1), Compute(1.0), Comm("all_reduce", "tp", 64), Comm.send(MB, +1),
               Comm.recv(MB, +1), Comm.send(MB, -1), Comm("all_reduce", "dp", MB)],
    "last": [Comm.recv(MB, -1), Compute(1.0), Comm("all_reduce", "tp", 64), Comm.send(MB, -1),
             Comm("all_reduce", "dp", MB), Comm("all_reduce", "embd", 8)],
}


def stage_traces(pp: int):
    kinds = {stage_kind(s, pp) for s in range(pp)}
    return [trace(k, STAGE_OPS[k]) for k in ("first", "middle", "last") if k in kinds]


def test_stage_kinds():
    assert stage_kind(0, 1) == "first_last"
    assert [stage_kind(s, 2) for s in range(2)] == ["first", "last"]
    assert [stage_kind(s, 4) for s in range(4)] == ["first", "middle", "middle", "last"]


def test_slicing_world8_matches_layout_and_megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps = pytest.importorskip("megatron.core.parallel_state")
    lay = ParallelLayout(8, tp=2, pp=2)
    gen = ps.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    oracle = {k: gen.get_ranks(k) for k in ("tp", "dp", "pp")}
    oracle["embd"] = [ps.default_embedding_ranks(g) for g in oracle["pp"]]
    graph = slice_graph(lay, stage_traces(2))
    seen = 0
    for r in range(8):
        assert graph.class_of(r) == RoleClass("first" if r < 4 else "last")
        mega_pp = next(g for g in oracle["pp"] if r in g)
        for it, j, op, target in graph.rank_ops(r):
            if isinstance(op, Compute):
                assert target is None
            elif op.is_p2p:
                assert target == mega_pp[(mega_pp.index(r) + op.peer) % 2] != r
                seen += 1
            else:
                assert list(target) == lay.group_of(op.group_kind, r)
                assert list(target) == next(g for g in oracle[op.group_kind] if r in g)
                table = graph.group_table(op.group_kind)
                assert table.groups[table.index[r]] == target
                seen += 1
    assert seen == 4 * 5 + 4 * 5  # first: 5 comm ops, last: 5


def test_slicing_pp4_classes_and_peers():
    lay = ParallelLayout(16, tp=2, pp=4)
    graph = slice_graph(lay, stage_traces(4))
    assert [str(graph.class_of(lay.rank(pp=s))) for s in range(4)] == ["first", "middle", "middle", "last"]
    for r in range(16):
        g = lay.group_of("pp", r)
        s = g.index(r)
        if 0 < s < 3:
            assert graph.peer(r, +1) == g[s + 1] and graph.peer(r, -1) == g[s - 1]
    # A per-stage trace is preferred over the stage-kind one.
    per_stage = trace("middle", STAGE_OPS["middle"], pp_rank=2)
    g2 = slice_graph(lay, stage_traces(4) + [per_stage])
    assert g2.class_of(lay.rank(pp=2)) == RoleClass("middle", 2)
    assert g2.class_of(lay.rank(pp=1)) == RoleClass("middle")


def test_slicing_bad_input():
    lay = ParallelLayout(8, tp=2, pp=2)
    with pytest.raises(TraceError, match=r"no trace for pipeline stage 1 of pp\(2\): need class last@pp1 or last"):
        slice_graph(lay, [trace("first", STAGE_OPS["first"])])
    with pytest.raises(TraceError, match="trace.*middle fit no rank.*tp2 pp2"):
        slice_graph(lay, stage_traces(2) + [trace("middle", STAGE_OPS["middle"])])
    with pytest.raises(TraceError, match="two traces for class first"):
        slice_graph(lay, stage_traces(2) + [trace("first", STAGE_OPS["first"])])
    with pytest.raises(TraceError, match="number of iterations: first: 2, last: 1"):
        slice_graph(lay, [trace("first", STAGE_OPS["first"], 2), trace("last", STAGE_OPS["last"])])
    with pytest.raises(TraceError, match=r"override rank 5 -> first/slow: rank 5 is pipeline stage 1 \(last\)"):
        slice_graph(lay, stage_traces(2) + [trace("first", STAGE_OPS["first"], tag="slow")],
                    {5: RoleClass("first", tag="slow")})
    lay4 = ParallelLayout(16, tp=2, pp=4)
    bad_mid = [trace("first", STAGE_OPS["first"]), trace("last", STAGE_OPS["last"]),
               trace("middle", [Comm("all_reduce", "embd", 8)])]
    with pytest.raises(TraceError, match="rank 4 \\(middle\\).*'embd'.*no 'embd' group.*stage 1 of 4"):
        slice_graph(lay4, bad_mid)
    with pytest.raises(TraceError, match="unknown group kind 'tq'"):
        slice_graph(ParallelLayout(2), [trace("first_last", [Comm("all_reduce", "tq", 8)])])
    with pytest.raises(TraceError, match=r"peer\(2\) lands on itself with pp\(2\)"):
        slice_graph(lay, [trace("first", [Comm.send(8, 2)]), trace("last", [Comm.recv(8, -2)])])
    with pytest.raises(TraceError, match="Comm send peer\\(0\\)"):
        Comm.send(8, 0)
    with pytest.raises(TraceError, match="nbytes\\(-1\\)"):
        Comm("all_reduce", "dp", -1)
    with pytest.raises(TraceError, match="duration_s\\(-1"):
        Compute(-1.0)


def test_trace_json_round_trip_and_errors(tmp_path):
    traces = one_f_one_b_traces(4, 3, 2, fwd_s=0.5, bwd_s=1.0, act_bytes=64, grad_bytes=128, tp_bytes=16)
    p = tmp_path / "t.json"
    dump_traces(traces, p)
    assert load_traces(p) == traces
    data = json.loads(p.read_text())
    data["traces"][1]["iterations"][0][0]["bytes"] = 3
    p.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"traces\[1\].iterations\[0\]\[0\]: unknown key\(s\) 'bytes'"):
        load_traces(p)


def test_graph_is_compact_at_8192():
    lay = ParallelLayout(8192, tp=8, pp=8)
    graph = slice_graph(lay, stage_traces(8))
    assert len(graph.programs) == 3
    assert len({id(graph.program(r)) for r in range(8192)}) == 3
    classes = graph.classes()
    assert {str(c) for c in classes} == {"first", "middle", "last"}
    assert sum(c == RoleClass("middle") for c in classes) == 6 * 1024
    per_stage = slice_graph(lay, one_f_one_b_traces(8, 4, fwd_s=1.0, bwd_s=2.0, act_bytes=64, grad_bytes=64))
    assert len(per_stage.programs) == 8
    assert len({id(per_stage.program(r)) for r in range(8192)}) == 8
    # Slicing resolved groups only for one checked rank per class, not per rank.
    assert {r for _, r in graph._cache} == {lay.rank(pp=s) for s in (0, 1, 7)}


# ---------------------------------------------------------------------- replay
def two_stage():
    """1F1B with 2 microbatches on 2 stages; F = 1 s, B = 2 s, a message 0.625 s."""
    act = MB // 2
    first = [Compute(1.0, "F1"), Comm.send(act), Compute(1.0, "F2"), Comm.send(act),
             Comm.recv(act, +1), Compute(2.0, "B1"), Comm.recv(act, +1), Compute(2.0, "B2")]
    last = [Comm.recv(act), Compute(1.0, "F1"), Compute(2.0, "B1"), Comm.send(act, -1),
            Comm.recv(act), Compute(1.0, "F2"), Compute(2.0, "B2"), Comm.send(act, -1)]
    graph = slice_graph(ParallelLayout(2, pp=2), [trace("first", first, 2), trace("last", last, 2)])
    return replay(graph, topo(gpn=1, alpha=0.125, bw=BW))


def test_two_stage_pipeline_exact():
    res = two_stage()
    spans = lambda r: [(t.start, t.end, t.wait) for t in res.timeline(r) if t.iteration == 0]
    assert spans(0) == [(0, 1, 0), (1, 1, 0), (1, 2, 0), (2, 2, 0),
                        (2, 5.25, 2.625), (5.25, 7.25, 0), (7.25, 8.25, 0.375), (8.25, 10.25, 0)]
    assert spans(1) == [(0, 1.625, 1), (1.625, 2.625, 0), (2.625, 4.625, 0), (4.625, 4.625, 0),
                        (4.625, 4.625, 0), (4.625, 5.625, 0), (5.625, 7.625, 0), (7.625, 7.625, 0)]
    assert res.iteration_times(0) == [10.25, 10.25]
    assert res.iteration_times(1) == [7.625, 10.25]
    assert res.breakdown(0, 0) == {"total": 10.25, "compute": 6.0, "comm": 1.25, "comm_wait": 0.0, "bubble": 3.0}
    assert res.breakdown(1, 0) == {"total": 7.625, "compute": 6.0, "comm": 0.625, "comm_wait": 0.0, "bubble": 1.0}
    # Second iteration of the last stage waits 3.625 s for the first stage's F1.
    assert res.breakdown(1, 1)["bubble"] == 3.625


def dp_straggler():
    lay = ParallelLayout(4)  # dp4
    ops = lambda d: [Compute(d), Comm("all_reduce", "dp", MB)]
    traces = [trace("first_last", ops(1.0)), trace("first_last", ops(1.5), tag="slow")]
    return slice_graph(lay, traces, {2: RoleClass("first_last", tag="slow")})


@pytest.mark.parametrize("symmetry", [True, False])
def test_dp_all_reduce_waits_for_the_straggler(symmetry):
    res = replay(dp_straggler(), topo(gpn=4), symmetry=symmetry)
    cost = 1.5 + 6 * A
    for r in range(4):
        ar = res.timeline(r)[1]
        assert ar.start == (1.5 if r == 2 else 1.0)
        assert ar.wait == (0.0 if r == 2 else 0.5)
        assert ar.end == 1.5 + cost
        b = res.breakdown(r)
        assert b["comm_wait"] == ar.wait and b["comm"] == cost and b["bubble"] == 0.0
    assert res.partition.n_nodes == (2 if symmetry else 4)


def test_replay_errors():
    lay = ParallelLayout(2, pp=2)
    dead = slice_graph(lay, [trace("first", [Comm.recv(8, +1), Comm.send(8, +1)]),
                             trace("last", [Comm.recv(8, -1), Comm.send(8, -1)])])
    with pytest.raises(ReplayError, match="deadlock: 2 distinct timeline.*rank 0 \\(first\\) at op 0"):
        replay(dead, topo())
    mism = slice_graph(ParallelLayout(2), [trace("first_last", [Comm("all_reduce", "dp", 8)]),
                                          trace("first_last", [Comm("all_reduce", "dp", 16)], tag="x")],
                       {1: RoleClass("first_last", tag="x")})
    with pytest.raises(ReplayError, match="dp collective 0: rank 1 issues all_reduce of 16 bytes but rank 0"):
        replay(mism, topo(), symmetry=False)
    size = slice_graph(lay, [trace("first", [Comm.send(8)]), trace("last", [Comm.recv(16)])])
    with pytest.raises(ReplayError, match="recv of 16 bytes matches a send of 8 bytes"):
        replay(size, topo())


def synthetic(world, tp, pp, mb=4, iterations=1):
    traces = one_f_one_b_traces(pp, mb, iterations, fwd_s=0.25, bwd_s=0.5, act_bytes=MB // 4,
                                grad_bytes=8 * MB, tp_bytes=MB // 8, optim_s=0.125, embd_bytes=MB)
    return slice_graph(ParallelLayout(world, tp=tp, pp=pp), traces)


@pytest.mark.parametrize("gpn, embd", [(3, MB), (16, 0)])
def test_symmetry_is_exact_on_an_uneven_topology(gpn, embd):
    # 3 GPUs per node: some tp/dp groups span nodes, others do not; 16: some pipeline
    # pairs share a node, others do not (no embd group, whose link would tell them
    # apart anyway). Plus one straggler.
    lay = ParallelLayout(24, tp=2, pp=2)
    traces = one_f_one_b_traces(2, 3, 2, fwd_s=0.25, bwd_s=0.5, act_bytes=MB // 4, grad_bytes=8 * MB,
                                tp_bytes=MB // 8, embd_bytes=embd)
    slow = Trace(0, RoleClass("first", 0, "slow"),
                 tuple(tuple(Compute(op.duration_s * 1.5) if isinstance(op, Compute) else op for op in it)
                       for it in traces[0].iterations))
    graph = slice_graph(lay, traces + [slow], {4: RoleClass("first", 0, "slow")})
    t = topo(gpn=gpn, alpha=A, bw=BW, inter_alpha=4 * A, inter_bw=BW / 4)
    fast, full = replay(graph, t), replay(graph, t, symmetry=False)
    assert 2 < fast.partition.n_nodes < 24
    for r in range(24):
        assert fast.timeline(r) == full.timeline(r)
    # The ranks do differ (the check above is not vacuous).
    assert len({tuple((t.start, t.end) for t in fast.timeline(r)) for r in range(24)}) > 2


def test_symmetry_matches_full_replay_at_1024():
    graph = synthetic(1024, tp=8, pp=8)
    t = load("h200-nvlink-ib")
    fast, full = replay(graph, t), replay(graph, t, symmetry=False)
    assert fast.partition.n_nodes == 8
    for r in range(1024):
        assert fast.iteration_times(r) == full.iteration_times(r)


def test_world_8192_same_class_same_time_and_fast():
    graph = synthetic(8192, tp=8, pp=8, mb=8, iterations=3)
    res = replay(graph, load("h200-nvlink-ib"))
    assert res.wall_s < 10.0  # ~0.1 s on an idle core; a loose budget for a shared machine
    by_class = {}
    for r in range(8192):
        by_class.setdefault(graph.class_of(r), set()).add(tuple(res.iteration_times(r)))
    assert len(by_class) == 8 and all(len(v) == 1 for v in by_class.values())
    for r in (0, 4095, 8191):
        b = res.breakdown(r)
        assert b["compute"] + b["comm"] + b["comm_wait"] + b["bubble"] == pytest.approx(b["total"], rel=1e-12)
        assert b["compute"] == pytest.approx(8 * 0.75 + 0.125)
    # Middle stages pay the pipeline bubble; the first waits on the last's embedding sync.
    assert res.breakdown(4095)["bubble"] > 0
    s = res.summary()
    assert s["distinct_timelines"] == 8 and len(s["iteration_time_s"]) == 3


# ---------------------------------------------------------------------- chrome trace
def test_chrome_trace_is_valid():
    res = two_stage()
    doc = json.loads(json.dumps(to_chrome_trace(res, ranks=[0, 1])))
    events = doc["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    n_ops = sum(len(res.timeline(r)) for r in (0, 1))
    n_waits = sum(t.wait > 0 for r in (0, 1) for t in res.timeline(r))
    assert len(xs) == n_ops + n_waits
    for e in xs:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "cat"} <= set(e)
        assert e["pid"] in (0, 1) and e["tid"] in (0, 1) and e["dur"] >= 0 and e["ts"] >= 0
    recv = next(e for e in xs if e["pid"] == 0 and e["name"] == "recv +1")
    assert (recv["ts"], recv["dur"], recv["tid"]) == (2e6, 3.25e6, 1)
    assert recv["args"]["wait_us"] == 2.625e6 and recv["args"]["peer_rank"] == 1
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert any(p == 1 and "pp1" in n and "last" in n for p, n in names)
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"compute", "comm"}
    default = to_chrome_trace(res)  # one rank per distinct timeline
    assert {e["pid"] for e in default["traceEvents"]} == {0, 1}
    with pytest.raises(ReplayError, match="out of range 0..1"):
        to_chrome_trace(res, ranks=[2])


def test_pure_modules_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; import pitstop.emulation.replay, pitstop.emulation.chrome_trace, "
            "pitstop.emulation.synthetic; print(sorted(m for m in sys.modules if m.startswith('torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
