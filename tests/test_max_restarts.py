"""Tier 3: a cause that repeats ends the job instead of restarting it forever.

The GPT example, given a dataset cache path under a file (so no directory can be made
there), joins the job and then fails to build its dataset before the first step, on every
attempt.
The real controller restarts it from scratch ``--max-restarts`` times, then ends the job
with exit 1 and a ``failed`` event that says why (torchrun's flag, and its behaviour at the
limit). Seen before the limit existed: such a job restarted until it was killed.
"""

import pytest

from pitstop.launch.runs import ROOT, run_job


@pytest.mark.timeout(240)
def test_a_script_that_always_fails_is_restarted_max_restarts_times_then_given_up(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    script = [str(ROOT / "examples" / "train_gpt.py"), "--tp", "1", "--pp", "2", "--data-cache-path", str(blocker / "cache")]
    res = run_job(tmp_path / "run", 4, nproc=2, gpt=script, launch_args=["--max-restarts", "2"], timeout=200)
    assert res.code == 1, res.tails()
    assert len(res.of("restart")) == 2, res.tails()
    failed = res.of("failed")
    assert len(failed) == 1 and "not restarted: 2 restart(s) already (--max-restarts 2)" in failed[0]["reason"], failed
