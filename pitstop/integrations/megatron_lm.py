"""Megatron-LM's own training loop (``megatron.training.pretrain``) under pitstop.

A Megatron-LM user keeps their ``pretrain_gpt.py`` and their launch line. One line at the top
of the script is all pitstop asks::

    import pitstop.integrations.megatron_lm  # noqa: F401  (the one line)

    args = parse_and_validate_args(extra_args_provider=my_provider)   # + the --pitstop-* flags
    pretrain(pretrain_cfg_container_from_args(args), datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=...)

and ``pitstop launch ... -- pretrain_gpt.py <Megatron-LM flags> [--pitstop-* flags]``. The
import installs the hooks of :mod:`pitstop.patches.megatron_lm` into Megatron-LM's own seams::

    Megatron-LM (megatron.training)                pitstop
    training.pretrain                              remembered: a standby's warmup calls it again
    arguments.parse_args(extra_args_provider)      + --pitstop-* flags, composed with the user's
    initialize._initialize_distributed             join the job first (a standby warms up in the
                                                   sandbox, then waits for a role)
    initialize.mpu.initialize_model_parallel       pitstop's groups (GroupRegistry), not Megatron's
    training.setup_model_and_optimizer             a Session over the model and optimizer built
    training.build_train_valid_test_data_iterators the session starts (a joiner takes its state);
                                                   args.iteration and the samples follow it
    training.train_step                            the iteration boundary: vote; a discarded step
                                                   is rolled back and redone inside the one call
    training.training_log                          its running loss sums: a joiner starts from its
                                                   predecessor's (exact lines at --log-interval > 1)
    RerunStateMachine._reduce_any                  no rerun of a step that will be discarded

Megatron-LM's loop never sees a discarded step: ``train_step`` returns only a committed one, so
its iteration count, consumed samples, logging and ``--save`` stay as in an uninterrupted run.

A joiner runs the script from the start, as every process does. Between its model set-up and its
first iteration, Megatron-LM does world collectives (the set-up timers' barriers, the data
loaders' flags); the stayers did those long ago. The joiner answers them from world rank 0's
record of its own set-up (:class:`pitstop.pg.StoreWorldGroup`) and joins the world's live
operation stream only at its first ``train_step``.

Outside a pitstop job (no ``PITSTOP_STORE`` in the environment: plain ``torchrun``) every hook
passes through, so the same script runs the uninterrupted baselines the tests compare against.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

from pitstop.errors import PitstopError
from pitstop.integrations.megatron import MegatronFramework, add_pitstop_args, runtime_config

log = logging.getLogger(__name__)

__all__ = ["install", "uninstall", "in_job", "session", "compose_args_provider", "MEGATRON_LM", "MegatronLMFramework"]


def in_job() -> bool:
    """Whether this process was started by pitstop (``pitstop launch`` or ``pitstop emulate``)."""
    from pitstop.store import ENV_STORE

    return bool(os.environ.get(ENV_STORE))


class _State:
    session = None
    steps = None          # the session's step generator
    first: Optional[int] = None
    """The step the session yielded when it started, not yet run by ``train_step``."""
    dataloader = None
    scheduler = None
    pretrain = None       # the script's pretrain call, repeatable (a standby's warmup)
    sums: Optional[dict] = None   # Megatron-LM's running loss sums (train's total_loss_dict)
    logged = False        # training_log ran in this process
    pending = None        # (step, loss_dict, skipped): a committed step training_log has not added yet
    carried: Optional[dict] = None  # a joiner's predecessor's sums, for its first training_log
    samples_per_step = 0
    dataloader_type = "single"


def session():
    """The running :class:`~pitstop.runtime.session.Session` (None before the model is built, or
    outside a pitstop job)."""
    return _State.session


# ------------------------------------------------------------------------------------ flags
def compose_args_provider(user: Optional[Callable] = None) -> Callable:
    """An ``extra_args_provider`` that adds the user's flags, then pitstop's ``--pitstop-*``."""
    def provider(parser):
        if user is not None:
            parser = user(parser)
            if parser is None:
                raise PitstopError(f"extra_args_provider {getattr(user, '__name__', user)!r} returned None; "
                                   "Megatron-LM expects it to return the parser")
        if not any(a.dest == "pitstop_heartbeat_interval" for a in parser._actions):
            add_pitstop_args(parser)
        return parser

    provider.pitstop_composed = True  # type: ignore[attr-defined]
    return provider


# -------------------------------------------------------------------------------- the adapter
class MegatronLMFramework(MegatronFramework):
    """Megatron-Core's adapter, plus what Megatron-LM's loop keeps beside the optimizer: the
    learning-rate schedule's position. Its other settings come from the flags, the same on
    every process; only ``num_steps`` moves."""

    name = "megatron-lm"

    def extra_state(self, model, optimizer):
        sched = _State.scheduler
        extra = {} if sched is None else {"lr_num_steps": int(sched.num_steps)}
        extra["loss_sums"] = loss_sums_after_log()
        return extra

    def after_handover(self, model, optimizer):
        """Megatron-LM's ``train`` runs a process's first iteration with the forward pre-hooks
        off (and ``param_sync_func`` unset): with ``--overlap-param-gather`` a joiner's first
        forward gathers no parameters, while the stayers' hooks would dispatch the gather of
        the parameters the last step updated. So every rank gathers them now, as a restart's
        first iteration finds them: a stayer's hooks then see the gather done (Megatron's
        ``param_gather_dispatched``) and dispatch nothing, and all ranks compute with the same
        parameters through the same collectives."""
        if any(getattr(getattr(c, "ddp_config", None), "overlap_param_gather", False) for c in model):
            self.resync_params(model, optimizer)

    def load(self, ckpt_dir, model, optimizer, step):
        """A checkpoint restart (no standby was left): Megatron-LM's own ``--load`` already
        loaded the checkpoint in ``setup_model_and_optimizer``, model, optimizer, scheduler and
        RNG states; the controller asked for the step its marker named. Say which was loaded."""
        from megatron.training import get_args

        args = get_args()
        if args.iteration != step:
            raise PitstopError(f"the controller restarts the job from step {step}, but Megatron-LM's --load "
                               f"{args.load} loaded iteration {args.iteration}")
        return int(args.iteration)

    def set_extra_state(self, model, optimizer, extra):
        if "loss_sums" in extra and joined_mid_run() and not _State.logged:
            _State.carried = _as_tensors(_checked_sums(extra["loss_sums"]))
        sched = _State.scheduler
        if sched is None or "lr_num_steps" not in extra:
            return
        n = extra["lr_num_steps"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PitstopError(f"the learning-rate schedule's position {n!r} in a snapshot: expected an integer >= 0")
        sched.num_steps = n
        sched.step(increment=0)  # the param groups' lr and weight decay for that position


MEGATRON_LM = MegatronLMFramework()


# ------------------------------------------------------------------------------ the hooks
def _make_data(step: int):
    """Megatron-LM's train iterator positioned at ``step`` (what a rollback and a joiner need).

    Rebuilt with Megatron-LM's own ``build_pretraining_data_loader`` from the dataset its
    first loader holds, at ``(step - 1) * samples per step`` consumed samples: the sampler's
    order depends only on that count, so the batches are the uninterrupted run's. A rank that
    reads no data (Megatron builds none on middle pipeline stages) gets None, as from Megatron."""
    dl = _State.dataloader
    if dl is None:
        return None
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    import torch

    loader = build_pretraining_data_loader(dl.dataset, (step - 1) * _State.samples_per_step)
    # iter(DataLoader) draws its workers' base seed from the default CPU generator, part of the
    # state a rollback restored (and, on CPU, the generator dropout draws from): an iterator
    # the uninterrupted run never made must not move it
    with torch.random.fork_rng(devices=[]):
        if _State.dataloader_type == "cyclic":
            from megatron.training.training import cyclic_iter

            return RerunDataIterator(iter(cyclic_iter(loader)))
        return RerunDataIterator(iter(loader))


def after_setup(model, optimizer, scheduler) -> None:
    """``setup_model_and_optimizer`` returned: make the session over what it built (not in a
    standby's warmup sandbox: that iteration is thrown away)."""
    if not in_job() or _in_sandbox():
        return
    from megatron.training import get_args

    from pitstop.runtime.session import Session

    args = get_args()
    if args.virtual_pipeline_model_parallel_size is not None:
        raise PitstopError(f"--virtual-pipeline-model-parallel-size {args.virtual_pipeline_model_parallel_size}: "
                           "pitstop's Megatron-LM hooks rebuild one train iterator per rank, not one per "
                           "virtual stage, so far; leave interleaving off under pitstop")
    if args.dataloader_type not in ("single", "cyclic"):
        raise PitstopError(f"--dataloader-type {args.dataloader_type}: pitstop rewinds Megatron-LM's own loaders "
                           "('single' or 'cyclic') after a rollback; an external loader cannot be rewound by pitstop")
    from pitstop.runtime.worker import require_current

    cfg = require_current().config
    # async_commit is not refused, since it is the default: Megatron-LM logs each step itself right
    # after train_step returns, before a vote read one boundary later could discard it, so the
    # session votes at every boundary synchronously here (async_commit=False below)
    if cfg.commit_interval != 1:
        raise PitstopError(f"--pitstop-commit-interval {cfg.commit_interval}: under Megatron-LM's own loop every "
                           "step is voted (1); a window of several steps would be redone after Megatron-LM "
                           "logged them")
    if cfg.save_interval:
        raise PitstopError(f"pitstop's --save-interval {cfg.save_interval} under Megatron-LM: Megatron-LM "
                           "checkpoints itself; give its --save DIR --load DIR --save-interval N, and pitstop's "
                           "no-standby fallback restarts the job from that")
    _State.scheduler = scheduler
    _State.samples_per_step = args.global_batch_size
    _State.dataloader_type = args.dataloader_type
    _State.session = Session(model, optimizer, _make_data, framework=MEGATRON_LM,
                             attach_world_at_first_step=True, switch_at_next_step=True, async_commit=False)
    _declare_checkpoints(args, _State.session)


#: The file in Megatron-LM's ``--save`` directory that names its last complete checkpoint.
MARKER = "latest_checkpointed_iteration.txt"


def _declare_checkpoints(args, s) -> None:
    """World rank 0 tells the controller where Megatron-LM checkpoints, if a restart can resume
    from there bit for bit: the no-standby fallback then restarts every process, and Megatron-LM's
    own ``--load`` takes the last checkpoint. Otherwise the fallback has no checkpoint, and says so."""
    if s.rank != 0 or not args.save:
        return
    why = None
    if not args.save_interval:
        why = "no --save-interval (Megatron-LM saves only at the end)"
    elif not args.load or os.path.abspath(args.load) != os.path.abspath(args.save):
        why = f"--load {args.load} is not --save {args.save} (a restart would not load what the job saved)"
    elif args.no_load_optim or args.no_load_rng or args.finetune:
        why = "--no-load-optim, --no-load-rng or --finetune (a restart would not resume the same run)"
    if why:
        log.warning("%s the no-standby fallback cannot restart from Megatron-LM's checkpoints: %s", s.prefix(), why)
        return
    from pitstop.runtime import keys

    s.ch.put(keys.CHECKPOINT, {"dir": os.path.abspath(args.save), "marker": MARKER})


def after_data(train_dataloader) -> None:
    """Megatron-LM built its loaders: start the session here, before ``train`` reads
    ``args.iteration``. A joiner takes its state now; every rank learns its first step."""
    s = _State.session
    if s is None:
        return
    from megatron.training import get_args

    args = get_args()
    _State.dataloader = train_dataloader
    _State.steps = s.steps(args.train_iters)
    _State.first = next(_State.steps)
    done = _State.first - 1
    if args.iteration != done:
        log.info("%s Megatron-LM starts at iteration %d (was %d): the role's state is that of step %d",
                 s.prefix(), done, args.iteration, done)
    args.iteration = done
    args.consumed_train_samples = done * args.global_batch_size


def train_step(original: Callable, *a, **k):
    """One committed step of Megatron-LM's loop: run, vote; a discarded step is redone here."""
    s = _State.session
    if s is None:
        if _in_sandbox():  # a standby's warmup: one iteration, then back to waiting for a role
            out = _step_outputs(original(*a, **k))
            raise _SandboxStepDone(out, k.get("model", a[2] if len(a) > 2 else None))
        return original(*a, **k)
    a = list(a)
    while True:
        if _State.first is not None:
            step, _State.first = _State.first, None
            s.loop_begins()  # a joiner joins the world's live operations here (see the module docstring)
        else:
            step = next(_State.steps)
        a[1] = s.data  # data_iterator: positioned at this step
        out = original(*a, **k)
        _State.pending = (step, out[0], out[1])  # until training_log adds it to the running sums
        # no report: Megatron-LM logs the step itself (a float() of its loss here would sync the GPU)
        if s.commit(step):
            return out
        # discarded: the session rolled back, rebuilt the delta and repositioned s.data


def finish() -> None:
    """Megatron-LM's loop ended: let the session's generator finish its bookkeeping. The loop
    may stop before ``--train-iters`` (``--exit-interval``, ``--exit-duration-in-mins``, a
    signal): then the session just stops guarding steps."""
    steps, _State.steps = _State.steps, None
    if steps is None:
        return
    left = next(steps, None)  # after the last step the generator disarms the fence and ends
    if left is not None:
        s = _State.session
        log.info("%s Megatron-LM's loop ended before step %d of %d", s.prefix(), left, s._last)
        steps.close()
        from pitstop import pg

        pg.FENCE.armed = False


def joined_mid_run() -> bool:
    """This process took its role after the job began (a standby: replacement or drain), so its
    first iteration is not the job's (a checkpoint restart's is, as in Megatron-LM alone)."""
    s = _State.session
    return s is not None and s.controlled and s.m.joiner


def emulating() -> bool:
    from pitstop.emulation import runtime as emu

    return emu.ACTIVE is not None


def emulated_batch(batch: dict, call: dict) -> dict:
    """``get_batch_on_this_tp_rank`` returned ``batch`` (``call``: its arguments). Under
    ``pitstop emulate``, when the tp rank 0 that broadcast it is a virtual participant, the
    hybrid oracle left the receive buffers as Megatron allocated them (``torch.empty``):
    uninitialised memory, which made an Inf in the first gradient and sent Megatron-LM's
    rerun state machine to save and exit. Fill them with a well-formed batch instead (token
    0 everywhere, a full loss mask, positions 0..s-1, the causal mask): the same shapes,
    dtypes and operations, so the timing and memory the emulation measures are the real
    rank's, with values that stay finite."""
    from pitstop.emulation import runtime as emu

    if call["tp_rank"] == 0 or call["broadcast_src_rank"] in emu.ACTIVE.cfg.real_ranks:
        return batch
    import torch

    for key in ("tokens", "labels"):
        if batch.get(key) is not None:
            batch[key].zero_()
    if batch.get("loss_mask") is not None:
        batch["loss_mask"].fill_(1.0)
    if batch.get("position_ids") is not None:
        p = batch["position_ids"]
        p.copy_(torch.arange(p.shape[-1], dtype=p.dtype).expand_as(p))
    if batch.get("attention_mask") is not None:
        m = batch["attention_mask"]
        s = m.shape[-1]
        m.copy_(torch.ones(s, s, dtype=torch.bool).triu(1).expand_as(m))  # True: masked (above the diagonal)
    return batch


# ------------------------------------------------------------------- Megatron-LM's running loss sums
#: ``training_log``'s keys for its counters (every other key of its sums is a loss).
_ADV, _SKIP, _NAN = "advanced iterations", "skipped iterations", "nan iterations"


def before_log(total: dict) -> None:
    """A joiner's first ``training_log``: its sums start as its predecessor's were after the
    last committed step, so the line that ends the interval averages the whole interval, as
    the uninterrupted run's does."""
    if _State.carried is not None and not _State.logged:
        carried, _State.carried = _State.carried, None
        total.clear()
        total.update(carried)


def _as_tensors(sums: dict) -> dict:
    """Carried sums as ``training_log`` keeps them: counters as ints, losses as float32 [1]."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return {k: (v if k in (_ADV, _SKIP, _NAN) else torch.tensor([v], dtype=torch.float, device=dev))
            for k, v in sums.items()}


def after_log(total: dict) -> None:
    _State.sums, _State.pending, _State.logged = total, None, True


def loss_sums_after_log() -> dict:
    """The running sums as they are once ``training_log`` has added every committed step: the
    snapshot of a step is taken inside its ``train_step``, before Megatron-LM logs it, so that
    step's addition (and reset, if its line is printed) is done here on a copy, with
    ``training_log``'s own arithmetic (float32 tensor sums; the patch checks the lines)."""
    import torch

    # a joiner that has not logged yet goes on from what it was handed
    total = dict((_State.sums if _State.logged else _State.carried) or {})
    if _State.pending is not None:
        from megatron.training import get_args

        step, loss_dict, skipped = _State.pending
        if not skipped:
            total[_ADV] = total.get(_ADV, 0) + 1
        elif _ADV not in total:
            total[_ADV] = 0
        total[_SKIP] = total.get(_SKIP, 0) + skipped
        got_nan = False
        for key in loss_dict:
            if not skipped:
                zero = torch.tensor([0.0], dtype=torch.float, device=loss_dict[key].device)
                total[key] = total.get(key, zero) + loss_dict[key]
            else:
                value = loss_dict[key].float().sum().item()
                got_nan = got_nan or value in (float("inf"), -float("inf")) or value != value
        total[_NAN] = total.get(_NAN, 0) + int(got_nan)
        # Megatron-LM does not reset after a process's first line (a joiner's is patched to reset)
        first = not _State.logged and not joined_mid_run()
        if step % get_args().log_interval == 0 and not first:
            total = {k: (0 if k in (_ADV, _SKIP, _NAN) else torch.zeros(1)) for k in total}
    # float32 sums are carried as the float64 that holds them exactly; anything else that
    # shares the dict (MoE and MTP metrics are added to it by their own trackers) is not carried
    return {k: (int(v) if k in (_ADV, _SKIP, _NAN) else float(v.float().sum())) for k, v in total.items()
            if k in (_ADV, _SKIP, _NAN) or (torch.is_tensor(v) and v.numel() == 1)}


def _checked_sums(d) -> dict:
    """Running sums from a peer's snapshot: names to numbers, the counters whole and >= 0."""
    if not isinstance(d, dict) or len(d) > 64:
        raise PitstopError(f"Megatron-LM's running loss sums in a snapshot: expected a small mapping, got {type(d).__name__}")
    for k, v in d.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise PitstopError(f"Megatron-LM's running loss sum {k!r}: {v!r} (expected a name and a number)")
        if k in (_ADV, _SKIP, _NAN) and (not isinstance(v, int) or v < 0):
            raise PitstopError(f"Megatron-LM's running {k!r} count {v!r}: expected an integer >= 0")
    return dict(d)


# ------------------------------------------------------------------------- the standby's warmup
class _SandboxStepDone(Exception):
    """Ends the sandboxed ``pretrain`` after its first ``train_step`` (with that step's outputs)."""

    def __init__(self, out: dict, model):
        super().__init__("the sandboxed iteration is done")
        self.out, self.model = out, model


def _in_sandbox() -> bool:
    from pitstop.runtime import sandbox

    return sandbox.active() is not None


def pretrain_called(run: Callable[[], object]) -> None:
    if _State.pretrain is None and not _in_sandbox():
        _State.pretrain = run


def _step_outputs(ret) -> dict:
    """What a warmup report shows of Megatron-LM's ``train_step`` return value: the loss as its
    log line computes it (last stage only), the grad norm, whether the update happened."""
    loss_dict, skipped, grad_norm = ret[0], ret[1], ret[5]
    out = {"update_successful": not skipped, "grad_norm": None if grad_norm is None else float(grad_norm)}
    if "lm loss" in loss_dict:
        out["loss"] = float(loss_dict["lm loss"])
    return out


class _KeptGlobals:
    """Megatron-LM sets its globals once per process: the arguments, timers, the rerun state
    machine, the microbatch calculator, its start timestamps. A sandboxed ``pretrain`` runs
    inside the standby's own (its ``initialize_megatron`` is waiting for a role), so it gets
    fresh timers, and everything it changed is put back afterwards, as are Python's garbage
    collector (``--manual-gc`` turns it off) and the random generators (the real set-up seeds
    them again anyway)."""

    def __enter__(self) -> None:
        import copy
        import gc
        import random

        import numpy as np
        import torch
        from megatron.core import num_microbatches_calculator as nmc
        from megatron.core import rerun_state_machine as rsm
        from megatron.training import global_vars as gv
        from megatron.training import training as tr
        from megatron.training.global_vars import Timers

        self.gv = {k: v for k, v in vars(gv).items() if k.startswith("_GLOBAL_")}
        args = gv._GLOBAL_ARGS
        self.args = args, dict(vars(args))
        self.rsm, rsm._GLOBAL_RERUN_STATE_MACHINE = rsm._GLOBAL_RERUN_STATE_MACHINE, None  # made once, asserts
        self.nmc = copy.deepcopy(nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR)
        self.tr = {k: copy.copy(getattr(tr, k)) for k in ("_STARTUP_TIMESTAMPS", "_LEGACY_TRAIN_START_TIME",
                                                           "_TRAIN_START_TIME")}
        self.gc = gc.isenabled()
        self.rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
        gv._GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)

    def __exit__(self, *exc) -> None:
        import gc
        import random

        import numpy as np
        import torch
        from megatron.core import num_microbatches_calculator as nmc
        from megatron.core import rerun_state_machine as rsm
        from megatron.training import global_vars as gv
        from megatron.training import training as tr

        for k, v in self.gv.items():
            setattr(gv, k, v)
        args, saved = self.args
        vars(args).clear()
        vars(args).update(saved)
        rsm._GLOBAL_RERUN_STATE_MACHINE = self.rsm
        nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = self.nmc
        for k, v in self.tr.items():
            setattr(tr, k, v)
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.set_rng_state(self.rng[2])
        if self.gc:
            gc.enable()
        gc.collect()  # the sandbox's model and optimizer (cycles, with --manual-gc uncollected)


def _release(model) -> None:
    """Let the sandbox's model go. Megatron's DDP leaves a hook on each parameter's gradient
    accumulator that refers to the parameter and to the DDP, and that accumulator outlives the
    sandbox in torch's C++ autograd state, where Python's collector cannot see it: the model, its
    grad buffers and its optimizer's state would stay for the life of the standby (and anything
    that walks the models a process built would find it). So the parameters are emptied and the
    wrappers' own attributes dropped: what the hooks still refer to holds no memory."""
    import torch

    for chunk in model or ():
        for p in chunk.parameters():
            p.data = torch.empty(0, dtype=p.dtype)
            if hasattr(p, "main_grad"):
                del p.main_grad
        vars(chunk).clear()


def sandbox_iteration() -> dict:
    """A standby's warmup (:mod:`pitstop.runtime.sandbox`): the script's own ``pretrain`` once
    more, with the arguments it was called with, as the recorder's role, up to the end of its
    first ``train_step``. Megatron-LM's set-up (``initialize_megatron``'s groups and seeds,
    ``setup_model_and_optimizer``, the data loaders) and one real iteration run; every
    collective is answered from the record; then the standby goes back to waiting."""
    run = _State.pretrain
    if run is None:
        raise PitstopError("no pretrain call to repeat (the script called an unpatched pretrain)")
    with _KeptGlobals():
        try:
            run()
        except _SandboxStepDone as done:
            _release(done.model)
            return done.out
    raise PitstopError("the sandboxed pretrain ended without a train step (--train-iters 0, or --skip-train?)")


# -------------------------------------------------------------------------- install / uninstall
class _Hooks:
    """What :mod:`pitstop.patches.megatron_lm`'s hooks call (handed to it at :func:`install`)."""

    in_job = staticmethod(in_job)
    compose_args_provider = staticmethod(compose_args_provider)
    after_setup = staticmethod(after_setup)
    after_data = staticmethod(after_data)
    train_step = staticmethod(train_step)
    finish = staticmethod(finish)
    emulated_batch = staticmethod(emulated_batch)
    joined_mid_run = staticmethod(joined_mid_run)
    emulating = staticmethod(emulating)
    pretrain_called = staticmethod(pretrain_called)
    before_log = staticmethod(before_log)
    after_log = staticmethod(after_log)

    @staticmethod
    def join(args) -> None:
        from pitstop.runtime import worker

        cfg = runtime_config(args)
        if cfg.warmup and _State.pretrain is None:
            log.warning("pretrain was not called through pitstop's hook (import pitstop.integrations.megatron_lm "
                        "before `from megatron.training import pretrain`): a standby joins cold")
        worker.join(cfg, warmup=sandbox_iteration if _State.pretrain is not None else None)

    @staticmethod
    def step_discarded() -> bool:
        from pitstop import pg

        return _State.session is not None and pg.FENCE.armed and pg.FENCE.poisoned

    @staticmethod
    def refuse(what: str) -> None:
        raise PitstopError(what)

    @staticmethod
    def initialize_model_parallel(*args, **kwargs) -> None:
        from pitstop.integrations.megatron import initialize_model_parallel

        initialize_model_parallel(*args, **kwargs)


def install() -> None:
    """Apply the hooks (:mod:`pitstop.patches.megatron_lm`) and, on a machine without CUDA, the
    CPU shims. Idempotent; importing this module calls it."""
    from pitstop.patches import megatron_lm

    megatron_lm.apply(_Hooks())


def uninstall() -> None:
    from pitstop.patches import megatron_lm

    megatron_lm.revert()


install()
