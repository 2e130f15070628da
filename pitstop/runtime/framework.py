"""What the session needs to know about the training library, and nothing more.

The session (:mod:`pitstop.runtime.session`) is one implementation of the iteration
boundary, rollback, delta rebuild, buddy copy and drain for every library. What
differs between Megatron-Core and DeepSpeed is small and lives here::

                        Megatron-Core                     DeepSpeed (ZeRO 1/2)
    group owner         parallel_state (install)          deepspeed.utils.groups + mpu adapter
    shard group         dp-cp                             dp
    own state           dist-opt shard + moments          fp32 partition + moments, step counters
    full params again   copy main->model, param all-gather  update_lp_params (copy + all-gather)
    drain hand-off      DDP param buffers                 bit16 flat groups
    fault points        DDP finish_grad_sync, ...         engine reduce, optimizer step, ...

A :class:`Framework` is chosen when the session is made (``Session(...,
framework=...)``); the integrations pass theirs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from pitstop.runtime import state

#: (object, method name) pairs wrapped per fault phase, or callables that arm a hook.
FaultPoints = Dict[str, List[Tuple[Any, str]]]


class Framework:
    """Megatron-Core (the default): DDP + distributed optimizer over pitstop's groups."""

    name = "megatron"
    shard_kind = "dp-cp"
    """The kind whose group shares one optimizer shard set (buddy ring, state hand-off)."""

    def registry(self):
        from pitstop.integrations import megatron as integ

        return integ.registry()

    def install(self, registry) -> None:
        """After a delta rebuild: point the library's own globals at the new groups."""
        from pitstop.integrations import megatron as integ

        integ.install(registry)

    def swap_roots(self, model: Sequence[Any], optimizer) -> List[Any]:
        """Where to look for references to retired groups."""
        return [list(model), optimizer]

    def extra_state(self, model: Sequence[Any], optimizer) -> Dict[str, Any]:
        return {}

    def set_extra_state(self, model: Sequence[Any], optimizer, extra: Dict[str, Any]) -> None:
        pass

    def prepare_rollback(self, model: Sequence[Any], optimizer) -> None:
        """Before restoring a snapshot into a stayer: drop what the discarded step left."""

    def resync_params(self, model: Sequence[Any], optimizer) -> None:
        state.resync_params(model, optimizer)

    def save(self, ckpt_dir: str, step: int, model: Sequence[Any], optimizer) -> None:
        """The no-standby fallback's checkpoint (collective)."""
        from pitstop.runtime import checkpoint

        checkpoint.save(ckpt_dir, step, list(model), optimizer)

    def load(self, ckpt_dir: str, model: Sequence[Any], optimizer, step: int) -> int:
        from pitstop.runtime import checkpoint

        return checkpoint.load(ckpt_dir, list(model), optimizer, step)

    def param_buffers(self, model: Sequence[Any], optimizer) -> List[torch.Tensor]:
        return state.param_buffers(model)

    def fault_points(self, model: Sequence[Any], optimizer) -> Tuple[torch.nn.Module, FaultPoints]:
        """The module whose forward marks ``forward`` and the methods that mark the other phases."""
        chunk = model[0]
        return chunk, {
            "grad-reduce": [(chunk, "finish_grad_sync")],
            "param-gather": [(chunk, "start_param_sync")],
            "optimizer": [(optimizer, "step")],
        }


class DeepSpeedFramework(Framework):
    """A DeepSpeed engine with ZeRO stage 0, 1 or 2, data parallel over pitstop's dp group."""

    name = "deepspeed"
    shard_kind = "dp"

    def registry(self):
        from pitstop.integrations import deepspeed as integ

        return integ.registry()

    def install(self, registry) -> None:
        from pitstop.integrations import deepspeed as integ

        integ.install(registry)

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
        return out

    def set_extra_state(self, model: Sequence[Any], optimizer, extra: Dict[str, Any]) -> None:
        e = self._engine(model)
        for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
            if k in extra:
                setattr(e, k, extra[k])
        if "lr_scheduler" in extra and getattr(e, "lr_scheduler", None) is not None:
            e.lr_scheduler.load_state_dict(extra["lr_scheduler"])

    def prepare_rollback(self, model: Sequence[Any], optimizer) -> None:
        # a step discarded mid-backward leaves reduced (or half-reduced) gradients behind
        optimizer.zero_grad(set_to_none=True)

    def resync_params(self, model: Sequence[Any], optimizer) -> None:
        if hasattr(optimizer, "update_lp_params"):  # ZeRO 1/2: fp32 partition -> bit16 + all-gather
            optimizer.update_lp_params()

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


MEGATRON = Framework()
DEEPSPEED = DeepSpeedFramework()


def wrap(obj: Any, name: str, before: Callable[[], None]) -> None:
    """Call ``before()`` ahead of ``obj.name(...)`` (a fault injection point)."""
    orig = getattr(obj, name)

    def wrapped(*a, **k):
        before()
        return orig(*a, **k)

    setattr(obj, name, wrapped)


def first_trainable(module: torch.nn.Module) -> Optional[torch.Tensor]:
    return next((q for q in module.parameters() if q.requires_grad), None)
