"""Tier 1: the ``"pitstop"`` section of a DeepSpeed config (pure: no torch.distributed, no DeepSpeed)."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest

from pitstop.errors import ConfigError
from pitstop.integrations.deepspeed_config import (
    EmulationSection,
    PitstopSection,
    keys_table,
    load_config,
    parse_section,
    refuse_unsupported,
    strip_section,
    unsupported,
)
from pitstop.runtime.config import RuntimeConfig

DEFAULTS = {
    "standby": 0,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 5.0,
    "collective_timeout": 120.0,
    "buddy": True,
    "warmup": True,
    "hold_for_warm": 0.0,
    "emulation": None,
    "commit_interval": 1,
    "async_commit": True,
}

DS = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}


# ------------------------------------------------------------------------ defaults
@pytest.mark.parametrize("key", sorted(DEFAULTS))
def test_every_key_has_its_default(key):
    for empty in (None, {}):
        assert getattr(parse_section(empty), key) == DEFAULTS[key]


def test_the_defaults_are_exactly_the_documented_keys():
    # ``given`` is bookkeeping (which keys the config wrote), not a key
    assert {f.name for f in dataclasses.fields(PitstopSection)} - {"given"} == set(DEFAULTS)


def test_defaults_match_the_runtime_config():
    rc = PitstopSection().runtime_config(env={})
    assert rc == RuntimeConfig()


def test_a_full_section_parses():
    sect = parse_section({
        "standby": 2, "heartbeat_interval": 0.25, "heartbeat_timeout": 3, "collective_timeout": 60,
        "buddy": False, "warmup": False, "hold_for_warm": 30,
        "emulation": {"world_size": 8192, "real_ranks": [0, 8191], "topology": "h200-nvlink-ib"},
        "commit_interval": 4,
    })
    assert sect == PitstopSection(2, 0.25, 3.0, 60.0, False, False, 30.0,
                                  EmulationSection(8192, (0, 8191), "h200-nvlink-ib"), 4)
    assert isinstance(sect.heartbeat_timeout, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sect.standby = 3  # type: ignore[misc]


def test_emulation_topology_defaults_to_the_loopback_model():
    sect = parse_section({"emulation": {"world_size": 4, "real_ranks": [1]}})
    assert sect.emulation == EmulationSection(4, (1,), "cpu-gloo-loopback")


def test_runtime_config_mapping_keeps_what_the_section_does_not_carry():
    sect = parse_section({"heartbeat_interval": 0.2, "heartbeat_timeout": 2, "collective_timeout": 30,
                          "buddy": False, "warmup": False, "hold_for_warm": 7, "commit_interval": 8})
    rc = sect.runtime_config(RuntimeConfig(save_interval=5, save_dir="/ckpt"), env={})
    assert rc == RuntimeConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, collective_timeout_s=30.0,
                               buddy=False, save_interval=5, save_dir="/ckpt", warmup=False, hold_for_warm_s=7.0,
                               commit_interval=8)


def test_launch_flags_win_over_the_section_and_its_defaults_never_override_them():
    """``pitstop launch --no-warmup --hold-for-warm 600`` reaches the worker as ``PITSTOP_*``
    variables (the launcher merged the section under its flags). The section's *defaults* used to
    be written over them at ``initialize``: a "cold" standby warmed up and training never held.
    Now a section key applies only where the config wrote it and the launcher passed nothing."""
    launched = RuntimeConfig(warmup=False, hold_for_warm_s=600.0, commit_interval=4)
    env = launched.to_env()
    # no section at all, or one that writes other keys: the launcher's values stay
    assert parse_section({}).runtime_config(launched, env=env) == launched
    assert parse_section({"buddy": False}).runtime_config(launched, env=env) == launched
    # a key the section wrote, which the launcher also passed: the launcher's (its flags won there)
    assert parse_section({"warmup": True, "hold_for_warm": 1}).runtime_config(launched, env=env) == launched
    # a plain torchrun start (no launcher variables): the keys the section wrote, defaults elsewhere
    rc = parse_section({"warmup": False, "commit_interval": 3}).runtime_config(RuntimeConfig(), env={})
    assert rc == RuntimeConfig(warmup=False, commit_interval=3)
    assert parse_section({"warmup": False}).given == frozenset({"warmup"})


# -------------------------------------------------------------------------- errors
BAD = [
    # (section, key path, value as printed, what is expected)
    ({"standby": -1}, "pitstop.standby", "-1", "integer >= 0"),
    ({"standby": 1.0}, "pitstop.standby", "1.0", "integer >= 0"),
    ({"standby": True}, "pitstop.standby", "True", "got bool"),
    ({"standby": "2"}, "pitstop.standby", "'2'", "integer >= 0"),
    ({"heartbeat_interval": 0}, "pitstop.heartbeat_interval", "0", "seconds > 0"),
    ({"heartbeat_interval": -0.5}, "pitstop.heartbeat_interval", "-0.5", "seconds > 0"),
    ({"heartbeat_interval": "fast"}, "pitstop.heartbeat_interval", "'fast'", "got str"),
    ({"heartbeat_interval": False}, "pitstop.heartbeat_interval", "False", "got bool"),
    ({"heartbeat_interval": float("nan")}, "pitstop.heartbeat_interval", "nan", "non-finite"),
    ({"heartbeat_timeout": True}, "pitstop.heartbeat_timeout", "True", "got bool"),
    ({"heartbeat_timeout": None}, "pitstop.heartbeat_timeout", "None", "got NoneType"),
    ({"collective_timeout": [1]}, "pitstop.collective_timeout", "[1]", "got list"),
    ({"collective_timeout": float("inf")}, "pitstop.collective_timeout", "inf", "non-finite"),
    ({"buddy": 1}, "pitstop.buddy", "1", "true or false"),
    ({"buddy": "yes"}, "pitstop.buddy", "'yes'", "true or false"),
    ({"warmup": 0}, "pitstop.warmup", "0", "true or false"),
    ({"hold_for_warm": -1}, "pitstop.hold_for_warm", "-1", ">= 0"),
    ({"hold_for_warm": True}, "pitstop.hold_for_warm", "True", "got bool"),
    ({"commit_interval": 0}, "pitstop.commit_interval", "0", "integer >= 1"),
    ({"commit_interval": 2.5}, "pitstop.commit_interval", "2.5", "integer >= 1"),
    ({"commit_interval": True}, "pitstop.commit_interval", "True", "got bool"),
    ({"emulation": 8}, "pitstop.emulation", "8", "object"),
    ({"emulation": {"real_ranks": [0]}}, "pitstop.emulation", "world_size", "missing"),
    ({"emulation": {"world_size": 8}}, "pitstop.emulation", "real_ranks", "missing"),
    ({"emulation": {"world_size": 0, "real_ranks": [0]}}, "pitstop.emulation.world_size", "0", ">= 1"),
    ({"emulation": {"world_size": True, "real_ranks": [0]}}, "pitstop.emulation.world_size", "True", "got bool"),
    ({"emulation": {"world_size": 8, "real_ranks": []}}, "pitstop.emulation.real_ranks", "[]", "non-empty list"),
    ({"emulation": {"world_size": 8, "real_ranks": 3}}, "pitstop.emulation.real_ranks", "3", "non-empty list"),
    ({"emulation": {"world_size": 8, "real_ranks": [0, 8]}}, "pitstop.emulation.real_ranks[1]", "8", "[0, 8)"),
    ({"emulation": {"world_size": 8, "real_ranks": [-1]}}, "pitstop.emulation.real_ranks[0]", "-1", "[0, 8)"),
    ({"emulation": {"world_size": 8, "real_ranks": [True]}}, "pitstop.emulation.real_ranks[0]", "True", "got bool"),
    ({"emulation": {"world_size": 8, "real_ranks": [3, 3]}}, "pitstop.emulation.real_ranks[1]", "3", "twice"),
    ({"emulation": {"world_size": 8, "real_ranks": [0], "topology": ""}}, "pitstop.emulation.topology", "''",
     "topology name or file path"),
    ({"emulation": {"world_size": 8, "real_ranks": [0], "topology": 5}}, "pitstop.emulation.topology", "5",
     "topology name or file path"),
]


@pytest.mark.parametrize("section, path, value, expected", BAD, ids=[f"{p}={v}" for _, p, v, _ in BAD])
def test_errors_name_the_key_the_value_and_what_is_expected(section, path, value, expected):
    with pytest.raises(ConfigError) as e:
        parse_section(section)
    msg = str(e.value)
    assert path in msg and value in msg and expected in msg, msg


def test_a_section_that_is_not_an_object_is_refused():
    with pytest.raises(ConfigError, match=r"pitstop=\[1, 2\]: expected an object"):
        parse_section([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("section, unknown, where", [
    ({"heartbeat_intervall": 1.0}, "'heartbeat_intervall'", "pitstop:"),
    ({"standbys": 1, "buddy": True}, "'standbys'", "pitstop:"),
    ({"heartbeat_interval_s": 0.5}, "'heartbeat_interval_s'", "pitstop:"),
    ({"emulation": {"world_size": 8, "real_ranks": [0], "tp": 2}}, "'tp'", "pitstop.emulation:"),
])
def test_unknown_keys_are_refused_by_name_with_the_known_ones(section, unknown, where):
    with pytest.raises(ConfigError) as e:
        parse_section(section)
    msg = str(e.value)
    assert msg.startswith(where) and unknown in msg and "known keys are" in msg, msg
    known = ("world_size, real_ranks, topology" if "emulation" in where else
             "standby, heartbeat_interval, heartbeat_timeout, collective_timeout, buddy, warmup, hold_for_warm, "
             "emulation")
    assert known in msg


# ---------------------------------------------------------------- timeout order
@pytest.mark.parametrize("section, path, message", [
    # interval is checked first, then timeout against interval, then collective against timeout
    ({"heartbeat_interval": 6.0}, "pitstop.heartbeat_timeout",
     "pitstop.heartbeat_timeout=5.0: expected a number of seconds > pitstop.heartbeat_interval (6.0)"),
    ({"heartbeat_interval": 1.0, "heartbeat_timeout": 1.0}, "pitstop.heartbeat_timeout",
     "pitstop.heartbeat_timeout=1.0: expected a number of seconds > pitstop.heartbeat_interval (1.0)"),
    ({"heartbeat_timeout": 200}, "pitstop.collective_timeout",
     "pitstop.collective_timeout=120.0: expected a number of seconds > pitstop.heartbeat_timeout (200.0)"),
    ({"heartbeat_timeout": 10, "collective_timeout": 10}, "pitstop.collective_timeout",
     "pitstop.collective_timeout=10: expected a number of seconds > pitstop.heartbeat_timeout (10.0)"),
    # two wrong at once: the first in order is reported
    ({"heartbeat_interval": 0, "heartbeat_timeout": 0, "collective_timeout": 0}, "pitstop.heartbeat_interval",
     "pitstop.heartbeat_interval=0: expected a number of seconds > 0"),
    ({"heartbeat_interval": 9, "collective_timeout": 1}, "pitstop.heartbeat_timeout", "pitstop.heartbeat_timeout=5.0"),
])
def test_timeouts_are_validated_in_order(section, path, message):
    with pytest.raises(ConfigError) as e:
        parse_section(section)
    assert str(e.value).startswith(path) and message in str(e.value), str(e.value)


def test_ordered_timeouts_just_above_each_other_pass():
    s = parse_section({"heartbeat_interval": 0.1, "heartbeat_timeout": 0.2, "collective_timeout": 0.3})
    assert (s.heartbeat_interval, s.heartbeat_timeout, s.collective_timeout) == (0.1, 0.2, 0.3)


# ------------------------------------------------------------ whole DeepSpeed configs
def test_strip_section_from_a_dict_leaves_the_input_alone():
    cfg = {**DS, "pitstop": {"standby": 1}}
    rest, sect = strip_section(cfg)
    assert rest == DS and sect.standby == 1
    assert cfg["pitstop"] == {"standby": 1}  # not modified
    rest["zero_optimization"]["stage"] = 3
    assert cfg["zero_optimization"]["stage"] == 2  # a deep copy


def test_strip_section_without_a_section_gives_the_defaults():
    rest, sect = strip_section(DS)
    assert rest == DS and sect == PitstopSection()


def test_strip_section_from_a_json_file_and_from_base64(tmp_path):
    cfg = {**DS, "pitstop": {"heartbeat_timeout": 3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    for given in (path, str(path), base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()):
        rest, sect = strip_section(given)
        assert rest == DS and sect.heartbeat_timeout == 3.0


def test_a_bad_section_in_a_file_names_the_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DS, "pitstop": {"buddy": "no"}}))
    with pytest.raises(ConfigError, match=r"pitstop\.buddy='no': expected true or false"):
        strip_section(path)


def test_config_files_with_duplicate_keys_or_bad_json_are_refused(tmp_path):
    dup = tmp_path / "dup.json"
    dup.write_text('{"pitstop": {"standby": 1}, "pitstop": {"standby": 2}}')
    with pytest.raises(ConfigError, match="duplicate key 'pitstop'"):
        load_config(dup)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="expected a dict, the path of an existing JSON file"):
        load_config(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="expected a dict or a path"):
        load_config(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["pit_stop", "Pitstop", "pitstpo", "pitstops"])
def test_a_misspelt_section_is_refused_not_ignored(key):
    with pytest.raises(ConfigError, match=f"DeepSpeed config key '{key}': did you mean 'pitstop'"):
        strip_section({**DS, key: {"standby": 1}})


# --------------------------------------------------------------- what pitstop refuses
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_is_supported_at_zero_0_1_and_2(stage):
    for key in ("bf16", "bfloat16"):  # DeepSpeed's name and its old one
        assert unsupported({**DS, "zero_optimization": {"stage": stage}, key: {"enabled": True}}) == []
    # grad_accum_dtype bf16 keeps DeepSpeed on its ZeRO optimizer, the one pitstop carries
    assert unsupported({**DS, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                        "data_types": {"grad_accum_dtype": "bf16"}}) == []


def test_fp16_is_refused_naming_the_value_and_why():
    with pytest.raises(ConfigError) as exc:
        refuse_unsupported({**DS, "fp16": {"enabled": True}})
    msg = str(exc.value)
    assert "fp16.enabled=true" in msg and "is_fp16_supported() is False" in msg and "use bf16.enabled=true" in msg
    assert unsupported({**DS, "fp16": {"enabled": False}}) == []


@pytest.mark.parametrize("accum", ["fp32", "float32", "torch.float32"])
def test_bf16_at_zero1_with_fp32_gradient_accumulation_is_refused(accum):
    """That combination makes DeepSpeed pick its BF16_Optimizer, whose fp32 gradient
    accumulators a rollback would not reset."""
    for key in ("bf16", "bfloat16"):
        bad = unsupported({**DS, "zero_optimization": {"stage": 1}, key: {"enabled": True},
                           "data_types": {"grad_accum_dtype": accum}})
        assert len(bad) == 1 and f"data_types.grad_accum_dtype={accum!r} with {key}.enabled=true" in bad[0], bad
        assert "BF16_Optimizer" in bad[0]
    # ZeRO 2 keeps the ZeRO optimizer with fp32 accumulation
    assert unsupported({**DS, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}) == []


@pytest.mark.parametrize("key, section", [
    ("amp", {"enabled": True}), ("elasticity", {"enabled": True, "max_train_batch_size": 64}),
    ("curriculum_learning", {"enabled": True}), ("data_efficiency", {"enabled": True}),
    ("progressive_layer_drop", {"enabled": True, "theta": 0.5}), ("hybrid_engine", {"enabled": True}),
    ("eigenvalue", {"enabled": True}), ("compression_training", {"weight_quantization": {"shared_parameters": {}}}),
])
def test_features_whose_state_a_joiner_would_not_get_are_refused_by_name(key, section):
    bad = unsupported({**DS, key: section})
    assert len(bad) == 1 and bad[0].startswith(f"{key}.enabled=true: "), bad
    if key != "compression_training":  # switched off: nothing to refuse
        assert unsupported({**DS, key: {**section, "enabled": False}}) == []
    assert unsupported({**DS, key: {}}) == []


# ------------------------------------------------------------------- documentation
def test_keys_table_lists_every_key_with_its_default():
    table = keys_table()
    lines = table.strip().splitlines()
    assert lines[0] == "| key | type | default | meaning |"
    rows = {line.split("|")[1].strip().strip("`"): [c.strip() for c in line.split("|")[2:5]] for line in lines[2:]}
    assert set(rows) == {f"pitstop.{k}" for k in DEFAULTS} | {f"pitstop.emulation.{k}" for k in
                                                              ("world_size", "real_ranks", "topology")}
    for key, default in DEFAULTS.items():
        assert rows[f"pitstop.{key}"][1] == ("absent" if default is None else json.dumps(default))
        assert rows[f"pitstop.{key}"][2], f"{key} has no meaning"
    assert rows["pitstop.emulation.world_size"][1] == "required"
    assert rows["pitstop.emulation.topology"][1] == '"cpu-gloo-loopback"'


def test_the_module_stays_pure():
    import subprocess
    import sys

    code = ("import sys, pitstop.integrations.deepspeed_config as m; "
            "m.strip_section({'pitstop': {'standby': 1}}); "
            "bad = [n for n in ('torch.distributed', 'deepspeed') if n in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
