"""Bad input gets a clear error naming the value and what was expected; nothing starts."""

import subprocess
import sys
import types
from pathlib import Path

import pytest

from pitstop.errors import InstallError, LayoutError, MissingDependencyError, PitstopError
from pitstop.integrations import megatron as pm

ROOT = Path(__file__).resolve().parents[1]


def test_missing_megatron_names_the_extra():
    code = (
        "import sys\n"
        "for m in ('megatron', 'megatron.core', 'megatron.core.parallel_state'): sys.modules[m] = None\n"
        "from pitstop.integrations import megatron as pm\n"
        "from pitstop.errors import MissingDependencyError\n"
        "try:\n    pm.discover_globals()\nexcept MissingDependencyError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERR" in out.stdout, out.stderr
    assert "pip install 'pitstop[megatron]'" in out.stdout


def test_unknown_parallel_state_global_is_refused_by_name():
    import megatron.core.parallel_state as ps

    fake = types.ModuleType("fake_parallel_state")
    fake.__dict__.update(vars(ps))
    fake._GTP_REMAT_GROUP = None  # what a newer megatron-core adds
    with pytest.raises(InstallError, match="_GTP_REMAT_GROUP"):
        pm.discover_globals(fake)
    # and the real module is fully known
    assert "_TENSOR_MODEL_PARALLEL_GROUP" in pm.discover_globals(ps)


@pytest.mark.parametrize(
    "kw, name",
    [({"use_sharp": True}, "use_sharp"), ({"num_distributed_optimizer_instances": 2}, "num_distributed_optimizer_instances"),
     ({"create_all_gather_group": True}, "create_all_gather_group")],
)
def test_unsupported_megatron_option_is_named(kw, name):
    with pytest.raises(InstallError, match=name):
        pm.initialize_model_parallel(2, **kw)


def test_cli_rejects_a_layout_that_does_not_divide_before_starting(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pitstop.launch.cli", "launch", "--nproc-per-node", "6", "--run-dir", str(tmp_path / "r"),
         "--", "examples/train_gpt.py", "--tp", "2", "--pp", "2"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert out.returncode == 2
    assert "tp(2) * pp(2) * cp(1) does not divide world_size(6)" in out.stderr
    assert not (tmp_path / "r").exists()  # nothing was started


def test_cli_rejects_an_unknown_flag():
    out = subprocess.run([sys.executable, "-m", "pitstop.launch.cli", "demo", "--tensor-parallel", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--tensor-parallel" in out.stderr


def test_errors_form_one_hierarchy():
    assert issubclass(LayoutError, PitstopError) and issubclass(LayoutError, ValueError)
    assert issubclass(MissingDependencyError, ImportError)


# ----------------------------------------------------------------------------- launcher CLI
@pytest.mark.parametrize("argv, message", [
    (["launch", "--nproc-per-node", "0", "--", "examples/train_gpt.py"], "--nproc-per-node(0) must be >= 1"),
    (["launch", "--nproc-per-node", "2", "--standby", "-1", "--", "examples/train_gpt.py"], "--standby(-1) must be >= 0"),
    (["launch", "--nproc-per-node", "2", "--nnodes", "2", "--", "examples/train_gpt.py"], "--nnodes(2)"),
    (["launch", "--nproc-per-node", "2", "--", "no_such_script.py"], "'no_such_script.py' does not exist"),
    (["launch", "--nproc-per-node", "2"], "no training script given"),
    (["launch", "--nproc-per-node", "2", "--heartbeat-timeout", "500", "--", "examples/train_gpt.py"],
     "0.5 < 500.0 < 120.0"),
    (["drain", "--run-dir", "/nonexistent/run", "--rank", "1"], "/nonexistent/run/controller.json does not exist"),
])
def test_launcher_refuses_bad_input_before_starting_anything(argv, message, capsys, tmp_path, monkeypatch):
    from pitstop.launch.cli import main

    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    if argv[0] == "launch":
        argv = argv[:1] + ["--run-dir", str(run_dir)] + argv[1:]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists()  # nothing was started half-way


@pytest.mark.parametrize("section,needle", [
    ({"standbys": 1}, "unknown key"),
    ({"heartbeat_timeout": 0.2}, "pitstop.heartbeat_timeout=0.2"),
    ({"standby": "one"}, "pitstop.standby"),
])
def test_launch_refuses_a_bad_deepspeed_pitstop_section_before_anything_starts(tmp_path, section, needle):
    """`pitstop launch` reads the "pitstop" section of the script's --deepspeed_config: an
    unknown key, an out-of-order timeout or a wrong type stops it before a process starts."""
    import json

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "pitstop": section}))
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "pitstop.launch.cli", "launch", "--nproc-per-node", "2",
                        "--run-dir", str(run_dir), "--", str(ROOT / "examples" / "train_deepspeed.py"),
                        "--deepspeed_config", str(cfg)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr, r.stderr
    assert not (run_dir / "events.jsonl").exists(), "the job started"
