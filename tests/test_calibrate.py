"""Tier 2: ``pitstop calibrate`` measures this machine's collective costs with real gloo processes.

The numbers themselves depend on the machine; what is checked is that every (operation,
group size, size) was measured by a real run, that the file it writes is a topology the
emulator loads, and that its tables, not the alpha-beta line, then price the operations.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pitstop.emulation.topology import load

OPS = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "send"}


def _calibrate(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pitstop.cli", "calibrate", *argv], capture_output=True, text=True,
                          timeout=240)


@pytest.mark.timeout(300)
def test_calibrate_measures_every_operation_and_writes_a_topology_the_emulator_prices_with(tmp_path):
    out = tmp_path / "here.json"
    res = _calibrate("--out", str(out), "--sizes", "4096,262144", "--repeats", "3", "--group-sizes", "2,3")
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    table = data["intra_node"]["table"]
    assert set(table) == OPS, table
    for op, rows in table.items():
        want = {"2"} if op == "send" else {"2", "3"}  # one message is between two ranks
        assert set(rows) == want, (op, rows)
        for n, pts in rows.items():
            assert [b for b, _ in pts] == [4096, 262144], (op, n, pts)
            assert all(t > 0 for _, t in pts), (op, n, pts)
    assert "pitstop calibrate" in data["calibrated"] and "--group-sizes 2,3" in data["calibrated"]
    topo = load(out)
    # priced from the table (exactly the measured point), not from the fitted line
    t_ar = table["all_reduce"]["2"][1][1]
    assert topo.cost("all_reduce", [0, 1], 262144) == t_ar
    assert topo.p2p_cost(0, 1, 4096) == table["send"]["2"][0][1]
    # building one communicator, per group size: 1 (a joiner's singletons) and every world measured
    builds = data["group_build_s"]
    assert set(builds) == {"1", "2", "3"} and all(t > 0 for t in builds.values()), builds
    assert topo.group_build_cost(3) == builds["3"]
    assert "group build" in res.stdout and "n=3" in res.stdout, res.stdout[-1000:]


@pytest.mark.parametrize("argv, words", [
    (["--group-sizes", "1"], ["--group-sizes '1'", ">= 2"]),
    (["--sizes", "4096"], ["--sizes '4096'", ">= 2 distinct"]),
    (["--sizes", "2,4096"], ["--sizes '2,4096'", ">= 4"]),
    (["--sizes", "big,4096"], ["--sizes 'big,4096'", "integers"]),
])
def test_calibrate_refuses_bad_input_before_starting_anything(tmp_path, argv, words):
    out = tmp_path / "x.json"
    res = _calibrate("--out", str(out), *argv)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    for w in words:
        assert w in res.stderr, res.stderr
    assert not out.exists()


@pytest.mark.timeout(300)
def test_the_table_keeps_each_entrys_mean_and_the_bench_can_replay_its_median_beside_it():
    """The replay sums operation costs, so the table holds the mean of the repetitions; the
    median, fastest and slowest of the same repetitions come back in ``stats``, and the
    bench's median table (``median_table``) is the same calibration with the medians in."""
    from pitstop.bench.emulation import median_table
    from pitstop.emulation.calibrate import calibrate_topology
    from pitstop.emulation.topology import from_dict

    stats = {}
    # sizes 1,024x apart: at 4 KiB and 64 KiB a loaded clean clone timed both at ~0.11 ms (the
    # fit, which needs time to grow with size, refused them)
    data = calibrate_topology(group_sizes=(2,), sizes=(4096, 4 << 20), repeats=5, stats=stats)
    table = data["intra_node"]["table"]
    assert set(stats) == OPS, stats
    for op, rows in table.items():
        for b, t in rows["2"]:
            s = stats[op]["2"][b]
            assert s["n"] == 5 and t == s["mean"], (op, b, t, s)
            assert s["min"] <= s["median"] <= s["max"] and s["min"] <= s["mean"] <= s["max"], s
    med = median_table(data, stats)
    assert med["name"] == data["name"] + "-median"
    for op, rows in med["intra_node"]["table"].items():
        assert rows["2"] == [[b, stats[op]["2"][b]["median"]] for b in (4096, 4 << 20)], (op, rows)
    assert med["inter_node"]["table"] == med["intra_node"]["table"]
    assert table == data["inter_node"]["table"] and table["all_reduce"]["2"][0][1] == stats["all_reduce"]["2"][4096]["mean"]
    topo = from_dict(med, "median table")  # a topology the emulator loads
    assert topo.cost("all_reduce", [0, 1], 4096) == stats["all_reduce"]["2"][4096]["median"]
