"""The real control plane with simulated ranks (pitstop.bench.scale): a job of 64 ranks on 8
machines, plus 2 standby machines and one standby process, loses a simulated rank, a real
machine (SIGKILL of its process group) and a frozen one (SIGSTOP), and every stayer hears of
each replacement. The store operations are counted on every client, so a change that makes a
machine's agent or the step boundary cost more per machine fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pitstop.bench import scale


def _tails(run_dir: Path) -> str:
    out = []
    for f in sorted(run_dir.glob("*.log")):
        out.append(f"----- {f.name}")
        out.extend(f.read_text(errors="replace").splitlines()[-15:])
    return "\n".join(out)


@pytest.mark.timeout(420)
def test_64_simulated_ranks_lose_a_rank_a_machine_and_a_frozen_machine(tmp_path):
    # pitstop's default heartbeat timeout (5 s): many simulated ranks share a process's GIL on 2 cores
    row = scale.Row("tcpstore", 64, tmp_path, window_s=4.0).run()
    assert "error" not in row, f"{row}\n{_tails(tmp_path / 'tcpstore-64')}"
    assert row["errors_seen"] == [], row["errors_seen"]
    # every stayer was told of each change, and each change committed a step after it
    assert row["control_path_told"] >= 63 and row["control_path_killed_told"] >= 56
    assert row["control_path_frozen_told"] >= 56
    for k in ("downtime_s", "downtime_killed_s", "downtime_frozen_s"):
        assert row[k] is not None and row[k] > 0, (k, row[k])
    # each control path runs from the controller's detection to the later of every stayer told and
    # the roster published (never less than the controller's own part)
    for k in ("control_path_s", "control_path_killed_s", "control_path_frozen_s"):
        assert row[k] >= row[k.replace("_s", "_roster_s")] > 0, (k, row[k], row[k.replace("_s", "_roster_s")])
    # the killed machine's link closed; the frozen one's fell silent (no socket closes)
    assert "connection to the controller closed" in row["cause_machine"], row["cause_machine"]
    assert "silent" in row["cause_frozen"], row["cause_frozen"]
    assert row["detect_frozen_s"] >= row["heartbeat_timeout_s"] * 0.9, row["detect_frozen_s"]
    # counted on every client: the step costs each machine an add and a wait for the slot (plus
    # the job's last arrival settling it), not 3 operations per rank (24 per machine)
    assert row["steps_in_window"] >= 3
    assert row["per_machine"]["store_ops_per_step"] <= 3.0, row["per_machine"]
    # nothing beats in the store: ranks beat to their agent, agents on their link (before: 875 a
    # second per machine at this size, benchmarks/scale-baseline.json's harness)
    per = row["ops_by_purpose_per_s"]
    assert per["heartbeat"] <= 0.5 * 64, per
    assert per["agent"] / (row["machines"] + row["spare_machines"]) <= 2.0, per
    assert row["per_machine"]["store_ops_per_s"] <= 12.0, row
    # the end of each generation reaches a machine through one wait of its agent (and a standby's
    # wait for its assignment): 55 waits in the whole run, where one per rank and generation
    # was over 190
    assert row["watch_waits_total"] <= 8 * (row["machines"] + row["spare_machines"]), row["ops_total_by_purpose"]
    json.dumps(row)  # the bench prints it


def test_growth_fits_the_exponent():
    rows = [{"ranks": n, "x": 3.0 * n ** 0.5} for n in (64, 256, 1024)]
    assert scale.growth(rows, "x") == pytest.approx(0.5, abs=1e-3)
    assert scale.growth(rows[:1], "x") is None
    assert scale.growth([{"ranks": 64, "x": 1.0, "error": "e"}, *rows[1:2]], "x") is None


def test_a_row_past_this_hosts_limits_is_refused_by_name_before_it_starts(tmp_path):
    """Each simulated rank is 2 threads and each machine 8 (every thread takes a pid), and the
    controller's process holds 1 store connection per rank and 5 per machine: 16,384 ranks
    pass 90% of a pid_max of 32,768 and a descriptor limit of 20,000 (this machine's), 8,192
    pass neither."""
    big, fits = scale.Row("tcpstore", 16384, tmp_path), scale.Row("tcpstore", 8192, tmp_path)
    assert big.threads_needed() == 16384 * 2 + 2050 * 8 and big.fds_needed() == 16384 + 2050 * 5 + 200
    why = big.refusal(32768, None)
    assert "ranks(16384)" in why and "kernel.pid_max(32768)" in why and str(big.threads_needed()) in why
    why = big.refusal(4194304, 20000)
    assert "RLIMIT_NOFILE(20000)" in why and str(big.fds_needed()) in why
    assert big.refusal(4194304, 1 << 20) is None
    assert fits.refusal(32768, 20000) is None
    assert not (tmp_path / "tcpstore-16384").exists()


@pytest.mark.timeout(600)
def test_a_simulated_world_8_costs_the_store_what_a_real_world_8_job_does(tmp_path):
    """A real GPT job (tp2 pp2 dp2 on 4 machines, 2 standby machines, 1 standby process), every
    TCPStore client of every process counted from outside pitstop's code, beside the bench's
    simulated world 8 of the same shape and step time: per step, the machines' agents (the
    vote: an add and a wait per machine) and the ranks' own threads send what the real ones do."""
    got = scale.real_world8(tmp_path, steps=50, window_steps=20)
    real, sim = got["real"], got["simulated"]
    assert real["processes_counted"] == {"controller": 1, "agent": 6, "worker": 13}, real
    assert sim.get("error") is None, sim
    # the vote is batched per machine on both sides: about one add per machine and step
    assert 3.5 <= real["ops_by_label_op"]["agent.add"] / real["steps_in_window"] <= 5.0, real
    ratio = got["sim_over_real_per_step"]
    assert 0.8 <= ratio["agent"] <= 1.25, got
    assert 0.5 <= ratio["main"] <= 2.0, got
    assert real["per_step"]["main"] / 8 <= 0.5, real  # a rank's own store traffic per step stays small
