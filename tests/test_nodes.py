"""Tier 1: machines as pure data (``--nnodes MIN:MAX``, node ranks) and SLURM's variables."""

from __future__ import annotations

import re

import pytest

from pitstop.errors import ConfigError
from pitstop.launch.nodes import Nodes, expand_hostlist, from_slurm


def test_nnodes_min_max():
    assert Nodes.parse("4") == Nodes(4, 4) and Nodes.parse("4").standby_machines == 0
    n = Nodes.parse("4:5")
    assert n.standby_machines == 1 and n.is_standby_machine(4) and not n.is_standby_machine(3)
    assert [n.node_of(r, 2) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    for bad, msg in (("0", "min(0)"), ("5:4", "MAX(4) must be >= MIN(5)"), ("x", "expected N or MIN:MAX"),
                     ("4:y", "expected N or MIN:MAX")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            Nodes.parse(bad)
    with pytest.raises(ConfigError, match=r"--node-rank\(5\): expected 0..4"):
        n.check_rank(5)


@pytest.mark.parametrize("text, hosts", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("gpu[01-02,07],login1", ["gpu01", "gpu02", "gpu07", "login1"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("n[001-002],m[5]", ["n001", "n002", "m5"]),
    ("h1,h2", ["h1", "h2"]),
])
def test_slurm_hostlists_expand(text, hosts):
    assert expand_hostlist(text) == hosts


def test_slurm_place_names_the_head_and_this_node():
    env = {"SLURM_JOB_NODELIST": "gpu[07-09],spare1", "SLURM_NNODES": "4", "SLURM_NODEID": "2"}
    p = from_slurm(env)
    assert (p.nnodes, p.node_rank, p.head) == (4, 2, "gpu07")
    assert from_slurm({}) is None
    with pytest.raises(ConfigError, match=r"SLURM_NNODES\(3\) != 4 hosts"):
        from_slurm({**env, "SLURM_NNODES": "3"})
    with pytest.raises(ConfigError, match=r"SLURM_NODEID\(4\): expected 0..3"):
        from_slurm({**env, "SLURM_NODEID": "4"})
    with pytest.raises(ConfigError, match="expected integers"):
        from_slurm({**env, "SLURM_NODEID": "x"})
    with pytest.raises(ConfigError, match="runs backwards"):
        expand_hostlist("gpu[09-07]")
