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

A :class:`Framework` is handed to the session when it is made (``Session(...,
framework=...)``); each integration passes its own adapter, defined there, so the
runtime never imports an integration.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from pitstop.runtime import state

#: (object, method name) pairs wrapped per fault phase, or callables that arm a hook.
FaultPoints = Dict[str, List[Tuple[Any, str]]]


class Framework:
    """The adapter base, with Megatron-Core's behaviour (DDP + distributed optimizer over
    pitstop's groups). Where the groups live (:meth:`registry`, :meth:`install`) is the
    integration's to say: ``pitstop.integrations.megatron.MEGATRON`` and
    ``pitstop.integrations.deepspeed.DEEPSPEED`` are the adapters the runtime is handed."""

    name = "megatron"
    shard_kind = "dp-cp"
    """The kind whose group shares one optimizer shard set (buddy ring, state hand-off)."""

    def registry(self):
        """The :class:`~pitstop.groups.GroupRegistry` whose groups the library uses now."""
        raise NotImplementedError(f"{type(self).__name__}.registry: the integration's adapter says where its groups are")

    def install(self, registry) -> None:
        """After a delta rebuild: point the library's own globals at the new groups."""
        raise NotImplementedError(f"{type(self).__name__}.install: the integration's adapter installs its groups")

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

    def after_handover(self, model: Sequence[Any], optimizer) -> None:
        """On every rank of the new generation once a drain's state changed hands: the stayers
        after their groups were swapped, the joiner after it took the leaver's state, in that
        order on each side (it may be collective). For a library whose loop treats a
        process's first iteration differently from the others."""

    def new_generation(self, model: Sequence[Any], optimizer) -> None:
        """On every stayer once a replacement or drain installed the next generation's groups:
        drop what a library learnt about the old generation's run that a joiner, built
        fresh, has not learnt (the joiner must go through the same collectives)."""

    def save(self, ckpt_dir: str, step: int, model: Sequence[Any], optimizer) -> None:
        """The no-standby fallback's checkpoint (collective)."""
        from pitstop.runtime import checkpoint

        checkpoint.save(ckpt_dir, step, list(model), optimizer)

    def load(self, ckpt_dir: str, model: Sequence[Any], optimizer, step: int) -> int:
        from pitstop.runtime import checkpoint

        return checkpoint.load(ckpt_dir, list(model), optimizer, step)

    def state_writers(self, model: Sequence[Any], optimizer) -> List[Tuple[Any, str]]:
        """The (object, method) pairs that write this rank's shard between two boundaries: the
        asynchronous commit (:mod:`pitstop.runtime.pipeline`) holds them until it has packed
        the last boundary's state. Megatron's optimizer and DeepSpeed's both write it only in
        ``step`` (the engine's ``step`` calls its optimizer's)."""
        return [(optimizer, "step")]

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




def wrap(obj: Any, name: str, before: Callable[[], None]) -> None:
    """Call ``before()`` ahead of ``obj.name(...)`` (a fault injection point)."""
    orig = getattr(obj, name)

    def wrapped(*a, **k):
        before()
        return orig(*a, **k)

    setattr(obj, name, wrapped)


def first_trainable(module: torch.nn.Module) -> Optional[torch.Tensor]:
    return next((q for q in module.parameters() if q.requires_grad), None)
