"""Bad input gets a clear error naming the value and what was expected; nothing starts."""

import os
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
    out = subprocess.run([sys.executable, "-m", "pitstop.cli", "demo", "--tensor-parallel", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--tensor-parallel" in out.stderr


def test_errors_form_one_hierarchy():
    assert issubclass(LayoutError, PitstopError) and issubclass(LayoutError, ValueError)
    assert issubclass(MissingDependencyError, ImportError)


# ----------------------------------------------------------------------------- launcher CLI
@pytest.mark.parametrize("argv, message", [
    (["launch", "--nproc-per-node", "0", "--", "examples/train_gpt.py"], "--nproc-per-node: '0': expected an integer >= 1"),
    (["launch", "--nproc-per-node", "2", "--standby", "-1", "--", "examples/train_gpt.py"], "--standby: '-1': expected an integer >= 0"),
    (["launch", "--nproc-per-node", "2", "--nnodes", "2", "--", "examples/train_gpt.py"], "--nnodes 2: give --rdzv-endpoint HOST:PORT"),
    (["launch", "--nproc-per-node", "2", "--nnodes", "3:2", "--", "examples/train_gpt.py"], "MAX(2) must be >= MIN(3)"),
    (["launch", "--nproc-per-node", "2", "--nnodes", "2:3", "--node-rank", "3", "--", "examples/train_gpt.py"], "--node-rank(3): expected 0..2"),
    (["launch", "--nproc-per-node", "2", "--", "no_such_script.py"], "'no_such_script.py' does not exist"),
    (["launch", "--nproc-per-node", "2"], "no training script given"),
    (["launch", "--nproc-per-node", "2", "--heartbeat-timeout", "500", "--", "examples/train_gpt.py"],
     "0.5 < 500.0 < 120.0"),
    (["launch", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:70000", "--", "examples/train_gpt.py"],
     "port 70000 is out of range, expected 0..65535"),
    (["launch", "--nproc-per-node", "2", "--rdzv-endpoint", "localhost", "--", "examples/train_gpt.py"],
     "must look like HOST:PORT"),
    (["launch", "--nproc-per-node", "2", "--collective-timeout", "nan", "--", "examples/train_gpt.py"],
     "--collective-timeout: 'nan': expected a number of seconds > 0, got a non-finite number"),
    (["launch", "--nproc-per-node", "2", "--heartbeat-timeout", "inf", "--", "examples/train_gpt.py"],
     "--heartbeat-timeout: 'inf': expected a number of seconds > 0, got a non-finite number"),
    (["launch", "--nproc-per-node", "2", "--hold-for-warm", "-1", "--", "examples/train_gpt.py"],
     "--hold-for-warm: '-1': expected a number of seconds >= 0 (0: do not wait)"),
    (["launch", "--nproc-per-node", "2", "--commit-interval", "0", "--", "examples/train_gpt.py"],
     "--commit-interval"),
    (["bench", "hook", "--commit-intervals", "8,5"],
     "commit intervals [5]: expected divisors of 64 that are >= 2"),
    (["bench", "recovery", "--framework", "deepspeed", "--zero-stage", "4"], "--zero-stage"),
    (["bench", "recovery", "--zero-stage", "2"], "--zero-stage 2: only with --framework deepspeed"),
    (["launch", "--nproc-per-node", "2", "--max-restarts", "-1", "--", "examples/train_gpt.py"],
     "--max-restarts: '-1': expected an integer >= 0"),
    (["launch", "--nproc-per-node", "2", "--commit-interval", "4", "--", "examples/train_gpt.py",
      "--pitstop-commit-interval", "2"],
     "the training script's --pitstop-commit-interval 2 and pitstop launch's --commit-interval 4 disagree"),
    (["launch", "--nproc-per-node", "2", "--heartbeat-timeout", "5", "--", "examples/train_gpt.py",
      "--pitstop-heartbeat-timeout", "3"],
     "the training script's --pitstop-heartbeat-timeout 3.0 and pitstop launch's --heartbeat-timeout 5.0 disagree"),
    (["launch", "--nproc-per-node", "2", "--", "examples/train_gpt.py", "--pitstop-collective-timeout", "abc"],
     "the training script's argument --pitstop-collective-timeout: 'abc': expected a number of seconds > 0"),
    (["launch", "--nproc-per-node", "2", "--", "examples/train_gpt.py", "--pitstop-heartbeat-timeout", "500"],
     "0.5 < 500.0 < 120.0"),
    (["launch", "--nproc-per-node", "2", "--rdzv-backend", "etcd", "--", "examples/train_gpt.py"],
     "--rdzv-backend etcd: give --rdzv-endpoint HOST:PORT"),
    (["launch", "--nproc-per-node", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:0", "--",
      "examples/train_gpt.py"], "'127.0.0.1:0': etcd runs on a port of its own, expected HOST:PORT with a port in 1..65535"),
    (["launch", "--nproc-per-node", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:9", "--",
      "examples/train_gpt.py"], "--rdzv-endpoint 127.0.0.1:9: etcd does not answer there"),
    (["launch", "--nproc-per-node", "2", "--rdzv-backend", "zookeeper", "--", "examples/train_gpt.py"],
     "--rdzv-backend: invalid choice: 'zookeeper'"),
    (["launch", "--resume"], "launch.json does not exist (give the run directory of a job launched with --rdzv-backend etcd)"),
    (["launch", "--resume", "--", "examples/train_gpt.py"], "--resume takes the job from --run-dir/launch.json: give no script"),
    (["launch", "--", "examples/train_gpt.py"], "--nproc-per-node N is required"),
    (["drain", "--run-dir", "/nonexistent/run", "--rank", "1"], "/nonexistent/run/controller.json does not exist"),
    (["drain", "--run-dir", "/nonexistent/run", "--rank", "-3"], "--rank: '-3': expected an integer >= 0"),
    (["status", "--run-dir", "/nonexistent/run"], "'/nonexistent/run': no such run directory"),
    (["emulate", "--world-size", "4", "--real-ranks", "0", "--timeout", "nan", "--", "examples/train_gpt.py"],
     "'nan': expected a finite number of seconds > 0"),
])
def test_launcher_refuses_bad_input_before_starting_anything(argv, message, capsys, tmp_path, monkeypatch):
    """Every command exits 2 with one line that names the value and what was expected, and no
    traceback; nothing is started half-way."""
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    if argv[0] == "launch":
        argv = argv[:1] + ["--run-dir", str(run_dir)] + argv[1:]
    assert _main_code(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not run_dir.exists()  # nothing was started half-way


def _main_code(argv) -> int:
    from pitstop.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own refusals
        return int(exc.code)


def test_a_directory_given_for_a_file_is_refused(tmp_path, capsys, monkeypatch):
    """A topology or DeepSpeed config that is a directory is named as one, not a traceback."""
    monkeypatch.chdir(ROOT)
    d = tmp_path / "adir.json"
    d.mkdir()
    assert _main_code(["emulate", "--world-size", "4", "--real-ranks", "0", "--topology", str(d), "--out",
                       str(tmp_path / "out"), "--", "examples/train_gpt.py"]) == 2
    err = capsys.readouterr().err
    assert "is a directory, expected a .json or .toml file" in err and "Traceback" not in err, err
    assert _main_code(["launch", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--",
                       "examples/train_deepspeed.py", "--deepspeed_config", str(d)]) == 2
    err = capsys.readouterr().err
    assert "is a directory, expected a JSON file" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, needle", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "zero_hpz_partition_size=2"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, "mics_shard_size=2"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer.device='cpu'"),
    ({"fp16": {"enabled": True}}, "fp16.enabled=true"),
    ({"pipeline": {"stages": 2}}, "pipeline engine"),
])
def test_launch_refuses_a_deepspeed_feature_pitstop_does_not_support(tmp_path, capsys, monkeypatch, config, needle):
    import json

    monkeypatch.chdir(ROOT)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, **config}))
    assert _main_code(["launch", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--",
                       "examples/train_deepspeed.py", "--deepspeed_config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "does not support" in err, err
    assert not (tmp_path / "run").exists()


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


def test_the_scripts_pitstop_flags_reach_the_controller(tmp_path):
    """`--pitstop-*` flags given to the script set the controller's settings too (the controller
    restarts from the checkpoint directory the workers save to); launch's own flags win when
    they agree, and the DeepSpeed section is weakest."""
    from pitstop.launch.cli import _parser, launch_spec

    argv = ["launch", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--collective-timeout", "90",
            "--", "examples/train_gpt.py", "--tp", "2", "--pitstop-heartbeat-timeout", "3", "--pitstop-save-interval",
            "4", "--pitstop-save-dir", str(tmp_path / "ck"), "--pitstop-no-buddy", "--pitstop-commit-interval", "4",
            "--pitstop-collective-timeout=90"]
    spec, node_rank, endpoint = launch_spec(_parser().parse_args(argv))
    c = spec.config
    assert (c.heartbeat_timeout_s, c.save_interval, c.save_dir, c.buddy, c.collective_timeout_s, c.commit_interval) == \
        (3.0, 4, str(tmp_path / "ck"), False, 90.0, 4)
    assert (c.heartbeat_interval_s, c.warmup, node_rank, endpoint) == (0.5, True, 0, None)  # untouched defaults
    assert spec.argv[-1] == "--pitstop-collective-timeout=90"  # the script still gets all its flags
    plain = launch_spec(_parser().parse_args(argv[:5] + ["--", "examples/train_gpt.py"]))[0].config
    assert (plain.heartbeat_timeout_s, plain.save_interval, plain.save_dir, plain.buddy) == (5.0, 0, "", True)


def test_megatron_communicators_use_pitstops_collective_timeout_inside_a_job(tmp_path):
    """`--pitstop-collective-timeout` reaches Megatron's communicators (and their gloo twins):
    inside a pitstop job they time out on pitstop's schedule, not after distributed_timeout_minutes."""
    import subprocess
    import sys

    code = """
import torch, torch.distributed as dist
from pitstop.integrations import megatron as meg
from pitstop.pg import init_world
from pitstop.runtime import worker
from pitstop.runtime.config import RuntimeConfig

def timeouts(reg):
    out = set()
    for g in reg.communicators():
        b = getattr(g, "raw", g)._get_backend(torch.device("cpu"))
        out.add(b.options._timeout.total_seconds())
    return out

store = dist.HashStore()
init_world(store, 0, 1)
reg = meg.initialize_model_parallel(1, 1, distributed_timeout_minutes=7)
print("outside", sorted(timeouts(reg)))
meg.destroy_model_parallel()
worker._CURRENT = worker.Membership(0, 1, 0, "worker", store=store, config=RuntimeConfig(collective_timeout_s=42.0, warmup=False))
reg = meg.initialize_model_parallel(1, 1, distributed_timeout_minutes=7)
print("inside", sorted(timeouts(reg)))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "outside [420.0]" in out.stdout and "inside [42.0]" in out.stdout, out.stdout + out.stderr[-2000:]



def test_resume_refuses_a_job_whose_store_died_with_its_controller(tmp_path, capsys):
    """--resume re-attaches only to an etcd-backed job: an embedded store is gone with its controller."""
    import json

    from pitstop.launch.controller import LaunchSpec

    spec = LaunchSpec(["examples/train_gpt.py"], 2, run_dir=tmp_path)
    (tmp_path / "launch.json").write_text(json.dumps(spec.to_json()))
    assert LaunchSpec.from_json(spec.to_json()).to_json() == spec.to_json()  # the spec survives the file
    assert _main_code(["launch", "--resume", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "ran with --rdzv-backend c10d" in err and "Only an etcd-backed job can be re-attached" in err, err
    (tmp_path / "launch.json").write_text("{not json")
    assert _main_code(["launch", "--resume", "--run-dir", str(tmp_path)]) == 2
    assert "not a launch spec pitstop can resume" in capsys.readouterr().err
