"""Tier 1: one settings table, and every front door generated from it.

Each row of :data:`pitstop.settings.SETTINGS` is set, to a value that is not its default,
through each door that has it: ``pitstop launch``'s flag, the training script's
``--pitstop-*`` flag (read by the launcher and by ``add_pitstop_args``), the DeepSpeed
config's ``"pitstop"`` section, and the ``PITSTOP_*`` environment. Each must arrive as the
same value in the settings the job runs with. A row added to the table reaches every door
without another edit, and this test covers it without one either.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from pitstop.errors import ConfigError
from pitstop.integrations.deepspeed_config import PitstopSection, keys_table, parse_section
from pitstop.runtime.config import RuntimeConfig
from pitstop.settings import BY_KEY, SETTINGS, Setting, flags_table

ROOT = Path(__file__).resolve().parents[2]

#: A valid value that is not the default, per key (a new row without one fails here, by name).
OTHER = {"standby": 3, "heartbeat_interval": 0.25, "heartbeat_timeout": 3.0, "collective_timeout": 60.0,
         "buddy": False, "save_interval": 3, "save_dir": "/tmp/pitstop-ck", "warmup": False, "hold_for_warm": 2.5,
         "commit_interval": 4, "async_commit": False}


def _text(v) -> str:
    return str(v)


def _flag_args(s: Setting, script: bool) -> list:
    return [s.flag(script)] if s.type is bool else [s.flag(script), _text(OTHER[s.key])]


def _arrived(spec, s: Setting):
    return spec.standby if s.field is None else getattr(spec.config, s.field)


def test_every_row_has_a_value_to_try_and_the_dataclasses_hold_the_same_rows():
    assert set(OTHER) == set(BY_KEY)
    for s in SETTINGS:
        assert OTHER[s.key] != s.default and type(OTHER[s.key]) is s.type, s.key
        assert s.check(s.default, s.key) == s.default  # a default passes its own row
    # RuntimeConfig's fields are the worker rows: names, types and defaults, in table order
    assert [(f.name, f.type, f.default) for f in fields(RuntimeConfig)] == \
        [(s.field, s.type.__name__, s.default) for s in SETTINGS if s.field is not None]
    # PitstopSection's fields are the DeepSpeed rows (plus emulation and the bookkeeping)
    ds = {f.name: (f.type, f.default) for f in fields(PitstopSection) if f.name not in ("emulation", "given")}
    assert ds == {s.key: (s.type.__name__, s.default) for s in SETTINGS if s.deepspeed}
    assert all(f.default is not MISSING for f in fields(PitstopSection))


@pytest.mark.parametrize("key", sorted(OTHER))
def test_each_setting_arrives_the_same_through_every_door(key, tmp_path):
    from pitstop.integrations.megatron import add_pitstop_args, runtime_config
    from pitstop.launch.cli import _parser, launch_spec

    s = BY_KEY[key]
    want = OTHER[key]
    head = ["launch", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run")]
    # pitstop launch's flag
    spec, _, _ = launch_spec(_parser().parse_args(head + _flag_args(s, False) + ["--", "examples/train_gpt.py"]))
    assert _arrived(spec, s) == want
    # the defaults stay defaults: one flag moves one setting
    plain, _, _ = launch_spec(_parser().parse_args(head + ["--", "examples/train_gpt.py"]))
    assert _arrived(plain, s) == s.default
    assert plain.config.settings() == {t.key: t.default for t in SETTINGS if t.field is not None}
    if s.script:
        # the script's --pitstop-* flag, as the launcher reads it ...
        spec, _, _ = launch_spec(_parser().parse_args(head + ["--", "examples/train_gpt.py"] + _flag_args(s, True)))
        assert _arrived(spec, s) == want
        # ... and as the worker reads it (Megatron-LM's extra_args_provider)
        cfg = runtime_config(add_pitstop_args(argparse.ArgumentParser()).parse_args(_flag_args(s, True)))
        assert getattr(cfg, s.field) == want
    else:
        assert s.flag(True) not in add_pitstop_args(argparse.ArgumentParser()).format_help()
    if s.deepspeed:
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "pitstop": {key: want}}))
        spec, _, _ = launch_spec(_parser().parse_args(
            head + ["--", "examples/train_deepspeed.py", "--deepspeed_config", str(ds)]))
        assert _arrived(spec, s) == want
        assert getattr(parse_section({key: want}), key) == want
        if s.field is not None:  # and as the worker reads it, where the launcher passed nothing
            assert getattr(parse_section({key: want}).runtime_config(env={}), s.field) == want
    else:
        with pytest.raises(ConfigError, match=f"unknown key\\(s\\) '{key}'"):
            parse_section({key: want})
    if s.field is not None:
        # the environment, from the launcher to the worker
        env = RuntimeConfig(**{s.field: want}).to_env()
        assert env[s.env] == (("1" if want else "0") if s.type is bool else _text(want))
        assert getattr(RuntimeConfig.from_env(env), s.field) == want


def test_the_launchers_flag_wins_over_the_script_and_the_deepspeed_section(tmp_path):
    from pitstop.launch.cli import _parser, launch_spec

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"pitstop": {"heartbeat_timeout": 7.0, "commit_interval": 2, "standby": 2}}))
    argv = ["launch", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--commit-interval", "8", "--",
            "examples/train_deepspeed.py", "--deepspeed_config", str(ds), "--pitstop-heartbeat-timeout", "4"]
    spec, _, _ = launch_spec(_parser().parse_args(argv))
    # launch flag > script flag > DeepSpeed section > default
    assert (spec.config.commit_interval, spec.config.heartbeat_timeout_s, spec.standby) == (8, 4.0, 2)
    assert spec.config.heartbeat_interval_s == BY_KEY["heartbeat_interval"].default


@pytest.mark.parametrize("key, bad, launch, env, section", [
    ("commit_interval", "0", "--commit-interval: '0': expected an integer >= 1 (1: vote at every step)",
     "PITSTOP_COMMIT_INTERVAL='0': expected an integer >= 1", "pitstop.commit_interval=0: expected an integer >= 1"),
    ("heartbeat_interval", "-2", "--heartbeat-interval: '-2': expected a number of seconds > 0",
     "PITSTOP_HEARTBEAT_INTERVAL_S='-2': expected a number of seconds > 0",
     "pitstop.heartbeat_interval=-2: expected a number of seconds > 0"),
    ("hold_for_warm", "x", "--hold-for-warm: 'x': expected a number of seconds >= 0 (0: do not wait)",
     "PITSTOP_HOLD_FOR_WARM_S='x': expected a number of seconds >= 0", None),
    ("buddy", "maybe", None, "PITSTOP_BUDDY='maybe': expected true or false", None),
])
def test_a_bad_value_is_named_in_each_doors_spelling(key, bad, launch, env, section, capsys):
    from pitstop.launch.cli import _parser

    s = BY_KEY[key]
    if launch is not None:
        with pytest.raises(SystemExit):
            _parser().parse_args(["launch", "--nproc-per-node", "2", s.flag(), bad, "--", "x.py"])
        assert launch in capsys.readouterr().err
    with pytest.raises(ConfigError) as e:
        RuntimeConfig.from_env({s.env: bad})
    assert env in str(e.value)
    if section is not None:
        with pytest.raises(ConfigError) as e:
            parse_section({key: json.loads(bad)})
        assert section in str(e.value)


def test_an_order_error_names_the_whole_chain_at_every_door():
    with pytest.raises(ConfigError) as e:
        RuntimeConfig(heartbeat_timeout_s=200.0)
    assert str(e.value) == ("collective_timeout_s=120.0: expected a number of seconds > heartbeat_timeout_s (200.0); "
                            "they must be ordered heartbeat_interval_s < heartbeat_timeout_s < collective_timeout_s, "
                            "got 0.5 < 200.0 < 120.0")
    with pytest.raises(ConfigError) as e:
        parse_section({"heartbeat_interval": 6})
    assert str(e.value).startswith("pitstop.heartbeat_timeout=5.0: expected a number of seconds > "
                                   "pitstop.heartbeat_interval (6.0); they must be ordered pitstop.heartbeat_interval "
                                   "< pitstop.heartbeat_timeout < pitstop.collective_timeout, got 6.0 < 5.0 < 120.0")


def test_the_readme_tables_are_the_generated_ones():
    """The README's `--pitstop-*` flag table and DeepSpeed keys table are what the table renders,
    so documentation cannot drift from the flags (regenerate with the two functions)."""
    readme = (ROOT / "README.md").read_text()
    assert flags_table() in readme
    assert keys_table() in readme
    for s in SETTINGS:
        assert s.describe in flags_table() + keys_table() or not (s.script or s.deepspeed)
