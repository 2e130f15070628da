"""The arithmetic of a finished change's event (:func:`pitstop.launch.changes.change_event`),
on hand-made reports: every figure the recovery benchmarks quote comes from here."""

from __future__ import annotations

import pytest

from pitstop.launch.changes import change_event

T0 = 1000.0


def _unplanned(**over):
    ch = {"kind": "unplanned", "role": 2, "roles": [2], "generation": 1, "step": 4, "old": "h:1", "new": "h:9",
          "fired": T0, "detected": T0 + 0.03, "planned": T0 + 0.045, "reason": "role 2: signal SIGKILL", "warm": True}
    ch.update(over)
    return ch


TIMINGS = {
    "r0": {"groups_s": 0.08, "state_s": 0.05, "ready": T0 + 0.25, "rebuilt": 3, "swapped": 40, "stale": 0},
    "r1": {"groups_s": 0.09, "state_s": 0.07, "ready": T0 + 0.26, "rebuilt": 3, "swapped": 40, "stale": 1},
    "r3": {"groups_s": 0.0, "state_s": 0.02, "ready": T0 + 0.20, "rebuilt": 0, "swapped": 0, "stale": 0},
    "joiner": {"built_s": 0.07, "attach_wait_s": 0.01, "state_s": 0.11, "ready": T0 + 0.27},
}
ITERS = {0: {"steady_iter_s": 0.15}, 1: {"steady_iter_s": 0.17}, 3: {"steady_iter_s": 0.16},
         2: {"first_iter_s": 0.19, "steady_iter_s": None}}


def test_a_replacement_event_adds_up_from_the_reports():
    name, ev = change_event(_unplanned(), TIMINGS, ITERS, t_commit=T0 + 0.45, committed_step=4)
    assert name == "replaced"
    assert ev["downtime_s"] == pytest.approx(0.45) and ev["first_step_s"] == pytest.approx(0.18)  # 0.45 - 0.27
    assert ev["detect_s"] == pytest.approx(0.03) and ev["plan_s"] == pytest.approx(0.015)
    assert ev["groups_s"] == 0.09 and ev["state_s"] == 0.11  # the slowest stayer; the joiner's state counts too
    assert ev["steps_redone"] == 1 and ev["rebuilt"] == 3 and ev["ranks_rebuilding"] == 2
    assert ev["swapped"] == 80 and ev["stale_refs"] == 1
    assert ev["joiner_built_s"] == 0.07 and ev["joiner_attach_wait_s"] == 0.01
    assert ev["first_iter_s"] == 0.19 and ev["steady_iter_s"] == 0.16 and ev["warm"] is True  # median of 3 stayers


def test_no_stamp_from_the_fault_injector_counts_from_the_detection():
    _, ev = change_event(_unplanned(fired=None), TIMINGS, {}, t_commit=T0 + 0.45, committed_step=6)
    assert ev["detect_s"] is None and ev["downtime_s"] == pytest.approx(0.42)
    assert ev["steps_redone"] == 3  # a window of three steps (commit_interval 3) redone
    assert "first_iter_s" not in ev  # no iteration reports, no comparison


def test_a_job_that_ended_before_a_commit_has_no_times_after_the_change():
    _, ev = change_event(_unplanned(), TIMINGS, ITERS, t_commit=None, committed_step=None)
    assert ev["downtime_s"] is None and ev["first_step_s"] is None and ev["steps_redone"] is None


def test_a_drain_and_a_restart_event():
    ch = {"kind": "planned", "role": 1, "roles": [1], "generation": 2, "step": 7, "requested": T0, "ready_at": T0 + 0.3}
    timings = {"r0": {"switch_s": 0.04, "ready": T0 + 0.5}, "joiner": {"pause_s": 0.05, "recv_s": 0.01, "ready": T0 + 0.52}}
    name, ev = change_event(ch, timings, {}, t_commit=T0 + 0.7, committed_step=7)
    assert name == "drained"
    assert ev["prepare_s"] == pytest.approx(0.3) and ev["pause_s"] == 0.05 and ev["groups_s"] == 0.04
    assert ev["state_s"] == 0.01 and ev["first_step_s"] == pytest.approx(0.18)
    ch = {"kind": "restart", "generation": 3, "step": 5, "fired": None, "detected": T0, "reason": "no standby left"}
    name, ev = change_event(ch, {}, {}, t_commit=T0 + 12.5, committed_step=5)
    assert name == "restarted" and ev["downtime_s"] == pytest.approx(12.5) and ev["reason"] == "no standby left"
