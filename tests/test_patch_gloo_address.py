"""The gloo-address patch: c10d's gloo groups listen on PITSTOP_GLOO_ADDR (a "machine"), and
the patch fails loudly if torch changes the line it relies on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import datetime, os, subprocess, sys, torch, torch.distributed as dist
from pitstop.patches import gloo_address
rank, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["PITSTOP_GLOO_ADDR"] = f"127.0.0.{2 + rank}"
assert gloo_address.apply()
store = dist.TCPStore("127.0.0.1", port, is_master=(rank == 0), wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
sub = dist.new_group([0, 1])                      # through c10d, as Megatron builds its groups
t = torch.ones(2) * (rank + 1)
dist.all_reduce(t, group=sub)
listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
mine = [l.split()[3] for l in listening.splitlines() if f"pid={os.getpid()}," in l]
print({"rank": rank, "sum": t.tolist(), "listen": mine}, flush=True)
dist.barrier()
gloo_address.revert()
'''


def test_c10d_gloo_groups_listen_on_the_machine_address(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    import ast

    res = {d["rank"]: d for d in (ast.literal_eval(o.strip().splitlines()[-1]) for o, _ in outs)}
    assert res[0]["sum"] == res[1]["sum"] == [3.0, 3.0]
    for r in (0, 1):  # gloo's listeners are on the machine's own address, none on 127.0.0.1
        gloo = [a for a in res[r]["listen"] if not a.endswith(f":{port}")]
        assert gloo and all(a.startswith(f"127.0.0.{2 + r}:") for a in gloo), res[r]


def test_the_patch_refuses_a_c10d_that_no_longer_builds_gloo_by_that_name(monkeypatch):
    from pitstop.errors import PatchError
    from pitstop.patches import gloo_address

    p = gloo_address.PATCHES
    patch = list(p)[0]
    monkeypatch.setattr(patch, "source_contains", ("backend_class = ProcessGroupGlooV2(",))
    with pytest.raises(PatchError, match="source changed"):
        patch.check()
    monkeypatch.setattr(patch, "requires", ">=9")
    with pytest.raises(PatchError, match="torch version"):
        patch.check()


def test_apply_and_revert_restore_the_original_class(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    from pitstop.patches import gloo_address

    orig = c10d.ProcessGroupGloo
    monkeypatch.delenv(gloo_address.ENV_ADDR, raising=False)
    assert gloo_address.apply() is False and c10d.ProcessGroupGloo is orig
    monkeypatch.setenv(gloo_address.ENV_ADDR, "127.0.0.1")
    assert gloo_address.apply() is True
    assert c10d.ProcessGroupGloo is not orig and issubclass(c10d.ProcessGroupGloo, orig)
    gloo_address.revert()
    assert c10d.ProcessGroupGloo is orig
