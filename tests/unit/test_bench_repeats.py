"""``pitstop bench recovery --repeat N``: which runs stand for the series (pure, no process)."""

from __future__ import annotations

import pytest

from pitstop.bench.recovery import _identical, _repeated, _with_repeats


class _Run:
    """The one thing ``_repeated`` reads of a run: its events of a kind."""

    def __init__(self, kind: str, downtime):
        self.kind, self.downtime = kind, downtime

    def of(self, kind: str):
        return [{"downtime_s": self.downtime}] if kind == self.kind and self.downtime is not None else []


def test_the_lower_median_runs_stand_for_the_series_and_the_order_interleaves():
    order = []
    base, ours = [10.0, 14.0, 9.0, 12.0], [0.5, 0.4, 0.9, 0.6]

    def restart(i):
        order.append(("restart", i))
        return _Run("restarted", base[i])

    def unplanned(i):
        order.append(("unplanned", i))
        return _Run("replaced", ours[i])

    rst, rep, runs, series = _repeated(4, restart, unplanned)
    assert order == [("restart", 0), ("unplanned", 0), ("restart", 1), ("unplanned", 1),
                     ("restart", 2), ("unplanned", 2), ("restart", 3), ("unplanned", 3)]
    assert rst.downtime == 10.0 and rep.downtime == 0.5  # lower medians: real runs, not averages
    assert series["ratio_pairs"] == [0.05, round(0.4 / 14.0, 4), 0.1, 0.05]
    assert [r.downtime for r in runs] == ours
    out = _with_repeats({"loss_identical": True}, series, every_identical=False)
    assert out["loss_identical"] is False  # one repeat that diverged spoils the series
    assert out["repeats"]["ratio_max"] == 0.1 and out["repeats"]["ratio_min"] == round(0.4 / 14.0, 4)


def test_a_run_without_its_event_is_the_one_reported_and_one_repeat_adds_nothing():
    rst, rep, _, series = _repeated(3, lambda i: _Run("restarted", 10.0 + i),
                                 lambda i: _Run("replaced", None if i == 1 else 0.5))
    assert rep.downtime is None and series["ratio_pairs"][1] is None
    single = _repeated(1, lambda i: _Run("restarted", 10.0), lambda i: _Run("replaced", 0.5))[3]
    assert "repeats" not in _with_repeats({"loss_identical": True}, single, every_identical=True)
    with pytest.raises(ValueError, match=r"repeat\(0\) must be >= 1"):
        _repeated(0, None, None)


class _Job:
    """What ``_identical`` reads of a finished job."""

    def __init__(self, events=(), code=0, losses=None):
        self.code, self.losses, self.checksums = code, losses or {1: "0x1.8p+1"}, {0: "abc"}
        self.events = list(events)

    def of(self, kind: str):
        return [{"kind": k} for k in self.events if k == kind]


def test_a_run_whose_replacement_never_happened_is_not_a_bitwise_replacement():
    ref = _Job()
    assert _identical(_Job(["replaced"]), ref, "replaced")
    assert not _identical(_Job([]), ref, "replaced")  # same losses, but nothing was replaced
    assert not _identical(_Job(["replaced"]), ref, "drained")
    assert not _identical(_Job(["replaced"], code=1), ref, "replaced")
    assert not _identical(_Job(["replaced"], losses={1: "0x1.9p+1"}), ref, "replaced")
    assert _identical(_Job([]), ref)  # the reference-like runs name no event
