"""Tier 2: a real DeepSpeed engine at world 2 on CPU/gloo (``examples/train_deepspeed.py``).

* Two runs of the example at ZeRO 1 and at ZeRO 2 give bitwise-identical per-step losses and
  parameter checksums, on pitstop's groups (the example's default); the same numbers come out
  on DeepSpeed's own groups (``--groups deepspeed``).
* Where DeepSpeed keeps process-group references: a walk of the engine, its ZeRO optimizer and
  ``deepspeed.utils.groups`` with :func:`pitstop.runtime.swap.find_groups` finds every holder
  named in ``shared/STACK.md``, and with an mpu DeepSpeed makes no world-wide ``new_group``.
* Every ``mpu`` getter the installed DeepSpeed calls is one the adapters answer.

This file is also the worker of the walk (``python tests/test_deepspeed_engine.py --walk OUT``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

if __name__ != "__main__":
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # chosen when deepspeed is first imported
    pytest.importorskip("deepspeed")
    from conftest import ROOT, wait_done
    from pitstop.launch.local import LocalJob

    SCRIPT = str(ROOT / "examples" / "train_deepspeed.py")

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
STEPS = 4


# ------------------------------------------------------------------------ running
def _run(tmp_path: Path, name: str, *extra: str, world: int = 2):
    """Run the example once (a fresh job and store, as a launch has). Returns (losses, final record)."""
    job = LocalJob(tmp_path / name)
    try:
        ctx = job.start(name, [SCRIPT, "--steps", str(STEPS), *extra], range(world), world,
                        extra_env={r: dict(ENV) for r in range(world)})
        wait_done(job, ctx, timeout=150)
        lines = [json.loads(l) for l in Path(ctx.stdouts[0]).read_text().splitlines() if l.startswith("{")]
    finally:
        job.close()
    steps = [r for r in lines if "step" in r]
    final = [r for r in lines if "checksum" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), lines
    assert len(final) == 1, lines
    return [r["loss_hex"] for r in steps], final[0]


_RESULTS: dict = {}


def _result(tmp_path_factory, stage: int, run: str):
    """The plain run ``run`` ("a" or "b") of ZeRO ``stage``, shared by the tests of this module."""
    key = (stage, run)
    if key not in _RESULTS:
        _RESULTS[key] = _run(tmp_path_factory.mktemp(f"z{stage}{run}"), f"z{stage}{run}", "--zero-stage", str(stage))
    return _RESULTS[key]


@pytest.mark.timeout(330)
@pytest.mark.parametrize("stage", [1, 2])
def test_two_runs_are_bitwise_identical(tmp_path_factory, stage):
    a_loss, a_end = _result(tmp_path_factory, stage, "a")
    b_loss, b_end = _result(tmp_path_factory, stage, "b")
    assert a_loss == b_loss
    assert a_end["checksum"] == b_end["checksum"]
    assert a_end["zero_stage"] == stage
    assert len(set(a_loss)) == STEPS, "the loss should change every step"


@pytest.mark.timeout(480)
def test_zero1_and_zero2_and_pitstop_groups_train_alike(tmp_path_factory, tmp_path):
    """ZeRO 1 and 2 partition the same fp32 Adam update the same way, and pitstop's groups
    (``pitstop.integrations.deepspeed.initialize``: a GroupsMpu over a GroupRegistry) give
    DeepSpeed's own numbers bit for bit."""
    z1 = _result(tmp_path_factory, 1, "a")
    z2 = _result(tmp_path_factory, 2, "a")
    assert z1[0] == z2[0] and z1[1]["checksum"] == z2[1]["checksum"]
    # the runs above are on pitstop's groups (the example's default); DeepSpeed's own groups agree
    own = _run(tmp_path, "own", "--zero-stage", "2", "--groups", "deepspeed")
    assert own[0] == z2[0] and own[1]["checksum"] == z2[1]["checksum"]


# --------------------------------------------------------------- group references
#: shared/STACK.md, "Where DeepSpeed keeps its groups": holder -> attributes that hold groups.
STACK_TABLE = {
    "deepspeed.utils.groups": {"mpu", "_WORLD_GROUP"},
    "engine": {"data_parallel_group", "seq_data_parallel_group", "mpu"},
    "zero12": {"dp_process_group", "real_dp_process_group"},
    "zero3": {"dp_process_group"},
    "zero3-param": {"ds_process_group"},
}


@pytest.mark.timeout(200)
def test_group_references_cover_the_stack_table(job, tmp_path):
    ctx = job.start("walk", [__file__, "--walk", str(tmp_path)], range(2), 2,
                    extra_env={r: dict(ENV) for r in range(2)})
    wait_done(job, ctx, timeout=180)
    res = json.loads((tmp_path / "walk_0.json").read_text())

    def attrs(case, holder):
        return set(res[case]["holders"].get(holder, {}))

    # Without an mpu: the first engine clones the world once (groups._clone_world_group, a new_group
    # over every rank); later engines in the process reuse the clone.
    assert [res[c]["world_new_groups"] for c in ("z1", "z2", "z3")] == [1, 0, 0]
    for case in ("z1", "z2"):
        assert {"_WORLD_GROUP"} <= attrs(case, "deepspeed.utils.groups"), res[case]
        assert {"data_parallel_group", "seq_data_parallel_group"} <= attrs(case, "engine"), res[case]
        assert STACK_TABLE["zero12"] <= attrs(case, "optimizer"), res[case]
        # and one more holder the table lacks: every parameter's _dp_group (tensor-fragment API)
        assert attrs(case, "param") == {"_dp_group"}, res[case]
    # ZeRO-3: the optimizer, its parameter offload, and every parameter (which also points back at
    # the optimizer through _z3_optimizer).
    assert STACK_TABLE["zero3"] <= attrs("z3", "optimizer"), res["z3"]
    assert STACK_TABLE["zero3-param"] <= attrs("z3", "param"), res["z3"]
    assert {"sub_group_process_groups", "parameter_offload"} <= attrs("z3", "optimizer"), res["z3"]
    # Without an mpu ZeRO-3 partitions over the default (world) group itself, not the clone.
    assert res["z3"]["param_group_is_world"] is True
    # With an mpu: groups.mpu and engine.mpu hold it, no world-wide new_group, and the model-parallel
    # group (size 1 here) is a group of its own in the optimizer.
    for case in ("z2-mpu", "z3-mpu"):
        assert res[case]["world_new_groups"] == 0, res[case]
        assert "mpu" in attrs(case, "deepspeed.utils.groups") and "mpu" in attrs(case, "engine"), res[case]
        assert "model_parallel_group" in attrs(case, "optimizer"), res[case]
    assert res["z3-mpu"]["param_group_is_world"] is False
    # The table's holders, all found.
    seen = {h: set() for h in STACK_TABLE}
    for case in res:
        seen["deepspeed.utils.groups"] |= attrs(case, "deepspeed.utils.groups")
        seen["engine"] |= attrs(case, "engine")
        seen["zero12" if case.startswith(("z1", "z2")) else "zero3"] |= attrs(case, "optimizer")
        if case.startswith("z3"):
            seen["zero3-param"] |= attrs(case, "param")
    missing = {h: sorted(a - seen[h]) for h, a in STACK_TABLE.items() if a - seen[h]}
    assert not missing, missing
    # the Megatron mpu at tp 2 x dp 1: DeepSpeed's view of the layout
    meg = res["megatron-tp2"]
    assert meg["engine"] == {"dp_world_size": 1, "mp_world_size": 2, "seq_dp_world_size": 1}
    assert meg["answers"]["get_data_parallel_group_ranks"] == [0]
    assert meg["answers"]["get_tensor_model_parallel_src_rank"] == 0
    assert meg["world_new_groups"] == 0


def test_the_adapters_answer_every_getter_deepspeed_calls():
    """Grep the installed DeepSpeed for ``mpu.get_*`` calls: each one is an adapter method."""
    import importlib.util

    from pitstop.integrations.deepspeed_mpu import MPU_METHODS, GroupsMpu, MegatronMpu

    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    called = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("inference/", "ops/", "module_inject/", "model_implementations/")):
            continue  # inference-only paths
        called |= set(re.findall(r"\bmpu\.(get_\w+)\(", path.read_text(errors="replace")))
    assert len(called) > 15, called
    # the pipeline grid's names for tensor parallel; DeepSpeed falls back to the tensor ones
    not_needed = {"get_slice_parallel_world_size", "get_slice_parallel_rank", "get_slice_parallel_group"}
    assert called - not_needed <= set(MPU_METHODS), sorted(called - not_needed - set(MPU_METHODS))
    for cls in (GroupsMpu, MegatronMpu):
        assert all(callable(getattr(cls, m, None)) for m in MPU_METHODS), cls
        # an mpu with this makes DeepSpeed ignore its data- and model-parallel groups (Ulysses)
        assert not hasattr(cls, "initialize_sequence_parallel")


class _FakeParallelState:
    """Megatron's getter names over sentinel groups (no torch.distributed needed)."""

    def __init__(self, cp: int = 1):
        self.cp = cp
        self.calls = []

    def _g(self, name):
        self.calls.append(name)
        return f"<{name}>"

    def get_data_parallel_group(self, with_context_parallel=False):
        return self._g("dp-cp" if with_context_parallel else "dp")

    def get_tensor_model_parallel_group(self):
        return self._g("tp")

    def get_pipeline_model_parallel_group(self):
        return self._g("pp")

    def get_context_parallel_group(self):
        return self._g("cp")

    def get_model_parallel_group(self):
        return self._g("tp-pp")

    def get_data_parallel_world_size(self):
        return 4

    def get_data_parallel_rank(self):
        return 3

    def get_tensor_model_parallel_world_size(self):
        return 2

    def get_tensor_model_parallel_rank(self):
        return 1

    def get_tensor_model_parallel_src_rank(self):
        return 6

    def get_pipeline_model_parallel_world_size(self):
        return 2

    def get_pipeline_model_parallel_rank(self):
        return 0

    def get_context_parallel_world_size(self):
        return self.cp

    def get_context_parallel_rank(self):
        return 0


def test_megatron_mpu_maps_model_parallel_to_tensor_parallel():
    from pitstop.integrations.deepspeed_mpu import MegatronMpu

    ps = _FakeParallelState()
    mpu = MegatronMpu(ps)
    assert mpu.get_model_parallel_group() == "<tp>"
    assert (mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()) == (2, 1)
    assert (mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()) == (2, 1)
    assert mpu.get_tensor_model_parallel_src_rank() == 6
    assert (mpu.get_data_parallel_group(), mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()) == \
        ("<dp>", 4, 3)
    assert (mpu.get_pipeline_model_parallel_group(), mpu.get_pipe_parallel_group()) == ("<pp>", "<pp>")
    assert (mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipe_parallel_rank()) == (2, 0)
    # cp 1: DeepSpeed's sequence-data-parallel group is the plain dp group (one object, not two)
    assert (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()) == (1, 0)
    assert mpu.get_sequence_data_parallel_group() == "<dp>"
    # "model": Megatron's own tensor x pipeline group
    assert MegatronMpu(ps, model_parallel="model").get_model_parallel_group() == "<tp-pp>"
    with pytest.raises(ValueError, match="model_parallel must be 'tensor' or 'model'"):
        MegatronMpu(ps, model_parallel="pipeline")


def test_megatron_context_parallel_is_deepspeed_sequence_parallel():
    from pitstop.integrations.deepspeed_mpu import GroupsMpu, MegatronMpu

    mpu = MegatronMpu(_FakeParallelState(cp=2))
    assert (mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_world_size()) == ("<cp>", 2)
    assert mpu.get_sequence_data_parallel_group() == "<dp-cp>"
    # a GroupsMpu with cp > 1 but no dp-with-cp group cannot tell ZeRO where to partition
    bad = GroupsMpu(data_parallel=lambda: "<dp>", context_parallel=lambda: "<cp>")
    bad._size = lambda kind: 2 if kind == "cp" else 1  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="needs data_parallel_with_context"):
        bad.get_sequence_data_parallel_group()


def test_the_shm_op_patch_fits_and_reverts():
    """``pitstop.patches.deepspeed_cpu`` fits the installed DeepSpeed, makes ``build_shm_op`` answer
    None (no JIT build) and puts back the very same function. (The runs above use it.)"""
    import importlib

    from pitstop.patches import deepspeed_cpu

    was_applied = deepspeed_cpu.is_applied()
    mod = importlib.import_module("deepspeed.comm.torch")
    deepspeed_cpu.PATCHES.check()
    deepspeed_cpu._check_callers()
    if was_applied:
        deepspeed_cpu.revert()
    original = mod.build_shm_op
    try:
        assert deepspeed_cpu.apply(force=True) is True
        assert mod.build_shm_op is not original and mod.build_shm_op() is None
        assert deepspeed_cpu.apply(force=True) is True  # idempotent
    finally:
        deepspeed_cpu.revert()
    assert mod.build_shm_op is original and not deepspeed_cpu.is_applied()
    if was_applied:
        deepspeed_cpu.apply(force=True)


# ------------------------------------------------------------------ the loss scaler
def _through_the_wire(st):
    """What a peer receives: the snapshot header's JSON form (no pickle)."""
    from pitstop.runtime.state import decode_value, encode_value

    return decode_value(json.loads(json.dumps(encode_value(st))))


def test_a_dynamic_loss_scalers_state_is_carried_exactly():
    """DeepSpeed's real ``DynamicLossScaler`` (what ZeRO 1/2 run with fp16): the state captured
    after an overflow mid-hysteresis crosses the wire and, written into a fresh scaler, makes it
    grow its scale at the very iterations the original does. A fresh scaler left alone does not.
    (The holder stands in for the ZeRO optimizer, which keeps the scaler as ``loss_scaler``.)"""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from pitstop.integrations.deepspeed import loss_scaler_state, set_loss_scaler_state

    def make():
        return DynamicLossScaler(init_scale=2.0 ** 16, scale_window=3, min_scale=1.0, delayed_shift=2,
                                 consecutive_hysteresis=False)

    def holder(scaler):
        return SimpleNamespace(loss_scaler=scaler, custom_loss_scaler=False, external_loss_scale=None)

    leaver = holder(make())
    for _ in range(4):
        leaver.loss_scaler.update_scale(False)  # the scale doubles once the window of 3 is stable
    # an overflow with hysteresis left, as update_scale(True) records it (its logging needs a process group)
    s = leaver.loss_scaler
    s.cur_hysteresis -= 1
    s.last_overflow_iter = s.cur_iter
    s.cur_iter += 1
    st = loss_scaler_state(leaver)
    assert st == {"type": "DynamicLossScaler", "cur_scale": 2.0 ** 17, "cur_iter": 5, "last_overflow_iter": 4,
                  "cur_hysteresis": 1, "custom_loss_scaler": False, "external_loss_scale": None}, st
    joiner, untouched = holder(make()), holder(make())
    set_loss_scaler_state(joiner, _through_the_wire(st))
    assert vars(joiner.loss_scaler) == vars(leaver.loss_scaler)

    def scales(h):
        out = []
        for _ in range(8):
            h.loss_scaler.update_scale(False)
            out.append((h.loss_scaler.cur_scale, h.loss_scaler.cur_hysteresis))
        return out

    expected = scales(leaver)
    assert scales(joiner) == expected
    assert scales(untouched) != expected


def test_the_zero0_optimizers_loss_scale_config_is_carried_and_a_mismatch_is_refused():
    """``FP16_UnfusedOptimizer`` (bf16 or fp16 at ZeRO 0) keeps its scale in a ``LossScaleConfig``;
    a peer's state of another kind of scaler, or a value that is not a plain number, is refused
    by name rather than written."""
    from types import SimpleNamespace

    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig, LossScaleProfile, LossScaler

    from pitstop.errors import RecoveryError
    from pitstop.integrations.deepspeed import loss_scaler_state, set_loss_scaler_state

    def config():
        return LossScaleConfig(low_precision_dtype=torch.float16, dynamic_loss_scale=True, static_loss_scale=1.0,
                               dynamic_loss_args=None, profile=LossScaleProfile.UNFUSED)

    a, b = SimpleNamespace(loss_scale_config=config()), SimpleNamespace(loss_scale_config=config())
    a.loss_scale_config.cur_scale, a.loss_scale_config.cur_iter, a.loss_scale_config.last_overflow_iter = 512.0, 7, 3
    set_loss_scaler_state(b, _through_the_wire(loss_scaler_state(a)))
    assert vars(b.loss_scale_config) == vars(a.loss_scale_config)

    static = SimpleNamespace(loss_scaler=LossScaler(1.0), custom_loss_scaler=False, external_loss_scale=None)
    with pytest.raises(RecoveryError, match="LossScaleConfig.*LossScaler"):
        set_loss_scaler_state(static, loss_scaler_state(a))
    a.loss_scale_config.cur_scale = torch.tensor(512.0)
    with pytest.raises(RecoveryError, match="cur_scale=tensor.*expected a Python number"):
        loss_scaler_state(a)


# ------------------------------------------------------------------ the walk worker
def _walk(out: str) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import train_deepspeed as T
    from pitstop.patches import deepspeed_cpu

    deepspeed_cpu.apply()
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    from pitstop.integrations.deepspeed_mpu import GroupsMpu, MegatronMpu
    from pitstop.runtime.swap import find_groups

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    new_groups = []
    real_new_group = dist.new_group

    def counting_new_group(*a, **k):
        ranks = k.get("ranks", a[0] if a else None)
        new_groups.append(sorted(ranks) if ranks is not None else list(range(world)))
        return real_new_group(*a, **k)

    dist.new_group = counting_new_group

    def holders(obj):
        """{attribute: [group names]} of every attribute of ``obj`` through which a group is reached."""
        wanted = {id(pg): pg for pg in c10d._world.pg_map}
        d = obj if isinstance(obj, dict) else vars(obj)
        out = {}
        for k, v in list(d.items()):
            if isinstance(v, type(sys)):
                continue
            hits = find_groups([{k: v}], wanted)
            if hits:
                out[k] = sorted({name for _, name in hits})
        return out

    def one(stage: int, mpu=None, args_extra=()):
        args = T.parse_args(["--zero-stage", str(stage), *args_extra])
        start = len(new_groups)
        model = T.build_model(args)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=T.ds_config(args),
                                          mpu=mpu)
        T.train_step(engine, T.make_batch(args, 1, groups._get_data_parallel_rank()))
        params = list(engine.module.parameters())
        param_attrs = {}
        for p in params:
            for k, names in holders(p.__dict__).items():
                param_attrs.setdefault(k, sorted(set(names)))
        roots = [engine, engine.optimizer, vars(groups)]
        reached = len(find_groups(roots, {id(pg): pg for pg in c10d._world.pg_map}))
        with_params = len(find_groups(roots + [p.__dict__ for p in params], {id(pg): pg for pg in c10d._world.pg_map}))
        first_param_group = getattr(params[0], "ds_process_group", None)
        rec = {
            "holders": {
                "deepspeed.utils.groups": holders(vars(groups)),
                "deepspeed.comm.comm": holders(vars(ds_comm)),
                "engine": {k: v for k, v in holders(engine).items() if k not in ("optimizer", "_modules")},
                "optimizer": holders(engine.optimizer),
                "param": param_attrs,
            },
            "world_new_groups": sum(1 for g in new_groups[start:] if g == list(range(world))),
            "new_groups": new_groups[start:],
            "param_refs_missed_by_walk": with_params - reached,
            "param_group_is_world": None if first_param_group is None else first_param_group is c10d.GroupMember.WORLD,
            "engine": {"dp_world_size": engine.dp_world_size, "mp_world_size": engine.mp_world_size,
                       "seq_dp_world_size": engine.seq_dp_world_size},
            "cdb": type(ds_comm.cdb).__name__,
        }
        engine.destroy() if hasattr(engine, "destroy") else None
        return rec

    res = {"z1": one(1), "z2": one(2), "z3": one(3)}
    # with pitstop-style groups: a dp group made by its members only, handed over as an mpu
    dp = real_new_group(list(range(world)), use_local_synchronization=True)
    res["z2-mpu"] = one(2, GroupsMpu(data_parallel=lambda: dp))
    res["z3-mpu"] = one(3, GroupsMpu(data_parallel=lambda: dp))
    # Megatron's parallel_state at tp 2 (world 2 = tp 2 x dp 1), groups built by pitstop's drop-in
    from pitstop.integrations.megatron import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=2)
    mpu = MegatronMpu()
    res["megatron-tp2"] = one(2, mpu)
    res["megatron-tp2"]["answers"] = {
        "get_data_parallel_group_ranks": mpu.get_data_parallel_group_ranks(),
        "get_tensor_model_parallel_src_rank": mpu.get_tensor_model_parallel_src_rank(),
        "get_model_parallel_world_size": mpu.get_model_parallel_world_size(),
    }
    Path(out, f"walk_{rank}.json").write_text(json.dumps(res, indent=1, default=str))
    dist.barrier()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--walk":
        sys.exit(_walk(sys.argv[2]))
    sys.exit(f"usage: {sys.argv[0]} --walk OUT_DIR")


#: The start of every one-process DeepSpeed script below: a world of 1 on gloo, the example importable
#: as ``T`` (``sys.argv[1]`` is its folder), DeepSpeed imported with its CPU patch.
_WORLD1 = r"""
import json, os, sys
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import train_deepspeed as T
from pitstop.patches import deepspeed_cpu
import deepspeed
deepspeed_cpu.apply()
store = dist.TCPStore("127.0.0.1", 0, 1, True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
"""


def _world1(script: str, *argv: str) -> dict:
    """Run ``_WORLD1 + script`` in a fresh process (as a joiner is one); its last stdout line, as JSON."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _WORLD1 + script, str(ROOT / "examples"), *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=240, env={**os.environ, **ENV})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_FIRST_BUILD = r"""
from pitstop.integrations.deepspeed import preimport
done = preimport() if sys.argv[2] == "pre" else []
args = T.parse_args(["--zero-stage", "2"])
model = T.build_model(args)
before = set(sys.modules)
deepspeed.initialize(model=model, model_parameters=model.parameters(), config=T.ds_config(args))
print(json.dumps({"preimported": done, "new_modules": len(set(sys.modules) - before)}))
"""


def test_a_first_engine_build_after_preimport_imports_almost_nothing():
    """A joiner's engine build was 0.94 s of imports (``torch._dynamo``; DeepSpeed 0.19's
    ``is_zero_supported_optimizer`` importing its Muon optimizer, whose module-level
    ``torch.compile`` pulls in inductor). ``preimport`` takes them before the standby joins.
    Counted, not timed: without it the first ``deepspeed.initialize`` imports hundreds of
    modules; with it, few. This fails loudly when a DeepSpeed upgrade adds another lazy import."""
    cold, warm = _world1(_FIRST_BUILD, "cold"), _world1(_FIRST_BUILD, "pre")
    assert warm["preimported"] == ["torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer",
                                   "deepspeed.module_inject.auto_ep_config"], warm
    assert cold["new_modules"] > 300, cold  # the premise: the lazy imports are many
    assert warm["new_modules"] < 50, (warm, cold)


_ZERO3_REPR = r"""
import torch._tensor_str as ts
from pitstop.patches import deepspeed_zero3
import deepspeed.runtime.zero.stage3 as s3
original = s3.DeepSpeedZeroOptimizer_Stage3.__init__
if sys.argv[2] == "patched":
    assert deepspeed_zero3.apply() is True
formatted = [0]
real = ts._str
def counted(self, *a, **k):
    formatted[0] += 1
    return real(self, *a, **k)
ts._str = counted  # every Tensor.__repr__ goes through it
args = T.parse_args(["--zero-stage", "3"])
model = T.build_model(args)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=T.ds_config(args))
built = formatted[0]
ts._str = real
names = engine.optimizer.param_names
losses = [float(T.train_step(engine, T.make_batch(args, s, 0))).hex() for s in (1, 2, 3)]
out = {"formatted": built, "names_type": type(names).__name__, "names": len(names),
       "names_equal": dict(names) == engine.param_names, "losses": losses, "checksum": T.checksum(engine)}
if sys.argv[2] == "patched":
    out["applied_was_new"] = s3.DeepSpeedZeroOptimizer_Stage3.__init__ is not original
    deepspeed_zero3.revert()
    out["reverted"] = s3.DeepSpeedZeroOptimizer_Stage3.__init__ is original
print(json.dumps(out))
"""


def test_the_zero3_repr_patch_formats_no_parameter_and_trains_the_same():
    """DeepSpeed 0.19's ZeRO-3 optimizer evaluates ``f"... {locals()}"`` for a message it never
    prints, formatting every parameter's values on each engine build (0.05-0.09 s of a joiner's
    build here). Without the patch the build formats the model's 29 parameters (the premise,
    which fails loudly once upstream stops doing it: then the patch can go); with it, none. The
    optimizer's name lookups, three steps' losses and the final parameters are bitwise the same,
    and ``revert`` puts back the very same ``__init__``."""
    plain, patched = _world1(_ZERO3_REPR, "plain"), _world1(_ZERO3_REPR, "patched")
    assert plain["formatted"] >= plain["names"] == 29, plain
    assert patched["formatted"] == 0, patched
    assert (plain["names_type"], patched["names_type"]) == ("dict", "ParamNames")
    assert patched["names_equal"] and patched["names"] == plain["names"]
    assert patched["losses"] == plain["losses"] and patched["checksum"] == plain["checksum"]
    assert patched["applied_was_new"] is True and patched["reverted"] is True


_TRACE = r"""
from pitstop.errors import RecoveryError
from pitstop.integrations.deepspeed import set_zero3_trace, zero3_trace
import deepspeed.runtime.zero.partitioned_param_coordinator as ppc
args = T.parse_args(["--zero-stage", "3"])
model = T.build_model(args)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=T.ds_config(args))
off = engine.optimizer.parameter_offload
coord = off.get_param_coordinator()
checks = [0]
real = ppc.assert_ints_same_as_other_ranks
def counted(ints):
    checks[0] += 1
    return real(ints)
ppc.assert_ints_same_as_other_ranks = counted  # the trace's recording collectives, counted
mode, arg = sys.argv[2], sys.argv[3]
out = {}
if mode == "load":
    bad = json.loads(arg)
    bad_trace = dict(bad, modules=bad["modules"] + [9999])
    try:
        set_zero3_trace(coord, off.module, bad_trace)
    except RecoveryError as exc:
        out["refused"] = str(exc)
    out["mode_after_refusal"] = zero3_trace(coord, off.module)["mode"]
    set_zero3_trace(coord, off.module, json.loads(json.dumps(bad)))
steps = int(arg) if mode == "dump" else 1
for step in range(1, steps + 1):
    T.train_step(engine, T.make_batch(args, step, 0))
out.update(trace=zero3_trace(coord, off.module), checks=checks[0])
print(json.dumps(out))
"""


def test_zero3s_trace_is_handed_over_by_position_and_spares_the_recording():
    """A joiner used to start with an empty ZeRO-3 trace, so every rank forgot its own and all
    recorded again for two steps (no prefetching, and DeepSpeed's recording checks are world
    collectives). Now the trace travels with the state. Run in separate processes as a joiner
    is: a trace taken after 3 steps (complete) put into a fresh engine keeps it complete through
    its next step with no recording check; one taken after step 1 (recording) completes at the
    next step into the same trace a 3-step run has. A trace that names a module the model does
    not have is refused and leaves the coordinator as it was."""
    def run(*argv):
        return _world1(_TRACE, *argv)

    fresh = run("dump", "1")
    assert fresh["trace"]["mode"] == "record" and fresh["checks"] == 1, fresh  # the counter sees DeepSpeed's check
    full = run("dump", "3")
    assert full["trace"]["mode"] == "complete" and full["checks"] == 4, full
    assert len(full["trace"]["params"]) > 0 and len(full["trace"]["modules"]) > 2, full

    joined = run("load", json.dumps(full["trace"]))
    assert joined["checks"] == 0, joined  # prefetching from the first step, no recording
    assert joined["trace"] == full["trace"], joined
    assert "9999" in joined["refused"] and joined["mode_after_refusal"] == "invalid", joined

    recording = run("load", json.dumps(fresh["trace"]))
    assert recording["checks"] == 3 and recording["trace"] == full["trace"], recording


_IDS = r"""
from pitstop.integrations.deepspeed import set_zero3_id_counters, zero3_id_counters
args = T.parse_args(["--zero-stage", "3"])

def ids():
    model = T.build_model(args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=T.ds_config(args))
    out = {"modules": [m.ds_id for m in model.modules()], "params": [p.ds_id for p in model.parameters()]}
    engine.destroy()
    return out

before = zero3_id_counters()
first = ids()
moved = zero3_id_counters()
second = ids()
set_zero3_id_counters(before)
third = ids()
print(json.dumps({"before": before, "moved": moved, "first": first, "second": second, "third": third}))
"""


def test_zero3s_id_counters_put_back_make_the_next_engine_number_its_model_as_a_fresh_process():
    """A standby's sandboxed ZeRO-3 engine moves DeepSpeed's process-wide ``ds_id`` counters on,
    and ZeRO-3 compares modules' ``ds_id`` across ranks while it records its trace: a joiner
    numbering differently failed that check (``Detected a disagreement on list contents``) when
    it joined at step 2. The sandbox's teardown puts the counters back; here, a second engine in
    one process numbers its model differently (the premise), and one built after the counters
    were put back numbers it exactly as the first. Fails loudly if DeepSpeed moves the counters."""
    r = _world1(_IDS)
    assert r["moved"][0] > r["before"][0] and r["moved"][1] > r["before"][1], r
    assert r["second"] != r["first"], r  # the premise: a second engine numbers its model anew
    assert r["third"] == r["first"], r
    assert len(set(r["first"]["params"])) == len(r["first"]["params"]) > 10, r
