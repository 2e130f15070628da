"""DeepSpeed integration: ``initialize`` is ``deepspeed.initialize`` with pitstop's groups.

::

    engine, optimizer, _, scheduler = pitstop.integrations.deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    session = pitstop.integrations.deepspeed.session(engine, make_data)
    for step in session.steps(last=steps):
        loss = engine(batch); engine.backward(loss); engine.step()
        session.commit(step)

What it does, in order (nothing is started before the config is valid):

1. reads the config (a dict, a JSON path, or base64, as DeepSpeed does), takes out
   the ``"pitstop"`` section and validates it (:mod:`.deepspeed_config`); the rest goes
   to DeepSpeed untouched;
2. joins the pitstop job (``pitstop launch``), or a plain torchrun-style world;
3. builds this rank's groups in a :class:`~pitstop.groups.GroupRegistry` (no world
   barrier, generation-prefixed) and hands DeepSpeed an ``mpu`` that answers from the
   registry (:class:`~.deepspeed_mpu.GroupsMpu`), so DeepSpeed never clones the world
   group and every group it holds is one pitstop can swap;
4. calls ``deepspeed.initialize`` with the caller's arguments.

After a delta rebuild the session swaps every reference DeepSpeed keeps (the engine,
the ZeRO optimizer's ``dp_process_group``/``real_dp_process_group``,
``deepspeed.utils.groups``) by walking them (:func:`pitstop.runtime.swap.swap_groups`).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Optional

from pitstop.errors import ConfigError, require
from pitstop.groups import GroupRegistry
from pitstop.integrations.deepspeed_config import PitstopSection, refuse_unsupported, strip_section
from pitstop.layout import ParallelLayout

log = logging.getLogger("pitstop.deepspeed")


class _State:
    registry: Optional[GroupRegistry] = None
    section: Optional[PitstopSection] = None
    mpu: Any = None


def registry() -> Optional[GroupRegistry]:
    return _State.registry


def section() -> Optional[PitstopSection]:
    """The validated ``"pitstop"`` section of the config ``initialize`` was given."""
    return _State.section


def install(reg: GroupRegistry) -> None:
    """After a delta rebuild. The mpu asks the registry at every call, so nothing is
    written here; what DeepSpeed stored is swapped by the session's walk."""
    _State.registry = reg


def _config_of(args, config, config_params):
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ConfigError("pitstop.integrations.deepspeed.initialize: no DeepSpeed config (config=, config_params= "
                          "or args.deepspeed_config)")
    return config


def _refuse_moe(model) -> None:
    """DeepSpeed-MoE keeps expert groups pitstop does not rebuild: refused by name."""
    import sys

    moe = sys.modules.get("deepspeed.moe.layer")
    if model is None or moe is None or not hasattr(model, "modules"):
        return
    for name, mod in model.named_modules():
        if isinstance(mod, moe.MoE):
            raise ConfigError(f"model has a DeepSpeed MoE layer ({name}): expert parallelism through "
                              "deepspeed.moe is not supported")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None, *, tensor_parallel: int = 1, warmup=None):
    """Same arguments and return value as ``deepspeed.initialize``; pitstop owns the groups.

    ``mpu``: pass Megatron's ``parallel_state`` when the model is a Megatron model whose
    groups pitstop built (``pitstop.integrations.megatron.initialize_model_parallel``);
    it is wrapped in :class:`~.deepspeed_mpu.MegatronMpu`. Otherwise leave it None:
    pitstop builds a data-parallel layout (``tensor_parallel`` ranks per model replica,
    default 1) and its own mpu. ``warmup``: reserved for the sandboxed standby warmup.
    """
    import torch.distributed as dist

    ds_config, sect = strip_section(_config_of(args, config, config_params))  # validates before anything starts
    refuse_unsupported(ds_config)
    _refuse_moe(model)
    if args is not None and hasattr(args, "deepspeed_config") and config is None and config_params is None:
        args.deepspeed_config = None  # the stripped dict goes in as config=
    deepspeed = require("deepspeed", "deepspeed")
    from pitstop.patches import deepspeed_cpu

    deepspeed_cpu.apply()  # no JIT build of the shm op on CPU; no-op with CUDA
    from pitstop.runtime import worker
    from pitstop.runtime.config import RuntimeConfig

    m = worker.current()
    if m is None:
        m = worker.join(sect.runtime_config(RuntimeConfig.from_env()), warmup)
    _State.section = sect
    if mpu is not None:
        from pitstop.integrations import megatron as meg
        from pitstop.integrations.deepspeed_mpu import MegatronMpu

        if meg.registry() is None:
            raise ConfigError("mpu= given, but pitstop did not build Megatron's groups: call "
                              "pitstop.integrations.megatron.initialize_model_parallel first")
        _State.registry = meg.registry()
        _State.mpu = mpu if hasattr(mpu, "get_model_parallel_world_size") else MegatronMpu(mpu)
    else:
        world = dist.get_world_size()
        if tensor_parallel < 1 or world % tensor_parallel:
            raise ConfigError(f"tensor_parallel({tensor_parallel}) must divide world_size({world})")
        layout = ParallelLayout(world, tp=tensor_parallel)
        from torch.distributed import distributed_c10d as c10d

        from pitstop.emulation import runtime as emulation

        backend = None
        if emulation.active():
            from pitstop.emulation.virtual import VIRTUAL_BACKEND

            emulation.check_layout(layout)
            backend = VIRTUAL_BACKEND
        reg = GroupRegistry(layout, c10d._get_default_store(), generation=m.generation, backend=backend,
                            timeout=timedelta(seconds=m.config.collective_timeout_s), gloo_twins=False,
                            deferred=worker.defers_groups())
        reg.build()
        if emulation.active():
            emulation.groups_ready(len(reg.entries()))
        _State.registry = reg
        from pitstop.integrations.deepspeed_mpu import GroupsMpu

        _State.mpu = GroupsMpu(data_parallel=lambda: _State.registry.group("dp"),
                               tensor_parallel=lambda: _State.registry.group("tp"),
                               pipeline_parallel=lambda: _State.registry.group("pp"),
                               singleton=lambda: _State.registry.group("pp"))
    os.environ.setdefault("LOCAL_RANK", "0")
    out = deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                               training_data=training_data, lr_scheduler=lr_scheduler, mpu=_State.mpu,
                               dist_init_required=False, collate_fn=collate_fn, config=ds_config)
    log.info("[g%d r%d] DeepSpeed engine on pitstop's groups (%s)", m.generation, m.role,
             _State.registry.layout.describe())
    return out


def session(engine, make_data, **kw):
    """The iteration-boundary hook for a DeepSpeed training loop (see :class:`pitstop.runtime.session.Session`)."""
    from pitstop.runtime.framework import DEEPSPEED
    from pitstop.runtime.session import Session

    return Session([engine], engine.optimizer, make_data, framework=DEEPSPEED, **kw)


def destroy() -> None:
    """Tear down pitstop's groups of a DeepSpeed job (after training)."""
    reg, _State.registry = _State.registry, None
    if reg is not None:
        reg.destroy()
