"""Chakra execution traces of the target-scale graph (``pitstop emulate --chakra``).

Tier 1: a synthetic 1F1B job of 32 ranks (tp8 pp4) is replayed and exported; every rank's
file is read back the way Chakra's own reader frames it and checked against the graph and
across files: every send has its recv (same tag, same size) on the peer, the members of a
communicator issue the same collectives in the same order, and the tensor-parallel groups
are megatron-core's own (``RankGenerator``). Tier 2: ``pitstop emulate --chakra`` on a real
world-2 job writes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from pitstop.emulation import chakra
from pitstop.emulation.graph import Compute, slice_graph
from pitstop.emulation.replay import replay
from pitstop.emulation.synthetic import one_f_one_b_traces
from pitstop.emulation.topology import load
from pitstop.errors import EmulationError
from pitstop.layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[1]


def _attrs(node) -> dict:
    return {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    traces = one_f_one_b_traces(4, 4, iterations=2, fwd_s=0.01, bwd_s=0.02, act_bytes=1 << 20, grad_bytes=8 << 20,
                                tp_bytes=1 << 16, optim_s=0.005, embd_bytes=4096)
    layout = ParallelLayout(32, tp=8, pp=4)
    result = replay(slice_graph(layout, traces), load("h200-nvlink-ib"))
    d = tmp_path_factory.mktemp("chakra")
    summary = chakra.export(result, d / "et")
    files = {r: chakra.read(d / f"et.{r}.et") for r in range(32)}
    groups = json.loads((d / "et.comm_groups.json").read_text())
    return layout, result, summary, files, groups


def test_every_rank_has_its_program_node_for_op(exported):
    layout, result, summary, files, _ = exported
    assert summary["ranks"] == 32 and summary["nodes"] == sum(len(n) for _, n in files.values())
    for r, (meta, nodes) in files.items():
        assert meta.version == chakra.SCHEMA_VERSION
        meta_attrs = _attrs(meta)
        assert meta_attrs["world_size"] == 32 and meta_attrs["topology"] == "h200-nvlink-ib"
        timeline = result.timeline(r)
        assert len(nodes) == len(timeline)
        for i, (n, t) in enumerate(zip(nodes, timeline)):
            assert n.id == i and list(n.data_deps) == ([] if i == 0 else [i - 1])
            assert n.start_time_micros == round(t.start * 1e6)
            if isinstance(t.op, Compute):
                assert n.type == chakra.COMP_NODE and n.duration_micros == round(t.op.duration_s * 1e6)
            else:
                a = _attrs(n)
                assert a["comm_size"] == t.op.nbytes
                want = {"send": chakra.COMM_SEND_NODE, "recv": chakra.COMM_RECV_NODE}.get(t.op.op, chakra.COMM_COLL_NODE)
                assert n.type == want
                if want == chakra.COMM_COLL_NODE:
                    assert a["comm_type"] == chakra.COMM_TYPE[t.op.op]


def test_sends_meet_their_recvs_and_group_members_agree(exported):
    layout, _, _, files, groups = exported
    sends, recvs = defaultdict(list), defaultdict(list)
    per_group = defaultdict(dict)
    for r, (_, nodes) in files.items():
        for n in nodes:
            a = _attrs(n)
            if n.type == chakra.COMM_SEND_NODE:
                sends[(r, a["comm_dst"])].append((a["comm_tag"], a["comm_size"]))
            elif n.type == chakra.COMM_RECV_NODE:
                recvs[(a["comm_src"], r)].append((a["comm_tag"], a["comm_size"]))
            elif n.type == chakra.COMM_COLL_NODE:
                pg = a["pg_name"]
                assert r in groups[pg], (r, pg, groups[pg])
                per_group[pg].setdefault(r, []).append((a["comm_type"], a["comm_size"]))
    assert sends and set(sends) == set(recvs)
    for ch, s in sends.items():
        assert s == recvs[ch] and [t for t, _ in s] == list(range(len(s))), ch
    for pg, by_rank in per_group.items():
        assert set(by_rank) == set(groups[pg]), pg  # every member took part
        assert len({tuple(v) for v in by_rank.values()}) == 1, pg  # in the same order, the same sizes
    # the groups of the tensor-parallel all-reduces are megatron-core's own
    from megatron.core import parallel_state as ps

    gen = ps.RankGenerator(tp=8, ep=1, dp=1, pp=4, cp=1, order="tp-cp-ep-dp-pp")
    tp_sized = {pg for pg, v in per_group.items() if (0, 1 << 16) in next(iter(v.values()))}
    assert {tuple(groups[pg]) for pg in tp_sized} == {tuple(g) for g in gen.get_ranks("tp")}


def test_a_truncated_file_and_a_bad_rank_are_named(exported, tmp_path):
    _, result, _, _, _ = exported
    good = Path(exported[2]["prefix"] + ".3.et").read_bytes()
    bad = tmp_path / "x.et"
    bad.write_bytes(good[:-5])
    with pytest.raises(EmulationError, match="runs past the end"):
        chakra.read(bad)
    with pytest.raises(EmulationError, match=r"rank\(s\) \[32\] outside the world 0..31"):
        chakra.export(result, tmp_path / "et", [0, 32])


@pytest.mark.timeout(300)
def test_emulate_writes_chakra_traces_of_a_real_job(tmp_path):
    out = tmp_path / "em"
    res = subprocess.run([sys.executable, "-m", "pitstop.cli", "emulate", "--world-size", "2", "--tp", "2",
                          "--real-ranks", "0", "--out", str(out), "--no-memory", "--chakra", "--",
                          "examples/train_gpt.py", "--tp", "2", "--steps", "3"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["chakra"]["ranks"] == 2 and "chakra: 2 rank file(s)" in res.stdout
    (_, n0), (_, n1) = chakra.read(out / "chakra" / "et.0.et"), chakra.read(out / "chakra" / "et.1.et")
    colls = [[(_attrs(n)["comm_type"], _attrs(n)["comm_size"]) for n in ns if n.type == chakra.COMM_COLL_NODE]
             for ns in (n0, n1)]
    assert colls[0] and colls[0] == colls[1]  # both ranks of the TP pair issue the same collectives
    assert any(n.type == chakra.COMP_NODE and n.duration_micros > 0 for n in n0)
