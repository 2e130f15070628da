"""DeepSpeed integration: ``initialize`` is ``deepspeed.initialize`` with pitstop's groups.

::

    engine, optimizer, _, scheduler = pitstop.integrations.deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    session = pitstop.integrations.deepspeed.session(engine, make_data)
    for step in session.steps(last=steps):
        loss = engine(batch); engine.backward(loss); engine.step()
        for s, out in session.commit(step, loss.item()):  # the steps made final, with their reports
            log(s, out)

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
import sys
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from pitstop import pg as pgmod
from pitstop.errors import ConfigError, RecoveryError, require
from pitstop.groups import GroupRegistry
from pitstop.integrations.deepspeed_config import PitstopSection, refuse_unsupported, strip_section
from pitstop.layout import ParallelLayout
from pitstop.runtime import sandbox as _sandbox
from pitstop.runtime.framework import FaultPoints, Framework
from pitstop.runtime.session import Session  # imported here, not by a joiner on the critical path
from pitstop.emulation import runtime as _emulation  # noqa: F401 - plugs `pitstop emulate` into worker.join

log = logging.getLogger(__name__)


class _State:
    registry: Optional[GroupRegistry] = None
    section: Optional[PitstopSection] = None
    mpu: Any = None
    counters: Optional[Tuple[int, int]] = None  # ZeRO-3's id counters before a sandboxed engine build


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


#: Modules the first ``deepspeed.initialize`` of a process imports lazily, the costly part of a
#: joiner's engine build (0.94 s of its 0.95 s on an idle core here; a second engine in the
#: same process builds in 0.01 s):
#:
#: * ``torch._dynamo``: 2 s on an idle core, far more under load. (Pre-importing it was
#:   reverted once, on 2026-12-02, because the drain then failed 2 of 2 in its background
#:   group build; that was the store-client deadlock fixed in 246b6e8 -- a background prepare
#:   and the training thread's verdict wait shared one TCPStore client -- which the import's
#:   shift in timing exposed.)
#: * DeepSpeed 0.19's ``is_zero_supported_optimizer`` imports its Muon optimizer, whose
#:   module-level ``torch.compile`` pulls in all of inductor.
#: * DeepSpeed 0.19's config parser imports its AutoEP (expert-parallel) presets,
#:   ``deepspeed.module_inject.auto_ep_config``, for every engine: 0.04 s of a cold joiner's
#:   build under cProfile.
#:
#: A name an installed DeepSpeed lacks is skipped; ``tests/test_deepspeed_engine.py`` fails
#: loudly when a first engine build imports many modules again.
LAZY_IMPORTS = ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer",
                "deepspeed.module_inject.auto_ep_config")


def preimport() -> List[str]:
    """Import :data:`LAZY_IMPORTS` now (idempotent); returns those that exist. Called by
    :func:`initialize` before the process joins, so that a standby pays for them while it
    waits for a role, not on the critical path of a replacement."""
    import importlib

    done = []
    for name in LAZY_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        done.append(name)
    return done


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None, *, tensor_parallel: int = 1, warmup=None):
    """Same arguments and return value as ``deepspeed.initialize``; pitstop owns the groups.

    ``mpu``: pass Megatron's ``parallel_state`` when the model is a Megatron model whose
    groups pitstop built (``pitstop.integrations.megatron.initialize_model_parallel``);
    it is wrapped in :class:`~.deepspeed_mpu.MegatronMpu`. Otherwise leave it None:
    pitstop builds a data-parallel layout (``tensor_parallel`` ranks per model replica,
    default 1) and its own mpu. ``warmup``: the script's set-up and one training step (it calls
    this function again); a standby runs it in the warmup sandbox while it waits for a role
    (:mod:`pitstop.runtime.sandbox`), replaying rank 0's recorded first iteration, so that its
    engine build and first step after the assignment find every import, DeepSpeed's op
    loaders and first-call code paths warm.
    """
    import torch.distributed as dist

    ds_config, sect = strip_section(_config_of(args, config, config_params))  # validates before anything starts
    refuse_unsupported(ds_config)
    _refuse_moe(model)
    if args is not None and hasattr(args, "deepspeed_config") and config is None and config_params is None:
        args.deepspeed_config = None  # the stripped dict goes in as config=
    deepspeed = require("deepspeed", "deepspeed")
    preimport()  # before worker.join: a standby pays it while it waits for a role
    from pitstop.patches import deepspeed_cpu, deepspeed_zero3

    deepspeed_cpu.apply()  # no JIT build of the shm op on CPU; no-op with CUDA
    deepspeed_zero3.apply()  # a ZeRO-3 optimizer's build does not format every parameter's values
    from pitstop.runtime import worker
    from pitstop.runtime.config import RuntimeConfig

    # inside a standby's sandboxed warmup (``warmup`` calling back into this function) the
    # process has no membership yet: the world is the virtual one the sandbox set up
    sandboxed = _sandbox.active() is not None
    m = None if sandboxed else worker.current()
    if m is None and not sandboxed:
        m = worker.join(sect.runtime_config(RuntimeConfig.from_env()), warmup)
    generation, role = (m.generation, m.role) if m is not None else (0, dist.get_rank())
    timeout_s = m.config.collective_timeout_s if m is not None else RuntimeConfig.from_env().collective_timeout_s
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
            emulation.check_layout(layout)
        if emulation.active() or sandboxed:
            # an emulated world, or a standby's warmup answered from the record: every group is virtual
            from pitstop.virtual import VIRTUAL_BACKEND

            backend = VIRTUAL_BACKEND
        pool = pgmod.world_connections()  # pitstop's world: its store and spare connections
        reg = GroupRegistry(layout, pool.store if pool is not None else c10d._get_default_store(),
                            generation=generation, backend=backend, timeout=timedelta(seconds=timeout_s),
                            gloo_twins=False, deferred=worker.defers_groups(), connections=pool,
                            ring_kind=worker.ring_kind(DEEPSPEED.shard_kind))
        # rank 0 of a fresh controlled job records its set-up and step 1 for standbys to replay
        _sandbox.maybe_start_recording(layout, dist.get_rank(), m)
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
    if sandboxed and _State.counters is None:
        _State.counters = zero3_id_counters()  # put back at the teardown: see zero3_id_counters
    out = deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                               training_data=training_data, lr_scheduler=lr_scheduler, mpu=_State.mpu,
                               dist_init_required=False, collate_fn=collate_fn, config=ds_config)
    log.info("[g%d r%d] DeepSpeed engine on pitstop's groups (%s)%s", generation, role,
             _State.registry.layout.describe(), " in the warmup sandbox" if sandboxed else "")
    return out


def session(engine, make_data, **kw):
    """The iteration-boundary hook for a DeepSpeed training loop (see :class:`pitstop.runtime.session.Session`)."""
    return Session([engine], engine.optimizer, make_data, framework=DEEPSPEED, **kw)


def destroy() -> None:
    """Tear down pitstop's groups of a DeepSpeed job (after training)."""
    reg, _State.registry = _State.registry, None
    if reg is not None:
        reg.destroy()


def _sandbox_teardown() -> None:
    """After a sandboxed iteration (or its failure): no group and no mpu left from the sandbox's
    engine. The process-wide imports, DeepSpeed's compiled op loaders and the allocator's pool
    stay: they are what the warmup is for."""
    destroy()
    _State.mpu = None
    _State.section = None
    counters, _State.counters = _State.counters, None
    if counters is not None:
        set_zero3_id_counters(counters)
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and getattr(groups, "mpu", None) is not None:
        groups.mpu = None  # the sandbox's mpu; the real engine's initialize sets its own


_sandbox.on_teardown(_sandbox_teardown)


# ------------------------------------------------------------------------ ZeRO-3's trace
#: DeepSpeed 0.19's ``PartitionedParameterCoordinator`` keeps its trace in name-mangled private
#: fields. They are read and written here, nowhere else; ``check_zero3_trace_fields`` fails loudly
#: (and a test with it) when an upgrade renames them.
_COORD = "_PartitionedParameterCoordinator__"
ZERO3_TRACE_FIELDS = ("trace_mode", "submodule_order", "param_order", "step_id_module_fetched_for")


def check_zero3_trace_fields(coord) -> None:
    missing = [f for f in ZERO3_TRACE_FIELDS if not hasattr(coord, _COORD + f)]
    if missing or not hasattr(type(coord), _COORD + "ParamInTrace"):
        raise RecoveryError(f"DeepSpeed's parameter coordinator ({type(coord).__module__}) lacks the trace fields "
                            f"{missing or ['ParamInTrace']}: this DeepSpeed is not the one pitstop's ZeRO-3 trace "
                            f"hand-over was written for (0.19)")


def zero3_id_counters() -> Tuple[int, int]:
    """DeepSpeed 0.19's two process-wide ZeRO-3 id counters: the next module ``ds_id`` (the
    mutable default ``count=[0]`` of ``DeepSpeedZeRoOffload._register_deepspeed_module``) and the
    next parameter ``ds_id`` (``zero.Init.param_id``).

    Every rank numbers its model from these, and ZeRO-3 compares the numbers across ranks while
    it records its trace (``assert_ints_same_as_other_ranks`` on the modules' ``ds_id``). A
    standby's sandboxed engine moves them on, so the teardown puts them back: the joiner's
    engine then numbers its model as a fresh process does, as every stayer did."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    defaults = getattr(DeepSpeedZeRoOffload._register_deepspeed_module, "__defaults__", None)
    if not (isinstance(defaults, tuple) and len(defaults) == 1 and isinstance(defaults[0], list)
            and len(defaults[0]) == 1 and isinstance(defaults[0][0], int)
            and isinstance(getattr(Init, "param_id", None), int)):
        raise RecoveryError("DeepSpeed's ZeRO-3 id counters are not where pitstop looks "
                            "(DeepSpeedZeRoOffload._register_deepspeed_module's count=[0], zero.Init.param_id): "
                            "this DeepSpeed is not the one pitstop's sandbox was written for (0.19)")
    return defaults[0][0], Init.param_id


def set_zero3_id_counters(counters: Tuple[int, int]) -> None:
    """Put back what :func:`zero3_id_counters` returned."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    zero3_id_counters()  # the fields are checked before anything is written
    DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = counters[0]
    Init.param_id = counters[1]


def _positions(module) -> Tuple[Dict[int, int], Dict[int, int]]:
    """id(submodule) -> its index in ``module.modules()``, id(param) -> its index in ``parameters()``.

    The trace travels by these positions, which every process building the same model agrees
    on, not by DeepSpeed's ``ds_id``: those come from process-wide counters, so a process that
    built another engine first (a sandbox) numbers the same model differently."""
    return ({id(m): i for i, m in enumerate(module.modules())}, {id(p): i for i, p in enumerate(module.parameters())})


#: The last complete trace's JSON form, per coordinator: a complete trace is frozen (DeepSpeed
#: keeps it as tuples), so the form taken at every commit is reused while the tuples are the same.
_COMPLETE: "weakref.WeakKeyDictionary[Any, Tuple[Any, Any, Dict[str, Any]]]" = weakref.WeakKeyDictionary()


def zero3_trace(coord, module) -> Dict[str, Any]:
    """The coordinator's trace in JSON form, by module and parameter position: its mode; the
    modules recorded so far (``record``, with the steps each was fetched at, by ``ds_id``'s
    place) or the frozen module and parameter orders (``complete``)."""
    check_zero3_trace_fields(coord)
    if coord.is_invalid_trace():
        return {"mode": "invalid"}
    get = lambda name: getattr(coord, _COORD + name)  # noqa: E731
    if coord.is_complete_trace():
        hit = _COMPLETE.get(coord)
        if hit is not None and hit[0] is get("submodule_order") and hit[1] is get("param_order"):
            return hit[2]
    mpos, ppos = _positions(module)
    out: Dict[str, Any] = {"mode": "complete" if coord.is_complete_trace() else "record",
                           "modules": [mpos[id(m)] for m in get("submodule_order")]}
    if out["mode"] == "complete":
        out["params"] = [[ppos[id(p.param)], int(p.step_id_last_used_at)] for p in get("param_order")]
        _COMPLETE[coord] = (get("submodule_order"), get("param_order"), out)
    else:
        by_ds_id = {int(m.ds_id): mpos[id(m)] for m in module.modules() if hasattr(m, "ds_id")}
        out["fetched_at"] = {str(by_ds_id[k]): [int(x) for x in v] for k, v in get("step_id_module_fetched_for").items() if v}
    return out


def set_zero3_trace(coord, module, trace: Any) -> None:
    """Put ``trace`` (from :func:`zero3_trace`, maybe a peer's) into ``coord``, replacing what
    it has; positions are mapped to this process's own modules and parameters. Every rank of the
    new generation does this from the same snapshot step, so all agree on the mode: in
    ``record`` the next forward completes the trace on every rank together (its recording
    collectives), in ``complete`` nobody records and every rank prefetches."""
    import collections

    from deepspeed.runtime.zero.partitioned_param_coordinator import ZeRoTraceMode

    check_zero3_trace_fields(coord)
    mode = trace.get("mode") if isinstance(trace, dict) else None
    if mode not in ("invalid", "record", "complete"):
        raise RecoveryError(f"ZeRO-3 trace mode {mode!r}: expected invalid, record or complete")
    mods = dict(enumerate(module.modules()))
    params = dict(enumerate(module.parameters()))

    def ids(key: str, raw: Any, table: Dict[int, Any], what: str) -> List[int]:
        if not (isinstance(raw, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in raw)):
            raise RecoveryError(f"ZeRO-3 trace {key}: expected a list of ids, got {str(raw)[:80]}")
        unknown = sorted(set(raw) - set(table))
        if unknown:
            raise RecoveryError(f"ZeRO-3 trace names {what} {unknown[:5]} that this model does not have "
                                f"(it has {len(table)}): the joiner built a different model")
        return raw

    # everything is checked before anything changes: a refused trace leaves the coordinator as it was
    order: List[Any] = []
    table: Any = collections.defaultdict(collections.deque)
    in_order: List[Tuple[Any, int]] = []
    if mode != "invalid":
        order = [mods[i] for i in ids("modules", trace.get("modules"), mods, "modules")]
    if mode == "record":
        fetched = trace.get("fetched_at")
        if not (isinstance(fetched, dict) and all(isinstance(v, list) for v in fetched.values())):
            raise RecoveryError(f"ZeRO-3 trace fetched_at: expected {{module id: [step ids]}}, got {str(fetched)[:80]}")
        for k, v in fetched.items():
            if not (k.isdigit() and int(k) in mods and all(isinstance(x, int) for x in v)):
                raise RecoveryError(f"ZeRO-3 trace fetched_at[{k!r}]: expected a module id and step ids")
            table[int(mods[int(k)].ds_id)].extend(v)
    elif mode == "complete":
        pairs = trace.get("params")
        if not (isinstance(pairs, list) and all(isinstance(e, list) and len(e) == 2 and isinstance(e[1], int)
                                                for e in pairs)):
            raise RecoveryError(f"ZeRO-3 trace params: expected [[param id, step id], ...], got {str(pairs)[:80]}")
        in_order = [(params[i], s) for i, s in zip(ids("params", [e[0] for e in pairs], params, "parameters"),
                                                   (e[1] for e in pairs))]
    if not coord.is_invalid_trace():
        coord._invalidate_trace()  # clears the trace, and gathers in flight from a discarded step
    if mode == "record":
        setattr(coord, _COORD + "submodule_order", order)
        setattr(coord, _COORD + "step_id_module_fetched_for", table)
        setattr(coord, _COORD + "trace_mode", ZeRoTraceMode.RECORD)
    elif mode == "complete":
        in_trace = getattr(type(coord), _COORD + "ParamInTrace")
        setattr(coord, _COORD + "submodule_order", tuple(order))
        setattr(coord, _COORD + "param_order", tuple(in_trace(param=p, step_id_last_used_at=s) for p, s in in_order))
        setattr(coord, _COORD + "trace_mode", ZeRoTraceMode.COMPLETE)


# ------------------------------------------------------------------------ the loss scaler
#: What a DeepSpeed loss scaler changes while it trains: ``DynamicLossScaler`` (ZeRO 1/2 with fp16) has all
#: four, ``LossScaleConfig`` (the fp16/bf16 optimizers of ZeRO 0) the first three, the static ``LossScaler``
#: (bf16, fp32 and fp16 with a fixed ``loss_scale``) ``cur_scale`` alone. Its settings (window, factor,
#: minimum, hysteresis depth) come from the config, which the joiner was built from too.
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
#: The optimizer's own override of its scaler (``override_loss_scale``).
SCALER_OVERRIDE_FIELDS = ("custom_loss_scaler", "external_loss_scale")


def loss_scaler_of(optimizer) -> Any:
    """The object that holds ``optimizer``'s loss-scale state, or None (a plain torch optimizer:
    fp32 at ZeRO 0). ZeRO 1/2 keep a ``loss_scaler``; ``FP16_Optimizer`` and
    ``FP16_UnfusedOptimizer`` (fp16 or bf16 at ZeRO 0) a ``loss_scale_config``."""
    for attr in ("loss_scaler", "loss_scale_config"):
        scaler = getattr(optimizer, attr, None)
        if scaler is not None:
            return scaler
    return None


def _scalar(name: str, v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float)):
        return v
    raise RecoveryError(f"loss scaler {name}={v!r}: expected a Python number or None to carry over, got "
                        f"{type(v).__name__}")


def loss_scaler_state(optimizer) -> Dict[str, Any]:
    """The loss scaler's changing fields (and the optimizer's override) as plain numbers: what a
    joiner needs so its next step scales, skips and grows the scale exactly as the role would
    have. JSON-safe (it travels in the snapshot's header); empty when there is no scaler."""
    out: Dict[str, Any] = {}
    scaler = loss_scaler_of(optimizer)
    if scaler is not None:
        out["type"] = type(scaler).__name__
        for f in SCALER_FIELDS:
            if hasattr(scaler, f):
                out[f] = _scalar(f, getattr(scaler, f))
    for f in SCALER_OVERRIDE_FIELDS:
        if hasattr(optimizer, f):
            out[f] = _scalar(f, getattr(optimizer, f))
    return out


def set_loss_scaler_state(optimizer, st: Dict[str, Any]) -> None:
    """Write :func:`loss_scaler_state` of a peer into ``optimizer``. Refuses state of another kind of
    scaler or with other fields (the joiner was built with another precision config)."""
    have = loss_scaler_state(optimizer)
    if not isinstance(st, dict) or sorted(st) != sorted(have) or st.get("type") != have.get("type"):
        raise RecoveryError(f"loss scaler state {st!r}: this role's optimizer has {have.get('type')} with "
                            f"{sorted(have)}: the joiner was built with another precision config")
    scaler = loss_scaler_of(optimizer)
    for f in SCALER_FIELDS:
        if f in st:
            setattr(scaler, f, _scalar(f, st[f]))
    for f in SCALER_OVERRIDE_FIELDS:
        if f in st:
            setattr(optimizer, f, _scalar(f, st[f]))


# ------------------------------------------------------------------- the runtime's adapter
class DeepSpeedFramework(Framework):
    """A DeepSpeed engine with ZeRO stage 0, 1, 2 or 3, data parallel over pitstop's dp group, in fp32
    or bf16 (the optimizer's fp32 master weights are the state; the bf16 parameters are derived;
    at ZeRO-3 each rank's parameter partitions are derived from its fp32 partitions)."""

    name = "deepspeed"
    shard_kind = "dp"

    def registry(self):
        return registry()

    def install(self, reg) -> None:
        install(reg)

    def swap_roots(self, model: Sequence[Any], optimizer) -> List[Any]:
        roots: List[Any] = [list(model), optimizer]
        for mod in ("deepspeed.utils.groups", "deepspeed.comm.comm"):
            if mod in sys.modules:
                roots.append(vars(sys.modules[mod]))  # module globals: a dict the walk can rewrite
        return roots

    @staticmethod
    def _engine(model: Sequence[Any]):
        return model[0]

    def extra_state(self, model: Sequence[Any], optimizer) -> Dict[str, Any]:
        e = self._engine(model)
        out = {k: getattr(e, k) for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")}
        sched = getattr(e, "lr_scheduler", None)
        if sched is not None and hasattr(sched, "state_dict"):
            out["lr_scheduler"] = sched.state_dict()
        out["loss_scaler"] = loss_scaler_state(optimizer)
        if _is_zero3(optimizer):
            off = optimizer.parameter_offload
            out["zero3_trace"] = zero3_trace(off.get_param_coordinator(), off.module)
        return out

    def set_extra_state(self, model: Sequence[Any], optimizer, extra: Dict[str, Any]) -> None:
        e = self._engine(model)
        for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
            if k in extra:
                setattr(e, k, extra[k])
        if "lr_scheduler" in extra and getattr(e, "lr_scheduler", None) is not None:
            e.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if "loss_scaler" in extra:
            set_loss_scaler_state(optimizer, extra["loss_scaler"])
        if "zero3_trace" in extra and _is_zero3(optimizer):
            off = optimizer.parameter_offload
            set_zero3_trace(off.get_param_coordinator(), off.module, extra["zero3_trace"])

    def prepare_rollback(self, model: Sequence[Any], optimizer) -> None:
        # a step discarded mid-backward leaves reduced (or half-reduced) gradients behind
        optimizer.zero_grad(set_to_none=True)
        if _is_zero3(optimizer):
            # parameters gathered for the discarded step go back to their partitions (DeepSpeed's
            # own step before a checkpoint); the partitions are then overwritten by the snapshot
            optimizer.checkpoint_event_prologue()

    def new_generation(self, model: Sequence[Any], optimizer) -> None:
        """ZeRO-3's parameter coordinator keeps the trace it recorded (the order in which
        modules fetch their parameters): a joiner takes the same trace with its state
        (:func:`set_zero3_trace`), so every rank prefetches from the first step after the
        change, and nobody does the trace's recording collectives alone."""
        if _is_zero3(optimizer):
            # with a complete trace DeepSpeed keeps parameters it will soon use again gathered
            # across the boundary; a joiner holds only its persistent ones whole, so those others
            # go back to their partitions here (else a stayer would skip an all-gather the joiner
            # does). Nothing is lost: a partition is the parameter's own.
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            for p in optimizer.parameter_offload.module.parameters():
                if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist:
                    p.ds_active_sub_modules.clear()
                    p.partition(has_been_updated=False)

    def resync_params(self, model: Sequence[Any], optimizer) -> None:
        if _is_zero3(optimizer):
            # the fp32 partitions (the state) -> each parameter's own partition, as DeepSpeed's step
            # ends (a copy onto itself in fp32, where both are one tensor); then the persistent
            # (never partitioned) parameters are all-gathered from the partitions
            for sub_group in range(len(optimizer.fp16_groups)):
                optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)
            optimizer.checkpoint_event_epilogue()
        elif hasattr(optimizer, "update_lp_params"):  # ZeRO 1/2: fp32 partition -> bit16 + all-gather
            optimizer.update_lp_params()
        elif hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
            # ZeRO 0 in bf16/fp16 (FP16_UnfusedOptimizer): every rank holds all fp32 master weights; the
            # low-precision parameters are their rounding, as the optimizer's own step writes them
            for hp_group, lp_group in zip(optimizer.fp32_groups, optimizer.fp16_groups):
                for hp, lp in zip(hp_group, lp_group):
                    lp.data.copy_(hp.data)
        elif hasattr(optimizer, "fp32_groups_flat") and hasattr(optimizer, "fp16_groups_flat"):
            for hp, lp in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups_flat):  # FP16_Optimizer (fused)
                lp.data.copy_(hp.data)

    def save(self, ckpt_dir: str, step: int, model: Sequence[Any], optimizer) -> None:
        """DeepSpeed's own ``save_checkpoint`` (tag ``iter_0000012``), then pitstop's ``latest``
        marker, written by rank 0 once every rank's save returned (DeepSpeed's own ``latest``
        file is not written: pitstop's names the step for the controller)."""
        import torch.distributed as dist

        from pitstop.runtime import checkpoint

        e = self._engine(model)
        tag = checkpoint.iter_dir(ckpt_dir, step).name
        e.save_checkpoint(ckpt_dir, tag=tag, client_state={"pitstop_step": int(step)}, save_latest=False)
        dist.barrier()
        if dist.get_rank() == 0:
            checkpoint._fsync_write(Path(ckpt_dir) / checkpoint.LATEST, str(int(step)))
        dist.barrier()

    def load(self, ckpt_dir: str, model: Sequence[Any], optimizer, step: int) -> int:
        """DeepSpeed's own ``load_checkpoint`` of that tag: module, ZeRO partitions, scheduler, counters."""
        from pitstop.runtime import checkpoint

        path, client = self._engine(model).load_checkpoint(ckpt_dir, tag=checkpoint.iter_dir(ckpt_dir, step).name)
        if path is None or client.get("pitstop_step") != step:
            raise checkpoint.CheckpointError(f"DeepSpeed checkpoint {checkpoint.iter_dir(ckpt_dir, step)}: not loaded "
                                  f"(load_checkpoint returned {path!r}, step {client.get('pitstop_step') if client else None})")
        return step

    def param_buffers(self, model: Sequence[Any], optimizer) -> List[torch.Tensor]:
        flats = getattr(optimizer, "bit16_groups_flat", None)
        if flats is not None:
            return list(flats)
        if _is_zero3(optimizer):  # this rank's parameter partitions, and the persistent parameters whole
            return list(optimizer.fp16_partitioned_groups_flat) + _persistent_whole(optimizer)
        return [p.data for p in self._engine(model).module.parameters()]

    def fault_points(self, model: Sequence[Any], optimizer) -> Tuple[torch.nn.Module, FaultPoints]:
        e = self._engine(model)
        # the engine's reduction entry point, every stage (ZeRO-2 reduces buckets during the
        # backward pass too; this is where it flushes the last one)
        points: FaultPoints = {"optimizer": [(optimizer, "step")], "grad-reduce": [(e, "allreduce_gradients")]}
        if hasattr(optimizer, "update_lp_params"):
            from deepspeed.runtime.zero import stage_1_and_2

            points["param-gather"] = [(stage_1_and_2, "all_gather_dp_groups")]
        return e.module, points


def _persistent_whole(optimizer) -> List[torch.Tensor]:
    """ZeRO-3's persistent parameters (small ones, never partitioned after their first gather),
    each whole. A drain's joiner has not gathered them yet (its first forward would, in an
    all-gather its peers, who hold theirs, never join), so it gets room for each here and the
    leaver's values fill it: what DeepSpeed's own gather leaves (``partition_parameters.py``:
    ``param.data`` the whole tensor, status AVAILABLE)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    out = []
    for p in optimizer.persistent_parameters:
        if p.ds_status != ZeroParamStatus.AVAILABLE:
            p.data = torch.empty(p.ds_shape, dtype=p.ds_tensor.dtype, device=p.ds_tensor.device)
            p.ds_status = ZeroParamStatus.AVAILABLE
        out.append(p.data)
    return out


def _is_zero3(optimizer) -> bool:
    """DeepSpeed's ZeRO-3 optimizer (``DeepSpeedZeroOptimizer_Stage3``), by what pitstop uses of it."""
    return hasattr(optimizer, "fp32_partitioned_groups_flat") and hasattr(optimizer, "parameter_offload")


DEEPSPEED = DeepSpeedFramework()
