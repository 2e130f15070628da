"""Megatron-Core integration: pitstop builds the groups, one function installs them.

``initialize_model_parallel(...)`` is a drop-in for
``megatron.core.parallel_state.initialize_model_parallel``: same arguments, same
resulting ``parallel_state`` answers, but every group comes from pitstop's
:class:`~pitstop.groups.GroupRegistry` (per rank, generation-prefixed, no world
barrier). :func:`install` is the only function that writes ``parallel_state``'s
globals; :func:`restore` puts back what was there before.

``install`` discovers the globals of the installed megatron-core: every module-level
``_UPPER_CASE`` variable of ``parallel_state``. Each must be one pitstop knows how to
fill (``_SLOTS``) or knows to leave alone; an unknown one (a newer megatron-core's
new group, say) stops the install with its name, before anything is written.
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Tuple

from pitstop import pg as pgmod
from pitstop.errors import InstallError, require
from pitstop.groups import SOLO, GroupRegistry
from pitstop.layout import ParallelLayout
from pitstop.logtag import tag
from pitstop.runtime import sandbox as _sandbox
from pitstop.runtime.framework import Framework
from pitstop.runtime.session import Session  # imported here, not by a joiner on the critical path
from pitstop.emulation import runtime as _emulation  # noqa: F401 - plugs `pitstop emulate` into worker.join

log = logging.getLogger(__name__)

# global -> (kind, what): what is "group", "gloo" or "ranks"
_SLOTS: Dict[str, Tuple[str, str]] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": ("tp", "group"),
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": ("tp", "ranks"),
    "_PIPELINE_MODEL_PARALLEL_GROUP": ("pp", "group"),
    "_PIPELINE_GLOBAL_RANKS": ("pp", "ranks"),
    "_MODEL_PARALLEL_GROUP": ("tp-pp", "group"),
    "_MODEL_PARALLEL_GLOBAL_RANKS": ("tp-pp", "ranks"),
    "_EMBEDDING_GROUP": ("embd", "group"),
    "_EMBEDDING_GLOBAL_RANKS": ("embd", "ranks"),
    "_POSITION_EMBEDDING_GROUP": ("pos-embd", "group"),
    "_POSITION_EMBEDDING_GLOBAL_RANKS": ("pos-embd", "ranks"),
    "_DATA_PARALLEL_GROUP": ("dp", "group"),
    "_DATA_PARALLEL_GROUP_GLOO": ("dp", "gloo"),
    "_DATA_PARALLEL_GLOBAL_RANKS": ("dp", "ranks"),
    "_DATA_PARALLEL_GROUP_WITH_CP": ("dp-cp", "group"),
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": ("dp-cp", "gloo"),
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": ("dp-cp", "ranks"),
    # one distributed-optimizer instance: the partial groups are the whole ones
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": ("dp-cp", "group"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": ("dp-cp", "gloo"),
    "_CONTEXT_PARALLEL_GROUP": ("cp", "group"),
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": ("cp", "ranks"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP": ("tp-dp", "group"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": ("tp-dp-cp", "group"),
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": ("tp-cp", "group"),
    "_EXPERT_MODEL_PARALLEL_GROUP": ("ep", "group"),
    "_EXPERT_MODEL_PARALLEL_RANKS": ("ep", "ranks"),
    "_EXPERT_TENSOR_PARALLEL_GROUP": ("etp", "group"),
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ("tp-ep", "group"),
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ("tp-ep-pp", "group"),
    "_EXPERT_DATA_PARALLEL_GROUP": ("edp", "group"),
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": ("edp", "gloo"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": ("edp", "group"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": ("edp", "gloo"),
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": ("intra-dist-opt", "group"),
    # megatron-core 0.19: generalized tensor parallelism's weight-remat axis. pitstop supports
    # gtp_remat_size == 1 only, where Megatron makes each "with GTP remat" group the plain one and
    # the weight-remat groups singletons (GroupRegistry.solo).
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("dp", "group"),
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": ("dp-cp", "group"),
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": ("dp-cp", "group"),
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("edp", "group"),
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": ("edp", "group"),
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": ("tp-ep-pp", "group"),
    "_GTP_WEIGHT_REMAT_GROUP": (SOLO, "group"),
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": (SOLO, "ranks"),
    "_EXPERT_GTP_WEIGHT_REMAT_GROUP": (SOLO, "group"),
    "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": (SOLO, "ranks"),
}

# Globals with a fixed value after Megatron's own initialisation with pitstop's options.
_FIXED: Dict[str, Callable[[ParallelLayout, Any], Any]] = {
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": lambda lay, old: None,  # create_all_gather_group=False
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": lambda lay, old: None,  # one dist-opt instance
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": lambda lay, old: None,
    "_HYBRID_DP_CP_GROUPS": lambda lay, old: {},
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": lambda lay, old: 0 if lay.vpp else None,
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": lambda lay, old: lay.vpp,
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": lambda lay, old: old,
}

# Megatron's "override" globals (set_*_world_size / set_*_rank); None = ask the group.
_MPU_OVERRIDE = re.compile(r"_MPU_[A-Z_]+")
_GLOBAL = re.compile(r"_[A-Z][A-Z0-9_]*")

# Options of Megatron's initialize_model_parallel that pitstop does not implement yet.
_UNSUPPORTED = {
    "pipeline_model_parallel_comm_backend": None,
    "use_sharp": False,
    "hierarchical_context_parallel_sizes": None,
    "hybrid_context_parallel": False,
    "num_distributed_optimizer_instances": 1,
    "nccl_communicator_config_path": None,
    "get_embedding_ranks": None,
    "get_position_embedding_ranks": None,
    "high_priority_stream_groups": None,
    "sharp_enabled_group": None,
    "create_all_gather_group": False,
    # megatron-core 0.19
    "gtp_remat_size": 1,
    "expert_gtp_remat_size": 1,
    "rank_offset": 0,
    "local_world_size": None,
}


class _State:
    registry: Optional[GroupRegistry] = None
    saved: Optional[Dict[str, Any]] = None
    gloo: Optional[bool] = None


def _parallel_state():
    return require("megatron.core.parallel_state", "megatron")


def discover_globals(ps=None) -> Dict[str, str]:
    """Every group-state global of the installed ``parallel_state``, and how pitstop fills it.

    Raises :class:`InstallError` naming any global pitstop does not know.
    """
    ps = ps or _parallel_state()
    out: Dict[str, str] = {}
    unknown = []
    for name, value in vars(ps).items():
        if not _GLOBAL.fullmatch(name) or callable(value) or isinstance(value, type(ps)):
            continue
        if name in _SLOTS:
            out[name] = "slot"
        elif name in _FIXED:
            out[name] = "fixed"
        elif _MPU_OVERRIDE.fullmatch(name):
            out[name] = "override"
        elif name == "_GLOBAL_MEMORY_BUFFER":
            out[name] = "buffer"
        else:
            unknown.append(name)
    if unknown:
        from importlib.metadata import version

        raise InstallError(
            f"megatron-core {version('megatron-core')}: parallel_state has global(s) "
            f"{', '.join(sorted(unknown))} that pitstop does not know how to fill; refusing to "
            "install a half-initialised parallel state (nothing was written)"
        )
    out["_global_process_group_list"] = "list"
    return out


def install(registry: GroupRegistry, create_gloo_process_groups: Optional[bool] = None) -> None:
    """Write the registry's groups into every ``parallel_state`` global (the only writer).

    Called again after a ``replace``, it swaps in the rebuilt groups. The values
    before the first install are kept for :func:`restore`.
    """
    if create_gloo_process_groups is None:  # a re-install keeps the first install's choice
        create_gloo_process_groups = True if _State.gloo is None else _State.gloo
    ps = _parallel_state()
    plan = discover_globals(ps)
    layout = registry.layout
    values: Dict[str, Any] = {}
    for name, how in plan.items():
        old = getattr(ps, name)
        if how == "slot":
            kind, what = _SLOTS[name]
            entry = registry.solo() if kind == SOLO else registry.entry(kind)
            if entry is None:
                values[name] = None
            elif what == "group":
                values[name] = entry.group
            elif what == "gloo":
                values[name] = entry.gloo if create_gloo_process_groups else None
            else:
                values[name] = entry.ranks
        elif how == "fixed":
            values[name] = _FIXED[name](layout, old)
        elif how == "override":
            values[name] = None
        elif how == "buffer":
            values[name] = old if old is not None else ps.GlobalMemoryBuffer()
        else:  # the list Megatron keeps for update_pg_timeout: its creation order
            values[name] = [None] + [
                g
                for kind, e in registry.entries().items()
                if kind in layout.kinds()
                for g in ((e.group, e.gloo) if create_gloo_process_groups and e.gloo is not None else (e.group,))
            ]
    if _State.saved is None:
        _State.saved = {name: getattr(ps, name) for name in plan}
    for name, value in values.items():
        setattr(ps, name, value)
    _State.registry = registry
    _State.gloo = create_gloo_process_groups
    log.info(
        "%s installed %d parallel_state globals (%s)",
        tag(registry.generation, registry.rank), len(values), layout.describe(),
    )


def restore() -> None:
    """Put back every ``parallel_state`` global as it was before the first :func:`install`."""
    if _State.saved is None:
        return
    ps = _parallel_state()
    for name, value in _State.saved.items():
        setattr(ps, name, value)
    _State.saved = None
    _State.registry = None
    _State.gloo = None


def registry() -> Optional[GroupRegistry]:
    """The registry whose groups are installed, if any."""
    return _State.registry


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes=None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups=None,
    sharp_enabled_group=None,
    create_all_gather_group: bool = False,
    *,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    rank_offset: int = 0,
    local_world_size: Optional[int] = None,
    store=None,
    generation: Optional[int] = None,
    backend: Optional[str] = None,
) -> GroupRegistry:
    """Drop-in for Megatron's ``initialize_model_parallel``, with pitstop-owned groups.

    Takes Megatron's arguments (see its docstring; 0.19's new ones, which Megatron-LM passes
    by keyword, are keyword-only here) plus pitstop's keyword-only
    ``store`` (the control store; default: the default group's store),
    ``generation`` and ``backend``. Returns the :class:`GroupRegistry`.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    given = dict(locals())
    ps = _parallel_state()
    for name, default in _UNSUPPORTED.items():
        if (given[name] or None) != (default or None):  # [] and None both mean "not asked for"
            raise InstallError(
                f"initialize_model_parallel({name}={given[name]!r}): pitstop supports only "
                f"{name}={default!r} so far; use Megatron's own initialize_model_parallel for it"
            )
    if not dist.is_initialized():
        raise InstallError("torch.distributed is not initialised: call init_process_group (or pitstop.pg.init_world) first")
    if ps.model_parallel_is_initialized() or _State.registry is not None:
        raise InstallError("model parallel groups are already initialised; call destroy_model_parallel() first")
    layout = ParallelLayout(
        dist.get_world_size(),
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        etp=expert_tensor_parallel_size,
        order=order,
        vpp=virtual_pipeline_model_parallel_size,
    )
    from pitstop.runtime import sandbox

    from pitstop.emulation import runtime as emulation

    if emulation.active():
        emulation.check_layout(layout)
    if sandbox.active() is not None or emulation.active():
        # a standby's warmup (answered from the record) or an emulated world: every group is virtual
        from pitstop.virtual import VIRTUAL_BACKEND

        backend = VIRTUAL_BACKEND
    pool = pgmod.world_connections() if store is None else None  # pitstop's world: its store and spare connections
    reg = GroupRegistry(
        layout,
        store if store is not None else pool.store if pool is not None else c10d._get_default_store(),
        generation=_default_generation() if generation is None else generation,
        backend=backend,
        timeout=_group_timeout(distributed_timeout_minutes),
        gloo_twins=create_gloo_process_groups,
        deferred=_defers_groups(),
        ring_kind=_ring_kind(),
        connections=pool,
    )
    from pitstop.runtime.worker import current

    sandbox.maybe_start_recording(layout, dist.get_rank(), current())
    reg.build()
    install(reg, create_gloo_process_groups)
    if emulation.active():
        emulation.groups_ready(len(reg.entries()))
    return reg


def _group_timeout(distributed_timeout_minutes: int) -> timedelta:
    """Inside a pitstop job, every communicator uses pitstop's collective timeout
    (``--pitstop-collective-timeout``): a stayer blocked on a dead peer must give up on
    pitstop's schedule, not after Megatron's ``distributed_timeout_minutes``. Outside
    one, Megatron's value stands."""
    from pitstop.runtime.worker import current

    m = current()
    if m is not None and m.controlled:
        return timedelta(seconds=m.config.collective_timeout_s)
    return timedelta(minutes=distributed_timeout_minutes)


def _defers_groups() -> bool:
    """A joiner builds its model while its communicators rendezvous in the background."""
    from pitstop.runtime.worker import defers_groups

    return defers_groups()


def _ring_kind() -> Optional[str]:
    """The buddy ring's private communicators, when the boundary exchanges in the background."""
    from pitstop.runtime.worker import ring_kind

    return ring_kind(MEGATRON.shard_kind)


def _default_generation() -> int:
    """The generation this process joins at: 0 for a first start, g+1 for a joiner."""
    from pitstop.runtime.worker import current

    m = current()
    return m.generation if m is not None else 0


def destroy_model_parallel() -> None:
    """Destroy pitstop's groups and restore ``parallel_state`` (Megatron's destroy, for pitstop)."""
    reg = _State.registry
    restore()
    if reg is not None:
        reg.destroy()


# ---------------------------------------------------------------------------- launch flags
def add_pitstop_args(parser):
    """Megatron-LM ``extra_args_provider``: ``--pitstop-*`` flags for the worker runtime.

    Pass it as ``pretrain(..., extra_args_provider=add_pitstop_args)`` (or call it on
    your own parser). The flags are generated from :data:`pitstop.settings.SETTINGS`, as
    ``pitstop launch``'s and the DeepSpeed section's keys are. Defaults come from the
    environment that ``pitstop launch`` sets, so the flags only override.
    :func:`runtime_config` turns the parsed arguments into a validated
    :class:`~pitstop.runtime.config.RuntimeConfig`.
    """
    from pitstop.runtime.config import RuntimeConfig
    from pitstop.settings import add_flags

    g = parser.add_argument_group("pitstop", "standby replacement and drain (see `pitstop launch --help`)")
    add_flags(g, script=True, defaults=RuntimeConfig.from_env().settings())
    return parser


def runtime_config(args) -> "Any":
    """The validated runtime settings of parsed ``--pitstop-*`` flags (errors name the flag's value)."""
    from pitstop.runtime.config import RuntimeConfig
    from pitstop.settings import given_flags, runtime_fields

    return RuntimeConfig(**runtime_fields(given_flags(args, script=True)))


def init_distributed(config=None, warmup=None):
    """Join the job (authenticate, take a role, start the world group): call instead of
    ``torch.distributed.init_process_group``. A standby returns once it has a role.

    ``warmup``: a function that repeats the script's start for whatever role the
    sandbox plays (build the model parallel groups, model, optimizer and data, run one
    training step, tear down) and returns that step's outputs. A standby runs it
    before it is needed, so its first real iteration runs at full speed."""
    from pitstop.runtime import worker

    return worker.join(config, warmup)


def session(model, optimizer, make_data, **kw):
    """The iteration-boundary hook for a Megatron training loop (see :class:`pitstop.runtime.session.Session`)."""
    kw.setdefault("framework", MEGATRON)
    return Session(model, optimizer, make_data, **kw)


class MegatronFramework(Framework):
    """The runtime's adapter for Megatron-Core: its groups are the ones :func:`install` wrote."""

    def registry(self):
        return registry()

    def install(self, reg) -> None:
        install(reg)

    def new_generation(self, model, optimizer) -> None:
        """megatron-core 0.19's optimizers all-reduce, once, whether any rank holds a separate
        grad-norm group, and cache the answer (``_has_grad_norm_group_cache``). A joiner's
        fresh optimizer asks at its first step; every stayer forgets the answer so that it
        asks again, in the same step, and nobody waits on a collective the others skip."""
        from pitstop.runtime.state import sub_optimizers

        for opt in [optimizer, *sub_optimizers(optimizer)]:
            if getattr(opt, "_has_grad_norm_group_cache", None) is not None:
                opt._has_grad_norm_group_cache = None


MEGATRON = MegatronFramework()


def _sandbox_teardown() -> None:
    """After a sandboxed iteration (or its failure): no group, no installed ``parallel_state``."""
    if registry() is not None:
        destroy_model_parallel()


_sandbox.on_teardown(_sandbox_teardown)
