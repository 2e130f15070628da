"""pitstop's hooks in Megatron-LM's own loop (``megatron.training``, megatron-core 0.19.x).

Each hook is one :class:`~pitstop.patches.Patch`: the upstream function's parameter names and
the source lines the hook relies on are checked before anything is replaced, so a release that
moves a seam fails here, by name, instead of training without pitstop. The behaviour behind the
hooks lives in :mod:`pitstop.integrations.megatron_lm`; see its docstring for the picture.

Every hook passes through outside a pitstop job, except that the ``--pitstop-*`` flags are
always added (a script launched by plain ``torchrun`` still parses its launch line).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

from pitstop.patches._base import Patch, PatchSet

__all__ = ["PATCHES", "apply", "revert", "is_applied"]

REQUIRES = ">=0.19,<0.20"
_MT = "megatron.training"


class Hooks:
    """What the hooks do, handed in by :mod:`pitstop.integrations.megatron_lm` at :func:`apply`
    (patches sit below the integrations and never import them). Every method has a
    pass-through meaning outside a pitstop job."""

    def in_job(self) -> bool:
        raise NotImplementedError

    def compose_args_provider(self, user):
        raise NotImplementedError

    def join(self, args) -> None:
        """Join the job (``torch.distributed`` not yet initialised)."""
        raise NotImplementedError

    def refuse(self, what: str) -> None:
        raise NotImplementedError

    def initialize_model_parallel(self, *args, **kwargs) -> None:
        raise NotImplementedError

    def after_setup(self, model, optimizer, scheduler) -> None:
        raise NotImplementedError

    def after_data(self, train_dataloader) -> None:
        raise NotImplementedError

    def train_step(self, original, *args, **kwargs):
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def step_discarded(self) -> bool:
        """Whether the step running now will be thrown away (a peer failed in it)."""
        raise NotImplementedError

    def joined_mid_run(self) -> bool:
        """Whether this process took its role after the job began (a standby)."""
        raise NotImplementedError

    def emulating(self) -> bool:
        """Whether this process runs under ``pitstop emulate``."""
        raise NotImplementedError

    def emulated_batch(self, batch: dict, call: dict) -> dict:
        """``get_batch_on_this_tp_rank``'s batch under emulation (``call``: its arguments)."""
        raise NotImplementedError

    def before_log(self, total_loss_dict: dict) -> None:
        """``training_log`` is about to add an iteration to Megatron-LM's running sums."""
        raise NotImplementedError

    def after_log(self, total_loss_dict: dict) -> None:
        """``training_log`` added it (and reset the sums if it printed a line)."""
        raise NotImplementedError

    def pretrain_called(self, run) -> None:
        """The script called ``pretrain``; ``run()`` calls it again with the same arguments
        (a standby's sandboxed warmup runs the script's own set-up and first step that way)."""
        raise NotImplementedError


class _Holder:
    hooks: Hooks = None  # type: ignore[assignment]
    pending_loader = None


def _lm() -> Hooks:
    return _Holder.hooks


# ------------------------------------------------------------------------------ replacements
def _parse_args(original):
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        if not getattr(extra_args_provider, "pitstop_composed", False):
            extra_args_provider = _lm().compose_args_provider(extra_args_provider)
        return original(extra_args_provider, ignore_unknown_args)

    return parse_args


def _pretrain(original):
    """Remember how the script called ``pretrain`` (its providers, its forward step), so that a
    standby can run the same set-up and one iteration in its warmup sandbox."""

    @functools.wraps(original)
    def pretrain(*args, **kwargs):
        _lm().pretrain_called(functools.partial(original, *args, **kwargs))
        return original(*args, **kwargs)

    return pretrain


def _initialize_distributed(original):
    @functools.wraps(original)
    def _initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store,
                                skip_model_parallel_init=False):
        lm = _lm()
        if lm.in_job():
            import torch.distributed as dist

            from megatron.training import get_args

            if skip_model_parallel_init:
                lm.refuse("pretrain(skip_model_parallel_init=True): under pitstop the model parallel groups are "
                          "pitstop's; let Megatron-LM initialise them")
            if not dist.is_initialized():
                lm.join(get_args())  # a standby returns from here once it has a role
        return original(get_embedding_ranks, get_position_embedding_ranks, store, skip_model_parallel_init)

    return _initialize_distributed


class _MpuRedirect(types.ModuleType):
    """``parallel_state`` as ``megatron.training.initialize`` sees it: inside a pitstop job its
    ``initialize_model_parallel`` is pitstop's drop-in; everything else is the real module."""

    def __init__(self, real: types.ModuleType):
        super().__init__(real.__name__)
        self.__dict__["_pitstop_real"] = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_pitstop_real"], name)

    def initialize_model_parallel(self, *args, **kwargs):
        lm = _lm()
        if not lm.in_job():
            return self.__dict__["_pitstop_real"].initialize_model_parallel(*args, **kwargs)
        lm.initialize_model_parallel(*args, **kwargs)  # Megatron-LM ignores the return value

    def __repr__(self) -> str:
        return f"<pitstop redirect of {self.__dict__['_pitstop_real'].__name__} for {_MT}.initialize>"


def _mpu(real):
    return _MpuRedirect(real)


def _setup_model_and_optimizer(original):
    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = original(*args, **kwargs)
        _lm().after_setup(model, optimizer, scheduler)
        return model, optimizer, scheduler

    return setup_model_and_optimizer


def _build_loaders(original):
    @functools.wraps(original)
    def build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider):
        loaders = original(build_train_valid_test_datasets_provider)
        _Holder.pending_loader = loaders[0]
        return loaders

    return build_train_valid_test_data_loaders


def _build_iterators(original):
    @functools.wraps(original)
    def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
        _Holder.pending_loader = None
        iterators = original(build_train_valid_test_datasets_provider)
        loader, _Holder.pending_loader = _Holder.pending_loader, None
        _lm().after_data(loader)
        return iterators

    return build_train_valid_test_data_iterators


def _train_step(original):
    @functools.wraps(original)
    def train_step(*args, **kwargs):
        return _lm().train_step(original, *args, **kwargs)

    return train_step


def _train(original):
    @functools.wraps(original)
    def train(*args, **kwargs):
        out = original(*args, **kwargs)
        _lm().finish()
        return out

    return train


def _reduce_any(original):
    """Megatron-LM's rerun state machine all-reduces, over the world, every step, whether any
    rank asks to rerun it (``--rerun-mode validate_results``, the default: a NaN loss or grad
    norm asks). In a step a peer died in, garbage flowing through the groups still whole can
    make some ranks ask and not others, and the world's reduction is abandoned: each rank
    would go by its own answer, the ones that rerun wait forever on the ones that do not.
    Such a step is discarded and redone anyway, so every rank answers "no rerun"."""

    @functools.wraps(original)
    def _reduce_any(self, value):
        out = original(self, value)
        if _lm().step_discarded():
            return tuple(False for _ in value) if isinstance(value, list) else False
        return out

    return _reduce_any


def _training_log(original):
    """Megatron-LM logs a process's first iteration even off ``--log-interval`` and does not
    reset its loss sum there (``should_reset = not is_first_iteration``), so the next line
    averages two iterations: right for a job that just started, wrong for a standby that took
    a role in the middle of one (the uninterrupted run logged neither). A joiner's first
    iteration is logged as any other. Around the call the integration sees the running sums
    (``total_loss_dict``, a local of ``train``): a joiner starts from its predecessor's, so that
    with ``--log-interval`` > 1 its first line averages the whole interval."""

    @functools.wraps(original)
    def training_log(*args, **kwargs):
        lm = _lm()
        if kwargs.get("is_first_iteration") and lm.joined_mid_run():
            kwargs["is_first_iteration"] = False
        total = args[1] if len(args) > 1 else kwargs["total_loss_dict"]
        lm.before_log(total)
        out = original(*args, **kwargs)
        lm.after_log(total)
        return out

    return training_log


def _get_batch_on_this_tp_rank(original):
    """Under ``pitstop emulate``, a tensor-parallel rank whose tp rank 0 (the one that reads
    the data and broadcasts it) is virtual receives nothing real: the broadcasts still run
    (they are timed and paced like any), then the integration fills the batch with sane data
    of the same shapes. Outside emulation it returns Megatron's batch untouched."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(*args, **kwargs):
        batch = original(*args, **kwargs)
        if not _lm().emulating():  # every microbatch of a training run: no binding there
            return batch
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return _lm().emulated_batch(batch, dict(bound.arguments))

    return get_batch_on_this_tp_rank


# ---------------------------------------------------------------------------------- the set
_PRETRAIN_PARAMS = ("cfg_container", "train_valid_test_dataset_provider", "model_type", "forward_step_func",
                    "model_provider", "process_non_loss_data_func", "get_embedding_ranks",
                    "get_position_embedding_ranks", "non_loss_data_func", "store", "inprocess_call_wrapper",
                    "p2p_communicator", "pg_collection", "skip_model_parallel_init")


def _build() -> PatchSet:
    return PatchSet("megatron_lm", [
        # both names a script may import it by (``from megatron.training import pretrain``)
        Patch(
            name="megatron_lm.training.pretrain",
            module=f"{_MT}.training", attr="pretrain", replacement=_pretrain, params=_PRETRAIN_PARAMS,
            requires=REQUIRES, source_contains=("initialize_megatron(", "setup_model_and_optimizer(", "train("),
        ),
        Patch(
            name="megatron_lm.pretrain",
            module=_MT, attr="pretrain", replacement=_pretrain, params=_PRETRAIN_PARAMS,
            requires=REQUIRES, source_contains=("initialize_megatron(", "setup_model_and_optimizer(", "train("),
        ),
        Patch(
            name="megatron_lm.arguments.parse_args",
            module=f"{_MT}.arguments", attr="parse_args", replacement=_parse_args,
            params=("extra_args_provider", "ignore_unknown_args"), requires=REQUIRES,
            source_contains=("parser = extra_args_provider(parser)",),
        ),
        Patch(
            name="megatron_lm.initialize._initialize_distributed",
            module=f"{_MT}.initialize", attr="_initialize_distributed", replacement=_initialize_distributed,
            params=("get_embedding_ranks", "get_position_embedding_ranks", "store", "skip_model_parallel_init"),
            requires=REQUIRES,
            # already initialised (pitstop joined first): Megatron-LM takes the world as it is
            source_contains=("if torch.distributed.is_initialized():",
                             "args.rank = torch.distributed.get_rank()",
                             "mpu.initialize_model_parallel("),
        ),
        Patch(
            name="megatron_lm.initialize.mpu",
            module=f"{_MT}.initialize", attr="mpu", replacement=_mpu, params=None, requires=REQUIRES,
            source_contains=("from megatron.core import mpu", "mpu.initialize_model_parallel("),
        ),
        Patch(
            name="megatron_lm.training.setup_model_and_optimizer",
            module=f"{_MT}.training", attr="setup_model_and_optimizer", replacement=_setup_model_and_optimizer,
            params=None, requires=REQUIRES,
            source_contains=("return model, optimizer, opt_param_scheduler",),
        ),
        Patch(
            name="megatron_lm.training.build_train_valid_test_data_loaders",
            module=f"{_MT}.training", attr="build_train_valid_test_data_loaders", replacement=_build_loaders,
            params=("build_train_valid_test_datasets_provider",), requires=REQUIRES,
            source_contains=("return train_dataloader, valid_dataloaders, test_dataloader",),
        ),
        Patch(
            name="megatron_lm.training.build_train_valid_test_data_iterators",
            module=f"{_MT}.training", attr="build_train_valid_test_data_iterators", replacement=_build_iterators,
            params=("build_train_valid_test_datasets_provider",), requires=REQUIRES,
            source_contains=("train_dataloader, valid_dataloaders, test_dataloader = build_train_valid_test_data_loaders(",
                             "return RerunDataIterator(iter(dataloader))"),
        ),
        Patch(
            name="megatron_lm.training.train_step",
            module=f"{_MT}.training", attr="train_step", replacement=_train_step,
            params=("forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler", "config",
                    "forward_backward_func", "iteration", "pg_collection", "p2p_communicator"),
            requires=REQUIRES,
            source_contains=("opt_param_scheduler.step(increment=increment)",),
        ),
        Patch(
            name="megatron_lm.rerun_state_machine._reduce_any",
            module="megatron.core.rerun_state_machine", attr="RerunStateMachine._reduce_any",
            replacement=_reduce_any, params=("self", "value"), requires=REQUIRES,
            source_contains=("torch.distributed.all_reduce(val_tensor)",),
        ),
        Patch(
            name="megatron_lm.training.training_log",
            module=f"{_MT}.training", attr="training_log", replacement=_training_log,
            params=("loss_dict", "total_loss_dict", "learning_rate", "iteration", "loss_scale", "report_memory_flag",
                    "skipped_iter", "grad_norm", "params_norm", "num_zeros_in_grad", "max_attention_logit",
                    "pg_collection", "is_first_iteration", "seqlen_squared_sum_in_batch", "total_real_tokens_in_batch"),
            requires=REQUIRES,
            # train() passes it by keyword; the flag only decides the reset and the off-interval line
            # ... and the running sums' arithmetic, which the integration repeats for a snapshot
            source_contains=("should_reset = not is_first_iteration",
                             "if iteration % args.log_interval == 0 or is_first_iteration:",
                             "total_loss_dict[advanced_iters_key] = total_loss_dict.get(advanced_iters_key, 0) + 1",
                             "total_loss_dict[skipped_iters_key] = total_loss_dict.get(skipped_iters_key, 0) + skipped_iter",
                             "total_loss_dict.get(key, torch.tensor([0.0], dtype=torch.float, device='cuda'))\n"
                             "                + loss_dict[key]",
                             "total_loss_dict[nan_iters_key] = total_loss_dict.get(nan_iters_key, 0) + int(got_nan)",
                             "total_loss_dict[key] = torch.tensor([0.0], dtype=torch.float, device='cuda')",
                             "total_loss_dict[advanced_iters_key] = 0"),
        ),
        Patch(
            name="megatron_lm.core.utils.get_batch_on_this_tp_rank",
            module="megatron.core.utils", attr="get_batch_on_this_tp_rank", replacement=_get_batch_on_this_tp_rank,
            params=("batch", "has_cu_seqlens", "is_hybrid_cp", "create_attention_mask_in_dataloader",
                    "broadcast_src_rank", "broadcast_group", "cp_size", "tp_rank", "micro_batch_size", "seq_length",
                    "mtp_on_this_rank", "pipeline_model_parallel_size", "is_pipeline_first_stage",
                    "is_pipeline_last_stage"),
            requires=REQUIRES,
            # the receiving side allocates its buffers empty and fills them only by broadcast
            source_contains=("tokens = torch.empty(shape, dtype=torch.int64", "if tp_rank == 0:"),
        ),
        Patch(
            name="megatron_lm.training.train",
            module=f"{_MT}.training", attr="train", replacement=_train, params=None, requires=REQUIRES,
            # the loop this integration steps through: one train_step call per iteration, the
            # data iterator passed positionally as its second argument
            source_contains=("iteration = args.iteration", "train_step(", "train_data_iterator,"),
        ),
    ])


PATCHES: PatchSet = _build()


def apply(hooks: Hooks) -> bool:
    """Apply every hook, calling ``hooks`` (and, without CUDA, the CPU shims of megatron-core
    0.19 and ``megatron.training``). Returns whether anything was applied now."""
    from pitstop.patches import py311

    py311.apply()
    _Holder.hooks = hooks
    if PATCHES.applied:
        return False
    from pitstop.patches import megatron_lm_cpu

    megatron_lm_cpu.apply()  # a no-op with CUDA
    PATCHES.apply()
    return True


def revert() -> None:
    PATCHES.revert()


def is_applied() -> bool:
    return PATCHES.applied
