"""A failure while the job's standbys are still starting waits for them (bounded), instead of
ending the job: under load a standby process can take longer to start than the workers take to
reach the failing step (seen in CI: a DeepSpeed job lost rank 2 in step 2 with both standbys
still importing, and ended 'failed'). The decision is the controller's
``_standbys_starting``, tested here on its inputs; the end-to-end paths are the recovery tests."""

from __future__ import annotations

import time
from types import SimpleNamespace

from pitstop.launch.controller import Controller


class _Events(list):
    def write(self, kind, **fields):
        self.append(dict(fields, event=kind))


def _ctl(pool, starting, dead=0, lost_for=0.0):
    expected = {}
    for i in range(starting):
        expected[100 + i] = {"standby": True, "proc": SimpleNamespace(running=True)}
    for i in range(dead):
        expected[200 + i] = {"standby": True, "proc": SimpleNamespace(running=False)}
    expected[300] = {"standby": False, "proc": SimpleNamespace(running=True)}  # a worker: never counted
    return SimpleNamespace(pool=list(range(pool)), expected=expected, lost={2: None}, lost_waiting=False,
                           lost_at=time.monotonic() - lost_for, events=_Events(),
                           STARTING_STANDBY_WAIT_S=Controller.STARTING_STANDBY_WAIT_S)


def test_a_failure_waits_for_standbys_still_starting_and_says_so_once():
    c = _ctl(pool=0, starting=2)
    assert Controller._standbys_starting(c, 1) is True
    assert Controller._standbys_starting(c, 1) is True
    assert [e["event"] for e in c.events] == ["failure-waiting"]
    assert c.events[0]["starting"] == 2 and c.events[0]["standbys"] == 0


def test_no_wait_when_enough_are_admitted_or_too_few_are_coming():
    assert Controller._standbys_starting(_ctl(pool=1, starting=0), 1) is False
    assert Controller._standbys_starting(_ctl(pool=0, starting=1), 2) is False   # 2 lost, 1 coming
    assert Controller._standbys_starting(_ctl(pool=0, starting=0, dead=2), 1) is False  # died while starting


def test_the_wait_is_bounded():
    c = _ctl(pool=0, starting=1, lost_for=Controller.STARTING_STANDBY_WAIT_S + 1)
    assert Controller._standbys_starting(c, 1) is False
    assert [e["event"] for e in c.events] == ["failure-waited"] and "not admitted within" in c.events[0]["reason"]
