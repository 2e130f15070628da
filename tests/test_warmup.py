"""Record, virtual backend and sandbox, in one process (tiers 1 and 2).

The end-to-end warmup (a real job records, standbys replay, a warmed standby takes
first, middle and last stage roles, bitwise) is in ``test_recovery.py``.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pitstop import pg as pgmod
from pitstop import virtual
from pitstop.record import (
    Record, Recorder, ReplayOracle, local_inputs, same_bits, recorder_class, representative, stage_class, stage_classes,
)
from pitstop.errors import RecordMismatchError
from pitstop.layout import ParallelLayout
from pitstop.runtime import sandbox
from pitstop.runtime.faults import Fault


# --------------------------------------------------------------------------- role classes
@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 4), (2, 2, 2), (1, 3, 2), (2, 4, 1), (1, 8, 2)])
def test_one_recorder_per_stage_kind(tp, pp, dp):
    layout = ParallelLayout(tp * pp * dp, tp=tp, pp=pp)
    recorders = {}
    for r in range(layout.world_size):
        cls = recorder_class(layout, r)
        if cls is not None:
            assert cls not in recorders, (cls, recorders)
            recorders[cls] = r
            assert stage_class(layout, r) == cls
            c = layout.coords(r)
            assert c["tp"] == c["dp"] == c["cp"] == 0
    assert sorted(recorders) == sorted(stage_classes(layout))
    assert recorders == {cls: representative(layout, cls) for cls in stage_classes(layout)}
    # every rank's class is recorded by somebody
    assert {stage_class(layout, r) for r in range(layout.world_size)} == set(recorders)


def test_stage_kinds_by_pipeline_size():
    assert stage_classes(ParallelLayout(4, tp=4)) == ["only"]
    assert stage_classes(ParallelLayout(4, pp=2)) == ["first", "last"]
    assert stage_classes(ParallelLayout(8, pp=8)) == ["first", "middle", "last"]
    layout = ParallelLayout(8, pp=4, tp=2)
    assert [stage_class(layout, r) for r in range(8)] == ["first"] * 2 + ["middle"] * 4 + ["last"] * 2


# --------------------------------------------------------------------------- record / replay
def _recorded(tmp_path) -> Record:
    """Record three operations through the recorder's tap, as guarded groups call it."""
    layout = ParallelLayout(4, tp=2, pp=2)
    rec = Recorder(layout, 0, "first")
    a = torch.tensor([1.0, 2.0])
    done = rec._tap("tp", "allreduce", ([a],))
    a.mul_(3)  # what the real all-reduce wrote
    done()
    assert rec._tap("pp", "send", ([torch.ones(2, 3)], 1, 0)) is None  # a send has no result (its payload is kept as local input)
    b = torch.zeros(4, dtype=torch.int64)
    done = rec._tap("tp", "_allgather_base", (b, torch.zeros(2, dtype=torch.int64)))
    b.copy_(torch.tensor([5, 6, 7, 8]))
    done()
    record = rec.record
    path = tmp_path / "first.pt"
    size = record.save(path)
    assert size == path.stat().st_size > record.nbytes == 2 * 4 + 4 * 8
    return Record.load(path)


class G:
    """A stand-in for the group argument (the oracle reads only its kind)."""

    def __init__(self, kind):
        self.kind = kind


def test_replay_serves_recorded_values_in_order(tmp_path):
    record = _recorded(tmp_path)
    assert record.count == 3 and record.role == 0 and record.cls == "first"
    oracle = ReplayOracle(record)
    x = torch.tensor([9.0, 9.0])
    oracle.serve(G("tp"), "allreduce", ([x],))
    assert x.tolist() == [3.0, 6.0]
    oracle.serve(G("pp"), "send", ([torch.zeros(2, 3)], 1, 0))
    y = torch.zeros(4, dtype=torch.int64)
    oracle.serve(G("tp"), "_allgather_base", (y, torch.zeros(2, dtype=torch.int64)))
    assert y.tolist() == [5, 6, 7, 8]
    assert oracle.served == 3 and oracle.unused() == {}


def test_replay_compares_what_the_sandbox_computed_itself_with_the_recorders_inputs(tmp_path):
    """A replayed result matches whatever was computed, so it is no evidence. The oracle
    compares each operation's *local* inputs (the all-reduce's tensor before reduction, the
    send's payload, the all-gather's input) with the recorder's, bit for bit, and names the
    first that differs."""
    same = ReplayOracle(_recorded(tmp_path))
    same.serve(G("tp"), "allreduce", ([torch.tensor([1.0, 2.0])],))
    same.serve(G("pp"), "send", ([torch.ones(2, 3)], 1, 0))
    same.serve(G("tp"), "_allgather_base", (torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)))
    assert (same.local_checked, same.local_equal, same.local_mismatch) == (3, 3, "")

    other = ReplayOracle(_recorded(tmp_path))
    x = torch.tensor([1.0, 2.0000002])          # one ulp-scale difference before the reduction
    other.serve(G("tp"), "allreduce", ([x],))
    assert x.tolist() == [3.0, 6.0]             # the result is the recorded one all the same
    other.serve(G("pp"), "send", ([torch.ones(2, 3)], 1, 0))
    other.serve(G("tp"), "_allgather_base", (torch.zeros(4, dtype=torch.int64), torch.ones(2, dtype=torch.int64)))
    assert (other.local_checked, other.local_equal) == (3, 1)
    assert other.local_mismatch.startswith("tp operation #1 (allreduce [[2]] ['float32']), input 0: 1 of 2 values differ")
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))   # bits, not values
    assert same_bits(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert local_inputs("recv", ([torch.zeros(2)], 0, 0)) is None and local_inputs("broadcast", ([torch.zeros(2)],)) is None


def test_replay_refuses_a_record_of_another_model(tmp_path):
    record = _recorded(tmp_path)
    oracle = ReplayOracle(record)
    with pytest.raises(RecordMismatchError, match=r"tp operation #1: .* allreduce \[\[2\]\] .* issues allreduce \[\[3\]\]"):
        oracle.serve(G("tp"), "allreduce", ([torch.zeros(3)],))
    with pytest.raises(RecordMismatchError, match=r"float32.*float64"):
        oracle.serve(G("tp"), "allreduce", ([torch.zeros(2, dtype=torch.float64)],))
    with pytest.raises(RecordMismatchError, match=r"dp operation #1 .* holds only 0 operation"):
        oracle.serve(G("dp"), "allreduce", ([torch.zeros(2)],))
    with pytest.raises(RecordMismatchError, match=r"has broadcast|has allreduce .* issues broadcast"):
        oracle.serve(G("tp"), "broadcast", ([torch.zeros(2)],))


# --------------------------------------------------------------------------- the backend and the sandbox
def _world_record(role: int, world: int, values) -> Record:
    rec = Record("only", role, "test", world)
    from pitstop.record import Entry

    rec.entries["world"] = [Entry("allreduce", [(2,)], ["float32"], [torch.tensor(values)]),
                            Entry("barrier", [], [])]
    rec.entries["tp"] = [Entry("allreduce", [(1,)], ["float32"], [torch.tensor([42.0])])]
    return rec


def _script():
    """What a script does in the sandbox: world ops, its own group, pitstop's group plumbing."""
    assert dist.get_rank() == 3 and dist.get_world_size() == 4
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.barrier()
    g = pgmod.new_comm([2, 3], virtual.VIRTUAL_BACKEND, dist.HashStore(), "pitstop:g0:tp:abc", timedelta(seconds=5),
                       "tp", pgmod.FENCE)
    assert isinstance(g, pgmod.GuardedGroup) and isinstance(g.inner, virtual.VirtualGroup) and g.kind == "tp"
    assert dist.get_rank(g) == 1 and dist.get_process_group_ranks(g) == [2, 3]
    u = torch.zeros(1)
    dist.all_reduce(u, group=g)
    pgmod.destroy(g)
    return {"world": t.tolist(), "tp": u.tolist()}


def test_sandboxed_run_is_served_from_the_record_and_leaves_nothing_behind():
    assert not dist.is_initialized()
    res = sandbox.run_sandboxed(_world_record(3, 4, [7.0, 8.0]), _script)
    assert res.ok, res.error
    assert res.out == {"world": [7.0, 8.0], "tp": [42.0]}
    assert res.ops == 3 and res.unused == {}
    assert not dist.is_initialized() and sandbox.active() is None


def test_a_mismatching_record_is_refused_not_raised():
    bad = _world_record(3, 4, [7.0, 8.0])
    bad.entries["world"][0].shapes = [(5,)]
    res = sandbox.run_sandboxed(bad, _script)
    assert not res.ok and "RecordMismatchError" in res.error and "world operation #1" in res.error, res.error
    assert not dist.is_initialized()


def test_virtual_groups_need_an_oracle():
    virtual.register()
    with pytest.raises(Exception, match="outside pitstop.virtual.serving"):
        dist.init_process_group(virtual.VIRTUAL_BACKEND, store=dist.HashStore(), rank=0, world_size=2)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_recorder_taps_guarded_groups_only_while_active():
    assert pgmod.TAP is None
    rec = Recorder(ParallelLayout(2, tp=2), 0, "only").start()
    try:
        with pytest.raises(RecordMismatchError, match="already active"):
            Recorder(ParallelLayout(2, tp=2), 0, "only").start()
        with sandbox.paused():
            assert pgmod.TAP is None
        assert pgmod.TAP is not None
    finally:
        rec.stop()
    assert pgmod.TAP is None


# --------------------------------------------------------------------------- fault specs
def test_fault_spec_refuses_an_unknown_key():
    f = Fault.kill(rank=2).at(step=3, phase="optimizer")
    assert Fault.parse(f.spec()) == f
    from pitstop.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown key.*sgnal"):
        Fault.parse("rank=1,sgnal=STOP")


def test_every_layout_class_pair_is_distinct():
    # a record is keyed by class; two classes of one layout never share a representative
    for pp in range(1, 6):
        layout = ParallelLayout(2 * pp, pp=pp, tp=2)
        reps = [representative(layout, c) for c in stage_classes(layout)]
        assert len(set(reps)) == len(reps)
        for a, b in itertools.combinations(reps, 2):
            assert layout.coords(a)["pp"] != layout.coords(b)["pp"]
