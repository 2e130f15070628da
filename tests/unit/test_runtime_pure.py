"""Tier 1: the runtime's pure parts (config, fault specs, job token, reference swapping)."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import pytest
import torch.distributed as dist

from pitstop.errors import ConfigError
from pitstop.runtime.config import RuntimeConfig
from pitstop.runtime.faults import PHASES, Fault, parse_all
from pitstop.runtime.swap import find_groups, swap_groups


# ----------------------------------------------------------------------------- config
def test_config_round_trips_through_the_environment():
    cfg = RuntimeConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2, collective_timeout_s=30, buddy=False,
                        save_interval=5, save_dir="/x")
    assert RuntimeConfig.from_env(cfg.to_env()) == cfg


@pytest.mark.parametrize("kw, message", [
    ({"heartbeat_interval_s": 5.0, "heartbeat_timeout_s": 2.0}, "5.0 < 2.0 < 120.0"),
    ({"heartbeat_timeout_s": 200.0}, "0.5 < 200.0 < 120.0"),
    ({"collective_timeout_s": 0}, "collective_timeout_s=0: expected a number of seconds > 0"),
    ({"save_interval": -1}, "save_interval=-1: expected an integer >= 0 (0: never)"),
    ({"buddy": "yes"}, "buddy='yes': expected true or false, got str"),
    ({"heartbeat_interval_s": True}, "heartbeat_interval_s=True: expected a number of seconds > 0, got bool"),
    ({"commit_interval": 0}, "commit_interval=0: expected an integer >= 1 (1: vote at every step)"),
    ({"commit_interval": 2.0}, "commit_interval=2.0: expected an integer >= 1 (1: vote at every step), got float"),
])
def test_config_errors_name_the_values(kw, message):
    with pytest.raises(ConfigError) as e:
        RuntimeConfig(**kw)
    assert message in str(e.value)


def test_config_from_mapping_refuses_unknown_keys_by_name():
    with pytest.raises(ConfigError, match="unknown key\\(s\\) heartbeat_intervall_s"):
        RuntimeConfig.from_mapping({"heartbeat_intervall_s": 1.0})


def test_config_from_env_names_the_bad_variable():
    with pytest.raises(ConfigError, match="PITSTOP_SAVE_INTERVAL='two': expected an integer >= 0"):
        RuntimeConfig.from_env({"PITSTOP_SAVE_INTERVAL": "two"})


@pytest.mark.parametrize("k, save, last", [(1, 0, 10), (4, 0, 10), (4, 6, 10), (3, 0, 7), (5, 2, 23), (16, 0, 5)])
def test_the_vote_schedule_bounds_every_window_and_the_controller_covers_the_next_vote(k, save, last):
    """Every rank, a joiner starting after any vote, and the controller must agree on where the
    next vote is: a window never holds more than K steps, and discard_window reaches it."""
    cfg = RuntimeConfig(commit_interval=k, save_interval=save)
    votes = [s for s in range(1, last + 1) if cfg.votes_at(s, last)]
    assert votes[0] == 1 and votes[-1] == last  # the recorded first step and the last one
    assert all(b - a <= k for a, b in zip([0] + votes, votes))
    if save:
        assert all(s in votes for s in range(save, last + 1, save))  # a checkpoint holds committed state
    for c in [0] + votes[:-1]:  # after any commit, the controller's window holds the next vote
        nxt = next(v for v in votes if v > c)
        assert nxt in cfg.discard_window(c) and len(cfg.discard_window(c)) == k
    if k == 1:
        assert votes == list(range(1, last + 1))


def test_commit_interval_reaches_the_runtime_from_every_front_door():
    import argparse

    from pitstop.integrations.deepspeed_config import parse_section
    from pitstop.integrations.megatron import add_pitstop_args, runtime_config

    assert runtime_config(add_pitstop_args(argparse.ArgumentParser()).parse_args(
        ["--pitstop-commit-interval", "8"])).commit_interval == 8
    assert parse_section({"commit_interval": 3}).runtime_config().commit_interval == 3
    assert RuntimeConfig.from_env(RuntimeConfig(commit_interval=5).to_env()).commit_interval == 5


def test_megatron_flags_give_a_validated_config():
    import argparse

    from pitstop.integrations.megatron import add_pitstop_args, runtime_config

    p = add_pitstop_args(argparse.ArgumentParser())
    args = p.parse_args(["--pitstop-heartbeat-timeout", "3", "--pitstop-save-interval", "4", "--pitstop-no-buddy"])
    cfg = runtime_config(args)
    assert (cfg.heartbeat_timeout_s, cfg.save_interval, cfg.buddy) == (3.0, 4, False)
    with pytest.raises(ConfigError, match="0.5 < 500.0 < 120.0"):
        runtime_config(p.parse_args(["--pitstop-heartbeat-timeout", "500"]))


# ----------------------------------------------------------------------------- faults
def test_fault_fluent_form_round_trips():
    f = Fault.kill(rank=5).at(step=3, phase="backward")
    assert Fault.parse(f.spec()) == f == Fault(5, 3, "backward", "KILL")
    many = f + Fault.stop(rank=2).at(4, "optimizer") + Fault.kill(0).at(6, "param-gather")
    assert parse_all(many.spec()) == list(many)
    assert [x.sig for x in many] == ["KILL", "STOP", "KILL"]


@pytest.mark.parametrize("text, message", [
    ("rank=1,step=2,phase=sideways", "phase 'sideways' unknown"),
    ("step=2", "expected rank=R,step=S,phase=P"),
    ("rank=1,signal=HUP", "signal 'HUP' unknown"),
    ("rank=-1", "rank(-1) must be >= 0"),
])
def test_bad_fault_specs_are_refused(text, message):
    with pytest.raises(ConfigError) as e:
        Fault.parse(text)
    assert message in str(e.value)


def test_phases_are_in_step_order():
    assert PHASES == ("forward", "backward", "grad-reduce", "optimizer", "param-gather", "committed")


# ----------------------------------------------------------------------------- commit reports
def _snap_with(reports, step: int = 4):
    import torch

    from pitstop.runtime import state

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    return state.take(opt, step, reports=reports)


def test_commit_reports_travel_in_the_snapshot_and_come_back_equal():
    """What a joiner hands back is what the failed process was given, JSON floats exactly."""
    import torch

    from pitstop.runtime import reports as rep
    from pitstop.runtime import state

    loss = 4.876689910888672
    reports = [(3, {"loss": loss, "grad_norm": 1.5561331157376, "ok": True}), (4, {"loss": 0.1 + 0.2, "t": torch.arange(3)})]
    snap = _snap_with(rep.encode(reports))
    wire = state.Snapshot.from_wire(snap.meta_bytes(), snap.data)
    back = rep.of_snapshot(wire)
    assert [s for s, _ in back] == [3, 4]
    assert float.hex(back[0][1]["loss"]) == float.hex(loss) and back[1][1]["loss"] == 0.1 + 0.2
    assert back[1][1]["t"].tolist() == [0, 1, 2]
    # a diverged step's report (JSON has no NaN): carried, and it does not break the snapshot
    odd = rep.of_snapshot(state.Snapshot.from_wire(*(lambda s: (s.meta_bytes(), s.data))(
        _snap_with(rep.encode([(4, {"loss": float("nan"), "grad_norm": float("inf"), "m": -float("inf")})])))))
    assert math.isnan(odd[0][1]["loss"]) and odd[0][1]["grad_norm"] == float("inf") and odd[0][1]["m"] == -float("inf")
    assert rep.of_snapshot(_snap_with(None)) == []
    # the reports never reach the RNG streams
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert state.restore(opt, wire) == {}


def test_a_report_that_cannot_cross_the_wire_is_refused_by_type():
    from pitstop.errors import RecoveryError
    from pitstop.runtime import reports as rep

    with pytest.raises(RecoveryError, match="type object"):
        rep.encode([(1, {"loss": object()})])


@pytest.mark.parametrize("bad, message", [
    ("nope", "expected a list"),
    ([[1]], "expected \\[step, report\\]"),
    ([[-1, 0.5]], "expected \\[step, report\\]"),
    ([[5, 0.5]], "step 5: expected steps ascending and at most step 4"),
    ([[3, 0.5], [3, 0.6]], "step 3: expected steps ascending"),
    ([[3, {"$f": "1e999"}]], "non-finite float .* expected nan, inf or -inf"),
])
def test_forged_reports_are_refused_with_the_value(bad, message):
    from pitstop.errors import RecoveryError
    from pitstop.runtime import reports as rep

    with pytest.raises(RecoveryError, match=message):
        rep.of_snapshot(_snap_with(bad))


def test_a_checkpoints_reports_are_read_back_and_junk_is_refused(tmp_path):
    """The reports a --save-interval checkpoint keeps for a restart: read back equal, absent
    when none were written, and a file that does not parse or names another step refused."""
    from pitstop.errors import RecoveryError
    from pitstop.runtime import reports as rep

    rep.write(tmp_path, 4, 3, rep.encode([(3, {"loss": 1.25}), (4, {"loss": 0.1 + 0.2})]))
    assert rep.read(tmp_path, 4, 3) == [(3, {"loss": 1.25}), (4, {"loss": 0.1 + 0.2})]
    assert rep.read(tmp_path, 4, 2) is None and rep.read(tmp_path, 2, 3) is None
    assert not list(tmp_path.glob("**/*.tmp"))  # written whole, then renamed
    p = rep.path(tmp_path, 6, 0)
    p.parent.mkdir(exist_ok=True)
    p.write_text('{"step": 6, "reports": [[6, NaN]]}')
    with pytest.raises(RecoveryError, match="does not parse"):
        rep.read(tmp_path, 6, 0)
    p.write_text('{"step": 5, "reports": []}')
    with pytest.raises(RecoveryError, match="expected the reports of step 6"):
        rep.read(tmp_path, 6, 0)
    p.write_text('{"step": 6, "reports": [[7, 1.0]]}')
    with pytest.raises(RecoveryError, match="report for step 7"):
        rep.read(tmp_path, 6, 0)


# ----------------------------------------------------------------------------- token
def test_job_token_is_taken_out_of_the_environment(monkeypatch):
    from pitstop import protocol

    monkeypatch.setenv(protocol.ENV_TOKEN, "abc")
    assert protocol.take_token_from_env() == "abc"
    import os

    assert protocol.ENV_TOKEN not in os.environ  # the script's children do not inherit it
    assert protocol.take_token_from_env() == ""


# ----------------------------------------------------------------------------- swap
class G(dist.ProcessGroup):
    def __init__(self, name: str) -> None:
        super().__init__(0, 1)
        self.name_ = name

    @property
    def group_name(self) -> str:
        return self.name_


Pair = collections.namedtuple("Pair", "tp dp")


@dataclass(frozen=True)
class Frozen:
    group: object


class Holder:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_swap_replaces_every_reference_and_leaves_others():
    old_tp, old_dp, kept, new_tp, new_dp = G("tp0"), G("dp0"), G("pp0"), G("tp1"), G("dp1")
    inner = Holder(group=old_tp, pair=Pair(old_tp, kept), frozen=Frozen(old_dp))
    root = Holder(child=inner, groups=[old_dp, kept], by_kind={"tp": old_tp, "pp": kept},
                  tup=(old_dp, 3), cycle=None)
    root.cycle = root
    mapping = {id(old_tp): new_tp, id(old_dp): new_dp}
    n = swap_groups([root], mapping)
    assert n == 6
    assert inner.group is new_tp and inner.pair == Pair(new_tp, kept) and isinstance(inner.pair, Pair)
    assert inner.frozen.group is new_dp and root.groups == [new_dp, kept] and root.tup == (new_dp, 3)
    assert root.by_kind == {"tp": new_tp, "pp": kept}
    assert find_groups([root], mapping) == []
    assert len(find_groups([root], {id(kept): kept})) == 3


def test_a_standby_freezes_its_heap_once_warm():
    """A standby collects, then freezes everything it holds (``gc.freeze``): a full collection
    on the joiner's critical path (DeepSpeed's ZeRO-3 build calls one) scans only the role's
    new objects. Undone here, so the rest of the session's tests see a normal collector."""
    import gc

    from pitstop.runtime.worker import _freeze_heap

    before = gc.get_freeze_count()
    try:
        _freeze_heap()
        assert gc.get_freeze_count() > max(before, 1000)
    finally:
        gc.unfreeze()


# ----------------------------------------------------------------------------- logging
def test_the_library_configures_no_log_handler_unless_its_launcher_asked(monkeypatch):
    """``pitstop launch`` and ``pitstop emulate`` put ``PITSTOP_LOG`` in their workers'
    environment (``worker_env``); a process started without it gets no handler from pitstop,
    and a bad level is refused by name before anything starts."""
    import logging

    from pitstop.errors import PitstopError
    from pitstop.launch.local import worker_env
    from pitstop.runtime import worker

    lg = logging.getLogger("pitstop")
    saved = (list(lg.handlers), lg.level, lg.propagate)
    try:
        for h in list(lg.handlers):
            lg.removeHandler(h)
        monkeypatch.delenv(worker.ENV_LOG, raising=False)
        assert worker_env(0, 2, 0, "127.0.0.1", 1234)[worker.ENV_LOG] == "info"
        worker._setup_logging()
        assert lg.handlers == []
        monkeypatch.setenv(worker.ENV_LOG, "loud")
        with pytest.raises(PitstopError, match=r"PITSTOP_LOG='loud': expected one of debug, info, warning, error"):
            worker._setup_logging()
        assert lg.handlers == []
        monkeypatch.setenv(worker.ENV_LOG, "debug")
        worker._setup_logging()
        assert len(lg.handlers) == 1 and lg.level == logging.DEBUG and not lg.propagate
        assert worker_env(0, 2, 0, "127.0.0.1", 1234)[worker.ENV_LOG] == "debug"   # the launcher passes it on
    finally:
        for h in list(lg.handlers):
            lg.removeHandler(h)
        for h in saved[0]:
            lg.addHandler(h)
        lg.setLevel(saved[1])
        lg.propagate = saved[2]
