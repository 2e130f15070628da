"""The Megatron-LM lane's patches fit the installed megatron-core 0.19, and fail loudly when not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import typing

import pytest
import torch
from importlib.metadata import version as _version
from packaging.version import Version

# the second lane (Makefile: .venv-lm); a lane without megatron-core 0.19 is a broken install, not a skip
if not Version("0.19") <= Version(_version("megatron-core")) < Version("0.20"):
    raise RuntimeError(f"tests/lm run on megatron-core 0.19.x (make venv-lm), found {_version('megatron-core')}")

from pitstop.errors import PatchError, PitstopError


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="typing.override is built in from Python 3.12")
def test_megatron_training_needs_typing_override_on_311_and_the_shim_supplies_it():
    # Upstream still needs it: when a release stops importing typing.override, this fails
    # and the shim (pitstop.patches.py311) can go.
    bare = _run("import megatron.training")
    assert bare.returncode != 0 and "cannot import name 'override' from 'typing'" in bare.stderr, bare.stderr[-2000:]
    shimmed = _run("""
        from pitstop.patches import py311
        assert py311.apply() is True
        import megatron.training, typing
        from megatron.training import pretrain
        py311.revert()
        assert not hasattr(typing, "override")
        print("ok")
    """)
    assert shimmed.returncode == 0 and shimmed.stdout.strip() == "ok", shimmed.stderr[-2000:]


def test_py311_shim_refuses_another_megatron(monkeypatch):
    from pitstop.patches import py311

    if hasattr(typing, "override") and not py311.is_applied():
        pytest.skip("this Python has typing.override")
    py311.revert()
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.20.0")
    with pytest.raises(PatchError, match=r"megatron-core 0\.20\.0 is not in '>=0\.19,<0\.20'"):
        py311.apply()
    assert not hasattr(typing, "override")


def test_hooks_fit_the_installed_megatron_training():
    from pitstop.patches import megatron_lm, py311

    py311.apply()
    megatron_lm.PATCHES.check()  # raises, naming every hook that no longer fits


def test_hooks_apply_and_revert_to_the_very_same_objects():
    from pitstop.patches import megatron_lm, py311

    py311.apply()
    megatron_lm.revert()
    before = {p.name: p._lookup()[2] for p in megatron_lm.PATCHES}
    megatron_lm.PATCHES.apply()
    try:
        after = {p.name: p._lookup()[2] for p in megatron_lm.PATCHES}
        assert all(after[n] is not before[n] for n in before)
    finally:
        megatron_lm.PATCHES.revert()
    assert all(p._lookup()[2] is before[p.name] for p in megatron_lm.PATCHES)


def test_a_hook_whose_upstream_source_moved_names_itself(monkeypatch):
    from pitstop.patches import megatron_lm, py311

    py311.apply()
    hook = next(p for p in megatron_lm.PATCHES if p.name == "megatron_lm.training.train_step")
    monkeypatch.setattr(hook, "source_contains", ("opt_param_scheduler.step(increment=increment)", "no such line"))
    with pytest.raises(PatchError, match=r"megatron_lm\.training\.train_step.*no such line"):
        megatron_lm.PATCHES.check()


def test_pitstop_flags_compose_with_the_users_provider():
    from pitstop.patches import py311

    py311.apply()
    import argparse

    from pitstop.integrations.megatron_lm import compose_args_provider

    def mine(parser):
        parser.add_argument("--my-flag", type=int, default=3)
        return parser

    p = compose_args_provider(mine)(argparse.ArgumentParser())
    a = p.parse_args(["--my-flag", "5", "--pitstop-heartbeat-interval", "0.25"])
    assert a.my_flag == 5 and a.pitstop_heartbeat_interval == 0.25
    assert compose_args_provider(None)(argparse.ArgumentParser()).parse_args([]).pitstop_commit_interval == 1
    with pytest.raises(PitstopError, match="extra_args_provider 'bad' returned None"):
        def bad(parser):
            parser.add_argument("--x")
        compose_args_provider(bad)(argparse.ArgumentParser())


def test_megatron_lm_parse_args_gets_the_pitstop_flags(monkeypatch):
    """Through Megatron-LM's own parser: the hook composes whatever provider the script passes."""
    import pitstop.integrations.megatron_lm as lm

    lm.install()  # what the script's one import line did
    from megatron.training import arguments

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--pitstop-commit-interval", "1", "--num-layers", "2"])
    args = arguments.parse_args(lambda p: (p.add_argument("--mine", default="x"), p)[1])
    assert args.pitstop_commit_interval == 1 and args.mine == "x" and args.num_layers == 2


def test_running_loss_sums_from_a_peer_are_validated():
    """A snapshot's Megatron-LM running sums come over the network: junk is refused by name."""
    from pitstop.errors import PitstopError
    from pitstop.integrations.megatron_lm import _as_tensors, _checked_sums

    good = {"advanced iterations": 2, "skipped iterations": 0, "nan iterations": 0, "lm loss": 11.0625}
    assert _checked_sums(good) == good
    t = _as_tensors(good)
    assert t["advanced iterations"] == 2 and t["lm loss"].dtype == torch.float32 and float(t["lm loss"]) == 11.0625
    for bad, what in [([1, 2], "small mapping"), ({"lm loss": "5"}, "'lm loss'"), ({"advanced iterations": -1}, "-1"),
                      ({"nan iterations": 1.5}, "1.5"), ({"lm loss": True}, "True"), ({3: 1.0}, "3")]:
        with pytest.raises(PitstopError, match=what):
            _checked_sums(bad)
