"""Tier 3: real processes, real signals, real Megatron-Core, through ``pitstop launch``.

Every run is compared with one uninterrupted run of the same job: per-step loss and
every rank's final parameter checksum must be equal bit for bit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from pitstop.launch.controller import request_drain
from pitstop.runtime.faults import Fault
from pitstop.launch.runs import ROOT, run_job, wait_for_event, wait_for_step  # noqa: F401

STEPS = 10
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    res = run_job(tmp_path_factory.mktemp("reference"), STEPS)
    assert res.code == 0, res.tails()
    assert sorted(res.losses) == list(range(1, STEPS + 1)), res.tails()
    assert len(res.checksums) == 8, res.tails()
    return res


def assert_same_run(res, ref, first_step: int = 1, steps: int = STEPS) -> None:
    assert res.code == 0, res.tails()
    for step in range(first_step, steps + 1):
        assert res.losses.get(step) == ref.losses[step], f"step {step}: {res.losses.get(step)} != {ref.losses[step]}\n{res.tails()}"
    assert res.checksums == ref.checksums, res.tails()


def wait_for_controller(run_dir, timeout: float = 120) -> dict:
    import json
    import time

    path = run_dir / "controller.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no controller.json in {run_dir}"
        time.sleep(0.1)
    return json.loads(path.read_text())


def stray(run_dir) -> subprocess.CompletedProcess:
    """A process that knows the store's address but not the job token tries to join."""
    info = wait_for_controller(run_dir)
    env = dict(os.environ, PITSTOP_STORE=f"{info['host']}:{info['port']}", PITSTOP_CONTROLLER="1",
               PITSTOP_STANDBY="1", PITSTOP_JOB_TOKEN="not-the-token", WORLD_SIZE="8", RANK="-1")
    code = "from pitstop.runtime.worker import join; join()"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_unplanned_kill_is_bitwise_identical_and_a_stray_is_refused(reference, tmp_path):
    seen = {}

    def during(run_dir):
        seen["stray"] = stray(run_dir)

    fault = Fault.kill(rank=5).at(step=3, phase="backward")
    res = run_job(tmp_path / "run", STEPS, standby=1, faults=fault.spec(), during=during)
    assert_same_run(res, reference)
    rep = res.of("replaced")
    assert len(rep) == 1 and rep[0]["role"] == 5 and rep[0]["generation"] == 1, res.tails()
    # async_commit: rank 5's vote on step 2 leaves from a background thread while step 3 runs.
    # Killed in step 3's backward pass, it has usually sent it: step 3 is the first discarded, and
    # as the vote on step 3 is read at the boundary after step 4, both are redone. On a loaded
    # machine (a clean clone's CI) it had not yet, and step 2 was discarded too: 2, 3 and 4 are
    # redone. Both are exact (the run equals the reference either way); what must hold is that
    # the redone steps run from the first discarded one to step 4, where the fault was seen.
    assert rep[0]["step"] in (2, 3), rep
    assert rep[0]["steps_redone"] == 5 - rep[0]["step"], rep
    # only the delta rebuilt: 9 communicators touch role 5's groups; the others kept theirs
    assert rep[0]["rebuilt"] >= 1 and rep[0]["downtime_s"] > 0, rep
    # the stray got no role and the job went on
    s = seen["stray"]
    assert s.returncode != 0 and "AuthError" in s.stderr and "refused" in s.stderr, s.stderr[-2000:]
    assert len(res.of("refused")) == 1, res.tails()


def test_the_synchronous_commit_replaces_bitwise_like_the_asynchronous_one(reference, tmp_path):
    """--no-async-commit: every boundary waits for its own vote, as before async_commit. The same
    kill is redone from the same step, one step only, and the run equals the reference (made with
    the asynchronous commit) bit for bit: the two commits are checked against each other."""
    fault = Fault.kill(rank=5).at(step=3, phase="backward")
    res = run_job(tmp_path / "run", STEPS, standby=1, faults=fault.spec(), launch_args=["--no-async-commit"])
    assert_same_run(res, reference)
    rep = res.of("replaced")
    assert len(rep) == 1 and rep[0]["role"] == 5 and rep[0]["step"] == 3, res.tails()
    assert rep[0]["steps_redone"] == 1, rep
    # no pipeline thread: its CPU time is nil on every rank, and the boundary held the vote's wait
    assert all(st["background_cpu_s"] == 0.0 for st in res.stats), [st["background_cpu_s"] for st in res.stats]


def test_planned_drain_is_bitwise_identical(reference, tmp_path):
    """The drain is asked for while the standby runs its sandboxed warmup (right after the
    recorded step 1); training holds at most 30 s for the refilled pool to warm up, so the
    switch lands well before the last step even on a loaded machine."""
    def during(run_dir):
        wait_for_event(run_dir, "recorded", n=2)
        request_drain(run_dir, rank=2)

    res = run_job(tmp_path / "run", STEPS, standby=1, during=during, launch_args=["--hold-for-warm", "30"])
    assert_same_run(res, reference)
    d = res.of("drained")
    assert len(d) == 1 and d[0]["role"] == 2 and d[0]["generation"] == 1, res.tails()
    assert d[0]["pause_s"] is not None and d[0]["pause_s"] < 30, d


def _logged_steps(res) -> list:
    import json

    return [json.loads(line)["step"] for line in (res.run_dir / "loss.jsonl").read_text().splitlines()]


def test_a_kill_between_votes_discards_the_window_and_redoes_it_bitwise(reference, tmp_path):
    """--commit-interval 4: votes after steps 1, 4, 8 and 10. Rank 5 dies in step 6, between
    votes: every rank runs on to the vote after step 8 (the broken groups short-circuit), and,
    as that vote runs in the background (async_commit), through step 9 to the boundary that
    reads it. The whole window 5..8 and step 9 are discarded and redone, and no value of them
    was ever reported."""
    fault = Fault.kill(rank=5).at(step=6, phase="backward")
    res = run_job(tmp_path / "run", STEPS, standby=1, faults=fault.spec(), launch_args=["--commit-interval", "4"])
    assert_same_run(res, reference)
    rep = res.of("replaced")
    assert len(rep) == 1 and rep[0]["role"] == 5 and rep[0]["step"] == 5, res.tails()
    assert rep[0]["steps_redone"] == 5, rep  # 5, 6, 7 and 8, and 9, run while the vote on 8 was in flight
    # every step reported once, in order: the window's garbage (a peer's broken group feeds the
    # logging rank) was held and dropped, never printed
    assert _logged_steps(res) == list(range(1, STEPS + 1)), _logged_steps(res)


def test_a_drain_switches_at_a_vote_with_a_commit_interval(reference, tmp_path):
    """Role 4 logs the losses. The leaver hands over at the vote and leaves before its loop
    sees the window the vote made final: its joiner logs that window, each step once. An
    asynchronous vote (after step 4 or 8) is read a step late and says ``switch next``: every
    rank votes that next step at once and switches after it; the leaver's last snapshot carries
    both windows."""
    def during(run_dir):
        wait_for_event(run_dir, "recorded", n=2)
        request_drain(run_dir, rank=4)

    res = run_job(tmp_path / "run", STEPS, standby=1, during=during,
                  launch_args=["--hold-for-warm", "30", "--commit-interval", "4"])
    assert_same_run(res, reference)
    d = res.of("drained")
    assert len(d) == 1 and d[0]["role"] == 4, res.tails()
    # the joiner's first step follows a vote at once (step 1, the last) or the step after one
    assert d[0]["step"] - 1 in (1, 5, 9, 10), d
    assert _logged_steps(res) == list(range(1, STEPS + 1)), _logged_steps(res)


def test_a_rank_killed_after_its_step_is_final_has_its_joiner_log_it(reference, tmp_path):
    """Role 4 logs the losses and dies after the vote made step 4 final, before its loop got
    step 4's report back. The report travelled with its state to the buddy: the joiner hands
    step 4 back at its first commit, and every step is logged once. (A CI run lost step 4's
    line this way when a SIGKILL of a whole machine landed in that window.)"""
    fault = Fault.kill(rank=4).at(step=4, phase="committed")
    res = run_job(tmp_path / "run", STEPS, standby=1, faults=fault.spec())
    assert_same_run(res, reference)
    rep = res.of("replaced")
    assert len(rep) == 1 and rep[0]["role"] == 4 and rep[0]["step"] == 5, res.tails()
    assert _logged_steps(res) == list(range(1, STEPS + 1)), _logged_steps(res)
    logs = "".join(p.read_text(errors="replace") for p in res.run_dir.glob("logs/*/*/attempt_0/0/stderr.log"))
    assert logs.count("hands back step(s) [4] at its first commit") == 1, res.tails()


#: Megatron-LM's usual precision and regularisation: bf16 parameters (Float16Module) with fp32
#: main weights in the distributed optimizer, dropout 0.1 (the RNG tracker's streams matter).
BF16 = ["examples/train_gpt.py", "--tp", "2", "--pp", "2", "--checksum", "--bf16", "--dropout", "0.1"]


@pytest.fixture(scope="module")
def reference_bf16(tmp_path_factory):
    res = run_job(tmp_path_factory.mktemp("reference_bf16"), STEPS, gpt=BF16)
    assert res.code == 0 and sorted(res.losses) == list(range(1, STEPS + 1)), res.tails()
    # the mixed-precision path really ran: bf16 parameters, fp32 main weights
    assert {(tuple(s["dtypes"]["params"]), tuple(s["dtypes"]["main"])) for s in res.stats} == \
        {(("torch.bfloat16",), ("torch.float32",))}, res.stats
    return res


def test_bf16_with_dropout_a_kill_and_a_drain_stay_bitwise(reference_bf16, tmp_path):
    """The checksum covers the bf16 parameters, the fp32 main weights and every Adam moment;
    the dropout masks depend on the RNG tracker's states, which travel with the shard."""
    fault = Fault.kill(rank=5).at(step=3, phase="backward")
    res = run_job(tmp_path / "kill", STEPS, standby=1, faults=fault.spec(), gpt=BF16)
    assert_same_run(res, reference_bf16)
    assert [e["role"] for e in res.of("replaced")] == [5], res.tails()

    def during(run_dir):
        wait_for_event(run_dir, "recorded", n=2)
        request_drain(run_dir, rank=2)

    res = run_job(tmp_path / "drain", STEPS, standby=1, during=during, gpt=BF16, launch_args=["--hold-for-warm", "30"])
    assert_same_run(res, reference_bf16)
    assert [e["role"] for e in res.of("drained")] == [2], res.tails()


def test_fault_matrix_subset_with_a_hang(reference, tmp_path):
    """First PP stage in the optimizer step, a hung (SIGSTOP) last-stage rank, a TP rank
    in the parameter all-gather: three replacements in one job."""
    faults = (Fault.kill(rank=0).at(step=2, phase="optimizer")
              + Fault.stop(rank=7).at(step=4, phase="forward")
              + Fault.kill(rank=3).at(step=6, phase="param-gather"))
    res = run_job(tmp_path / "run", STEPS, standby=3, faults=faults.spec(),
                  launch_args=["--heartbeat-timeout", "8"])
    assert_same_run(res, reference)
    assert [e["role"] for e in res.of("replaced")] == [0, 7, 3], res.tails()
    assert [e["role"] for e in res.of("hung")] == [7], res.tails()


def test_no_standby_falls_back_to_the_checkpoint(reference, tmp_path):
    """No standby: an explicit, logged checkpoint restart from dist_checkpointing; never a hang."""
    fault = Fault.kill(rank=6).at(step=6, phase="grad-reduce")
    res = run_job(tmp_path / "run", STEPS, standby=0, faults=fault.spec(), launch_args=["--save-interval", "2"])
    fb = res.of("fallback")
    assert len(fb) == 1 and fb[0]["resume_step"] == 4, res.tails()
    assert len(res.of("restarted")) == 1, res.tails()
    # steps 5.. were run again after the restart; every committed loss equals the uninterrupted run
    assert_same_run(res, reference)


def test_a_restart_from_the_checkpoint_hands_back_the_step_its_logger_never_logged(reference, tmp_path):
    """No standby; role 4 (which logs) dies after the vote made step 4 final and after its
    checkpoint was saved, before its loop logged it. Every process restarts from that
    checkpoint, which kept each rank's reports of step 4: the restarted role 4 logs it, and
    every step is logged once."""
    fault = Fault.kill(rank=4).at(step=4, phase="committed")
    res = run_job(tmp_path / "run", STEPS, standby=0, faults=fault.spec(), launch_args=["--save-interval", "2"])
    fb = res.of("fallback")
    assert len(fb) == 1 and fb[0]["resume_step"] == 4, res.tails()
    assert_same_run(res, reference)
    assert _logged_steps(res) == list(range(1, STEPS + 1)), _logged_steps(res)


# --------------------------------------------------------------------------- warmed general standby
#: PP 3 at world 6 (tp1 dp2): first stage ranks 0-1, middle 2-3, last 4-5.
PP3 = ["examples/train_gpt.py", "--tp", "1", "--pp", "3", "--num-layers", "6", "--checksum"]
PP3_STEPS = 9


def _reference(tmp_path_factory, name: str, steps: int, nproc: int, gpt):
    """An uninterrupted run of another layout: every step logged, every rank's checksum."""
    res = run_job(tmp_path_factory.mktemp(name), steps, nproc=nproc, gpt=gpt, launch_args=["--no-warmup"])
    assert res.code == 0 and len(res.checksums) == nproc and len(res.losses) == steps, res.tails()
    return res


@pytest.fixture(scope="module")
def reference_pp3(tmp_path_factory):
    return _reference(tmp_path_factory, "reference_pp3", PP3_STEPS, 6, PP3)


def test_warmed_general_standbys_take_first_middle_and_last_stage_roles(reference_pp3, tmp_path):
    """Three standbys each replay a record of the first, middle and last stage; one of them is
    killed while it waits for the records (the pool is refilled, and the job holds until the new
    one is warm too). Then a first-stage rank dies in the optimizer step, the middle-stage recorder
    in the parameter all-gather and a last-stage rank in the backward pass: warmed standbys take
    all three roles and the run stays bitwise identical.

    The victim is killed as soon as the roster lists it, before step 1 can have written a record:
    killed after its own replay (which takes well under a second once the records exist), it may
    have reported warm first, the hold ends, and the steps 3, 5 and 7 come before its refill can
    warm (CI saw exactly that: the third replacement was cold)."""
    import json
    import signal

    faults = (Fault.kill(rank=1).at(step=3, phase="optimizer")
              + Fault.kill(rank=2).at(step=5, phase="param-gather")
              + Fault.kill(rank=5).at(step=7, phase="backward"))
    victim = {}

    def during(run_dir):
        path, deadline = run_dir / "roster.json", time.monotonic() + 300
        while not (path.exists() and json.loads(path.read_text() or "{}").get("standbys")):
            assert time.monotonic() < deadline, "no standby was listed in 300 s"
            time.sleep(0.05)
        victim["pid"] = json.loads(path.read_text())["standbys"][0]["pid"]
        os.kill(victim["pid"], signal.SIGKILL)  # before the records exist: it cannot have warmed

    res = run_job(tmp_path / "run", PP3_STEPS, standby=3, faults=faults.spec(), nproc=6, gpt=PP3,
                  launch_args=["--hold-for-warm", "600"], during=during, timeout=900)
    assert_same_run(res, reference_pp3, steps=PP3_STEPS)
    replaced = res.of("replaced")
    assert [e["role"] for e in replaced] == [1, 2, 5], res.tails()
    assert all(e["warm"] for e in replaced), [(e["role"], e["warm"]) for e in replaced]
    assert [e["pid"] for e in res.of("standby-lost")] == [victim["pid"]], res.tails()
    assert victim["pid"] not in [e["pid"] for e in res.of("warmed")], "the victim warmed before it was killed"
    assert {e["cls"] for e in res.of("recorded")} == {"first", "middle", "last"}

    # the sandbox computed the real step itself: every operation's own inputs (before the
    # replayed result overwrote anything) equal the recorder's, bit for bit; and it takes the
    # real step's control path: the grad norm (and, on the last stage, the loss) of each
    # sandboxed iteration are those of the real step 1, bit for bit
    step1 = json.loads((reference_pp3.run_dir / "loss.jsonl").read_text().splitlines()[0])
    warmed = [e for e in res.of("warmed") if e["ok"]]
    assert len(warmed) >= 3, res.tails()
    for e in warmed:
        assert [c["cls"] for c in e["classes"]] == ["first", "middle", "last"], e
        for c in e["classes"]:
            assert c["local_checked"] > 0 and c["local_equal"] == c["local_checked"], c
            assert c["local_mismatch"] == "", c
            assert c["out"]["grad_norm"] == step1["grad_norm"], (c, step1)
            assert c["out"]["update_successful"] is True
        assert float.hex(e["classes"][2]["out"]["loss"]) == step1["loss_hex"], (e["classes"][2], step1)
    # a warmed standby holds no more memory than a worker
    worker_rss = max(s["rss_bytes"] for s in res.stats)
    assert all(e["rss_bytes"] <= worker_rss for e in warmed), ([e["rss_bytes"] for e in warmed], worker_rss)


# --------------------------------------------------------------------------- an untrusted control store
def test_junk_on_every_control_key_is_refused_and_a_killed_rank_is_still_replaced(reference, tmp_path):
    """A process that knows the store's address but not the token writes random, truncated,
    oversized, wrong-type and replayed values onto every key of ``pitstop.runtime.keys``
    from the roster until the job ends. Nothing acts on them: each that is read is refused
    (logged), overwritten messages are written back, and the job, which loses rank 5 in
    the backward pass of step 4, is replaced and finishes bitwise identical."""
    import json
    import threading
    import time

    from pitstop.bench.control import fuzz_store
    from pitstop.launch.runs import wait_for_event

    counts = {}

    def during(run_dir):
        wait_for_event(run_dir, "roster")
        info = wait_for_controller(run_dir)
        stop = threading.Event()
        t = threading.Thread(target=lambda: counts.update(fuzz_store(info["host"], info["port"], 400, seed=7, stop=stop)))
        t.start()
        ev = run_dir / "events.jsonl"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:  # fuzz until the job is over
            kinds = {json.loads(l).get("event") for l in ev.read_text().splitlines() if l.strip()}
            if kinds & {"done", "failed"}:
                break
            time.sleep(0.5)
        stop.set()
        t.join()

    fault = Fault.kill(rank=5).at(step=4, phase="backward")
    res = run_job(tmp_path / "run", STEPS, standby=1, faults=fault.spec(), during=during,
                  launch_args=["--hold-for-warm", "30"])
    assert_same_run(res, reference)
    rep = res.of("replaced")
    assert len(rep) == 1 and rep[0]["role"] == 5 and rep[0]["step"] == 4, res.tails()
    assert counts.get("writes", 0) > 500 and counts.get("replays", 0) > 0, counts
    refused = res.of("refused")
    reasons = " ".join(e["reason"] for e in refused)
    for needle in ("unauthenticated", "bad MAC", "oversized"):
        assert needle in reasons, (needle, refused[:20])
    touched = {e["key"].split("/")[1] for e in refused}
    # every key got junk in each full sweep, and the controller reads these while the job runs
    assert counts["sweeps"] >= 1 and {"hb", "join", "apply"} <= touched, (touched, counts)


# --------------------------------------------------------------------------- correlated and overlapping failures
def _pids_of_roles(run_dir, roles):
    import json

    roster = json.loads((run_dir / "roster.json").read_text())
    return [roster["roles"][r]["pid"] for r in roles]


def test_two_ranks_killed_at_once_are_replaced_together(reference, tmp_path):
    """Ranks 4 and 5 (a tensor-parallel pair: one machine's two GPUs) are SIGKILLed at the same
    moment after step 3. One fault names both, the delta is the union of their groups (each
    built once), two standbys take both roles in one generation, and the run is bitwise."""
    import os
    import signal

    from pitstop.launch.runs import wait_for_event

    def during(run_dir):
        wait_for_event(run_dir, "warmed", n=2)
        wait_for_step(run_dir, 3)
        for pid in _pids_of_roles(run_dir, (4, 5)):
            os.kill(pid, signal.SIGKILL)

    res = run_job(tmp_path / "run", STEPS, standby=2, during=during, launch_args=["--hold-for-warm", "30"])
    assert_same_run(res, reference)
    rep = res.of("replaced")
    assert len(rep) == 1 and rep[0]["roles"] == [4, 5] and rep[0]["generation"] == 1, res.tails()
    f = res.of("failure")
    assert len(f) == 1 and f[0]["roles"] == [4, 5], res.tails()
    # one machine: the window closed once neither was dying, not after the whole settle_s
    assert f[0]["settled_s"] < f[0]["settle_s"], f
    assert not res.of("fallback"), res.tails()


def test_a_joiner_killed_during_its_recovery_falls_back_to_the_checkpoint(reference, tmp_path):
    """Rank 6 dies in the backward pass of step 5; while its replacement is under way the
    joiner is SIGKILLed too. The half-built generation is abandoned: every worker restarts
    from the last checkpoint (step 4), logged as an overlapping failure, and the run is
    bitwise identical; nothing hangs."""
    import os
    import signal

    from pitstop.launch.runs import wait_for_event

    def during(run_dir):
        wait_for_event(run_dir, "failure")  # roster.json already names the joiner of role 6
        os.kill(_pids_of_roles(run_dir, (6,))[0], signal.SIGKILL)

    fault = Fault.kill(rank=6).at(step=5, phase="backward")
    res = run_job(tmp_path / "run", STEPS, standby=2, faults=fault.spec(), during=during,
                  launch_args=["--save-interval", "2", "--no-warmup"])
    fb = res.of("fallback")
    assert len(fb) == 1 and "overlapping failure" in fb[0]["reason"] and fb[0]["resume_step"] == 4, res.tails()
    assert res.of("abandoned") and not res.of("replaced"), res.tails()
    assert_same_run(res, reference)


# --------------------------------------------------------------------------- machines, not processes
def _machines(tmp_path, during, launch_args=(), nnodes="4:5", faults=""):
    """World 8 (tp2 pp2 dp2) on four "machines" of two processes plus one standby machine: five
    real `pitstop launch` processes, each bound to its own loopback address (127.0.0.2-6)."""
    from pitstop.launch.runs import start_machines

    m = start_machines(tmp_path / "run", STEPS, nnodes, faults=faults,
                       launch_args=["--heartbeat-timeout", "10", "--hold-for-warm", "120", *launch_args])
    try:
        during(m)
    except BaseException:
        res = m.wait(5)
        print(res.tails())
        raise
    return m.wait(600)


def test_a_machine_failure_moves_its_roles_to_a_standby_machine(reference, tmp_path):
    """SIGKILL of machine 2's agent process group (127.0.0.4: roles 4 and 5, a tensor-parallel
    pair) after step 3. The kernel closes its agent's link to the controller, so the machine is
    lost at once (not after the heartbeat timeout, nor after a probe), and the standby machine (127.0.0.6) takes both roles at once in local-rank order;
    the run is bitwise identical to the uninterrupted single-host one."""
    from pitstop.launch.runs import machine_addr, wait_for_event

    def during(m):
        wait_for_event(m.run_dir, "warmed", n=2, timeout=400)
        wait_for_step(m.run_dir, 3, timeout=400)
        m.kill_machine(2)

    res = _machines(tmp_path, during)
    assert_same_run(res, reference)
    lost = res.of("machine-lost")
    assert len(lost) == 1 and lost[0]["node"] == 2 and lost[0]["roles"] == [4, 5], res.tails()
    # the agent's link closed with it (pitstop.launch.link): lost before any probe (0.5 s) or
    # silence (2 s after a reported failure, 10 s otherwise) could say so
    assert lost[0]["cause"] == "its agent's connection to the controller closed", lost
    assert lost[0]["silent_s"] < 2, lost
    rep = res.of("replaced")
    assert len(rep) == 1 and rep[0]["roles"] == [4, 5] and rep[0]["generation"] == 1, res.tails()
    new = rep[0]["new"]  # both on the standby machine, local rank order kept (lower pid started first)
    assert {v.split(":")[0] for v in new.values()} == {machine_addr(4)}, new
    assert int(new["4"].split(":")[1]) < int(new["5"].split(":")[1]), new


def test_a_host_drain_moves_a_machine_onto_the_standby_machine(reference, tmp_path):
    """`pitstop drain --host 127.0.0.5` (machine 3: roles 6 and 7) while training runs: both
    roles move to the standby machine in one two-phase move (the joiners and the delta build
    the next generation while training goes on; one switch at a boundary), training paused
    at most a steady iteration + 0.5 s, bitwise identical."""
    from pitstop.launch.controller import request_drain
    from pitstop.launch.runs import machine_addr, wait_for_event

    def during(m):  # asked for while training holds after the recorded step 1 for the standbys' warmup
        wait_for_event(m.run_dir, "recorded", n=2, timeout=400)
        request_drain(m.run_dir, host=machine_addr(3))

    res = _machines(tmp_path, during)
    assert_same_run(res, reference)
    d = res.of("drained")
    assert len(d) == 1 and d[0]["roles"] == [6, 7] and d[0]["generation"] == 1, res.tails()
    assert {v.split(":")[0] for v in d[0]["new"].values()} == {machine_addr(4)}, d
    assert d[0]["pause_s"] is not None and d[0]["steady_iter_s"] is not None, d
    assert d[0]["pause_s"] <= d[0]["steady_iter_s"] + 0.5, d


def test_two_ranks_on_two_machines_killed_at_once_are_replaced_together(reference, tmp_path):
    """Rank 1 (machine 0) and rank 6 (machine 3) are SIGKILLed at the same moment after step 3;
    their machines stay up. One fault names both; the standby machine's two processes take
    them in one generation; bitwise identical."""
    import os
    import signal

    from pitstop.launch.runs import machine_addr, wait_for_event

    def during(m):
        wait_for_event(m.run_dir, "warmed", n=2, timeout=400)
        wait_for_step(m.run_dir, 3, timeout=400)
        for pid in _pids_of_roles(m.run_dir, (1, 6)):
            os.kill(pid, signal.SIGKILL)

    res = _machines(tmp_path, during)
    assert_same_run(res, reference)
    assert not res.of("machine-lost") and not res.of("fallback"), res.tails()
    f = res.of("failure")
    assert len(f) == 1 and f[0]["roles"] == [1, 6], res.tails()
    rep = res.of("replaced")
    assert len(rep) == 1 and rep[0]["roles"] == [1, 6] and rep[0]["generation"] == 1, res.tails()
    assert {v.split(":")[0] for v in rep[0]["new"].values()} == {machine_addr(4)}, rep


def test_a_joiner_killed_during_a_machines_recovery_restarts_on_the_standby_machine(reference, tmp_path):
    """Machine 2 (roles 4, 5) is killed after step 3; while the standby machine takes over, one
    of its joiners is SIGKILLed too. The half-built generation is abandoned and every rank
    restarts from the checkpoint of step 2 (saved every 2 steps), machine 2's ranks on the
    standby machine, since machine 2 is gone. Bitwise identical; nothing hangs."""
    import os
    import signal

    from pitstop.launch.runs import machine_addr, wait_for_event

    def during(m):
        wait_for_event(m.run_dir, "warmed", n=2, timeout=400)
        wait_for_step(m.run_dir, 3, timeout=400)
        m.kill_machine(2)
        wait_for_event(m.run_dir, "failure", timeout=120)  # roster.json names the joiners now
        os.kill(_pids_of_roles(m.run_dir, (5,))[0], signal.SIGKILL)

    res = _machines(tmp_path, during, ["--save-interval", "2"])
    assert_same_run(res, reference)
    fb = res.of("fallback")
    assert len(fb) == 1 and "overlapping failure" in fb[0]["reason"] and fb[0]["resume_step"] in (2, 4), res.tails()
    assert res.of("abandoned") and not res.of("replaced"), res.tails()
    import json

    roster = json.loads((res.run_dir / "roster.json").read_text())
    hosts = {r: roster["roles"][r]["host"] for r in (4, 5)}
    assert set(hosts.values()) == {machine_addr(4)}, roster


def test_a_machine_lost_with_no_standby_machine_left_fails_clearly(tmp_path):
    """Four machines and no standby machine, checkpoints every 2 steps: machine 1 is killed.
    No standby can take its roles and no machine is left for a restart, so the job ends with
    a `failed` event that says so, exit code 1, and every process gone; nothing hangs."""
    from pitstop.launch.runs import wait_for_event

    def during(m):
        wait_for_step(m.run_dir, 3, timeout=400)
        m.kill_machine(1)

    res = _machines(tmp_path, during, ["--save-interval", "2", "--no-warmup", "--hold-for-warm", "0"], nnodes="4")
    assert res.code == 1, res.tails()
    failed = res.of("failed")
    assert len(failed) == 1 and "no standby machine is left" in failed[0]["reason"], res.tails()
    assert "[1]" in failed[0]["reason"] and "3 of 4 alive" in failed[0]["reason"], failed



def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie that nobody reaped yet (an orphan in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_controllers_death_stops_every_process_cleanly(tmp_path):
    """The embedded store lives in the controller: SIGKILL it after step 2 of a world-4 job
    with a standby. Every worker and the standby see the store gone, log one clear line, and
    exit with status 3 within seconds, without a traceback; nothing hangs."""
    import json
    import signal
    import time

    pids = {}

    def during(run_dir):
        wait_for_step(run_dir, 2)
        roster = json.loads((run_dir / "roster.json").read_text())
        pids.update({f"r{r}": p["pid"] for r, p in enumerate(roster["roles"])})
        pids.update({f"sb{i}": p["pid"] for i, p in enumerate(roster["standbys"])})
        os.kill(wait_for_controller(run_dir)["pid"], signal.SIGKILL)
        pids["t_kill"] = time.monotonic()

    res = run_job(tmp_path / "run", 200, standby=1, nproc=4, during=during, timeout=120,
                  gpt=["examples/train_gpt.py", "--tp", "2", "--checksum"], launch_args=["--no-warmup"])
    assert res.code == -signal.SIGKILL
    t_kill = pids.pop("t_kill")
    assert len(pids) == 5, pids
    deadline = t_kill + 60
    while not all(_gone(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {k: p for k, p in pids.items() if not _gone(p)}
    assert not left, f"still running 60 s after the controller's death: {left}"
    logs = sorted((res.run_dir / "logs").glob("*/*/attempt_0/0/stderr.log"))
    assert len(logs) == 5, logs
    for path in logs:
        text = path.read_text(errors="replace")
        assert "the control store" in text and "is gone" in text and "exit 3" in text, f"{path}:\n{text[-3000:]}"
        assert "Traceback" not in text, f"{path}:\n{text[-3000:]}"


# --------------------------------------------------------------------------- no peer holds the state
def test_no_buddy_with_a_standby_falls_back_to_the_checkpoint_and_says_why(reference, tmp_path):
    """`--no-buddy`: no peer keeps a copy of a rank's state, so a standby cannot be given it.
    A SIGKILL is an explicit checkpoint restart whose event says why; the standby stays
    unused; bitwise."""
    fault = Fault.kill(rank=6).at(step=6, phase="grad-reduce")
    res = run_job(tmp_path / "run", STEPS, standby=1, faults=fault.spec(),
                  launch_args=["--save-interval", "2", "--no-buddy", "--no-warmup"])
    fb = res.of("fallback")
    assert len(fb) == 1 and fb[0]["resume_step"] == 4 and "--no-buddy" in fb[0]["reason"], res.tails()
    assert not res.of("replaced"), res.tails()
    assert_same_run(res, reference)


#: world 4, tp2 pp2: dp = 1, no data-parallel peer holds any rank's optimizer state
DP1 = ["examples/train_gpt.py", "--tp", "2", "--pp", "2", "--checksum"]


@pytest.fixture(scope="module")
def reference_dp1(tmp_path_factory):
    return _reference(tmp_path_factory, "reference_dp1", STEPS, 4, DP1)


def test_dp1_failure_falls_back_to_the_checkpoint_and_says_why(reference_dp1, tmp_path):
    """dp = 1: a killed rank's state exists nowhere else, so the standby is not used; the job
    restarts from the checkpoint with a `fallback` event naming the missing peer; bitwise."""
    fault = Fault.kill(rank=1).at(step=5, phase="backward")
    res = run_job(tmp_path / "run", STEPS, nproc=4, gpt=DP1, standby=1, faults=fault.spec(),
                  launch_args=["--save-interval", "2", "--no-warmup"])
    fb = res.of("fallback")
    assert len(fb) == 1 and fb[0]["resume_step"] == 4, res.tails()
    assert "role 1: no data-parallel peer holds its shard" in fb[0]["reason"], fb
    assert not res.of("replaced"), res.tails()
    assert_same_run(res, reference_dp1)


def test_dp1_drain_takes_the_state_from_the_leaver(reference_dp1, tmp_path):
    """dp = 1 has no peer copy, but a drain needs none: the leaver hands its own state over."""
    def during(run_dir):  # asked for while training holds after step 1 for the standby's warmup
        wait_for_event(run_dir, "recorded", n=2)
        request_drain(run_dir, rank=3)

    res = run_job(tmp_path / "run", STEPS, nproc=4, gpt=DP1, standby=1, during=during,
                  launch_args=["--hold-for-warm", "60"])
    assert_same_run(res, reference_dp1)
    d = res.of("drained")
    assert len(d) == 1 and d[0]["role"] == 3 and d[0]["generation"] == 1, res.tails()
