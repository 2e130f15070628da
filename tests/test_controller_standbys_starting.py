"""A failure while the job's standbys are still starting waits for them (bounded), instead of
ending the job: under load a standby process can take longer to start than the workers take to
reach the failing step (seen in CI: a DeepSpeed job lost rank 2 in step 2 with both standbys
still importing, and ended 'failed'). The decision is the pure ``starting_wait``, tested here on
every combination that matters; the end-to-end paths are the recovery tests."""

from __future__ import annotations

import pytest

from pitstop.launch.controller import Controller, starting_wait

LIMIT = Controller.STARTING_STANDBY_WAIT_S


@pytest.mark.parametrize("admitted, starting, needed, waited, expected", [
    (0, 2, 1, 0.0, "wait"),        # both still importing: wait for one
    (0, 1, 1, LIMIT - 1, "wait"),  # still inside the bound
    (1, 0, 1, 0.0, "no"),          # enough admitted: replace now
    (2, 5, 1, 0.0, "no"),
    (0, 1, 2, 0.0, "no"),          # 2 lost, 1 coming: waiting would not help
    (1, 1, 2, 0.0, "wait"),        # 1 admitted + 1 coming covers 2
    (0, 0, 1, 0.0, "no"),          # none coming (they died while starting)
    (0, 1, 1, LIMIT + 1, "waited"),  # bounded: past the limit the failure goes on without them
])
def test_starting_wait(admitted, starting, needed, waited, expected):
    assert starting_wait(admitted, starting, needed, waited, LIMIT) == expected
