"""DeepSpeed's ``mpu`` ("model parallel unit") from Megatron's ``parallel_state`` or from plain groups.

``deepspeed.initialize(..., mpu=...)`` takes any object with DeepSpeed's getter names. Once it
has one, DeepSpeed takes its data-parallel group from it instead of cloning the world
(``deepspeed.utils.groups._clone_world_group``, a ``new_group`` over every rank), and the
ZeRO optimizers, gradient clipping and the checkpoint code ask it for the model-parallel group.

Which getters DeepSpeed 0.19.8 calls (``grep -rn "mpu\\." deepspeed/``, training paths; the
``hasattr`` probes are listed where DeepSpeed branches on them):

* ``get_data_parallel_group/world_size/rank``, ``get_data_parallel_group_ranks``
  (``utils/groups.py``, ``runtime/config.py:460``, ``runtime/engine.py:2849``,
  ``runtime/model_checkpointing/utils.py``, ``runtime/zero/parameter_offload.py:267``);
* ``get_model_parallel_group/world_size/rank`` (ZeRO-1/2 ``stage_1_and_2.py:314``, ZeRO-3
  ``stage3.py:375``, gradient norms and clipping in ``runtime/utils.py``, checkpoint names in
  ``engine.py:2169``);
* ``get_tensor_model_parallel_group/world_size/rank/src_rank`` (``utils/bwc.py``, preferred over the
  model-parallel ones where both exist; ``engine.py:996``, activation checkpointing);
* ``get_pipeline_model_parallel_group/world_size/rank`` (``utils/bwc.py``, checkpoint metadata);
  ``get_pipe_parallel_*`` are the pipeline engine's own names, answered too;
* ``get_sequence_parallel_group/world_size/rank`` and ``get_sequence_data_parallel_*``
  (``utils/groups.py:865-916``, ``engine.py:936``): optional, probed with ``hasattr``.

Deliberately **absent**: ``initialize_sequence_parallel``. DeepSpeed takes an mpu that has it
for its own Ulysses ``parallel_state_sp`` and then ignores the mpu's data-parallel and
model-parallel groups (``utils/groups.py:774``, ``stage_1_and_2.py:309``, ``stage3.py:371``).
Also absent: ``get_slice_parallel_*`` (the pipeline grid's names for tensor parallel; DeepSpeed
falls back to the tensor-parallel getters) and ``_init_tp_mesh_device`` (called on
``deepspeed.utils.groups`` itself, never on a user mpu).

**Model parallel means tensor parallel here** (``model_parallel="tensor"``, the default), as
DeepSpeed's engine runs no Megatron pipeline schedule: DeepSpeed all-reduces gradient norms
over the "model parallel" group and counts a parameter without a ``tensor_model_parallel``
attribute on model-parallel rank 0 only. ``model_parallel="model"`` passes Megatron's own
tensor x pipeline group instead.

**Sequence parallel means Megatron's context parallel**: DeepSpeed's sequence-data-parallel
group (dp x sp), over which ZeRO partitions and gradients are averaged, is Megatron's
data-parallel group with context parallel. With cp = 1 the plain data-parallel group is
returned for it, so DeepSpeed holds one data-parallel group object, not two.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Union

import torch.distributed as dist

__all__ = ["GroupsMpu", "MegatronMpu", "MPU_METHODS"]

#: Every getter DeepSpeed 0.19.8 may call on an mpu; both adapters answer all of them.
MPU_METHODS = (
    "get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank",
    "get_data_parallel_group_ranks",
    "get_model_parallel_group", "get_model_parallel_world_size", "get_model_parallel_rank",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank",
    "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "get_pipe_parallel_group", "get_pipe_parallel_world_size", "get_pipe_parallel_rank",
    "get_sequence_parallel_group", "get_sequence_parallel_world_size", "get_sequence_parallel_rank",
    "get_sequence_data_parallel_group", "get_sequence_data_parallel_world_size",
    "get_sequence_data_parallel_rank",
)

GroupFn = Callable[[], Any]


class GroupsMpu:
    """An mpu whose groups come from callables, asked again at every call.

    Each callable returns this rank's group of one kind: a ``ProcessGroup`` registered with c10d
    (pitstop's groups are), so ``get_rank/get_world_size/get_process_group_ranks`` work on it.
    Because the callables are asked at every call, a later DeepSpeed query (the per-step gradient
    clipping asks for the model-parallel and data-parallel groups) sees the group pitstop holds
    now, e.g. after a delta rebuild. References DeepSpeed stored at ``initialize`` time are a
    separate matter (:func:`pitstop.runtime.swap.swap_groups`).

    ``data_parallel`` is required. A kind left out is a dimension of size 1, answered by a group
    of this rank alone: ``singleton`` if given, else one ``new_group([rank],
    use_local_synchronization=True)`` made at first use (only this rank takes part). DeepSpeed
    needs a real group there: its gradient clipping all-reduces over
    ``mpu.get_model_parallel_group()`` without checking for ``None``, which would be the world.

    A pure data-parallel job: ``GroupsMpu(data_parallel=lambda: registry.group("dp"))``.
    """

    def __init__(
        self,
        data_parallel: GroupFn,
        tensor_parallel: Optional[GroupFn] = None,
        pipeline_parallel: Optional[GroupFn] = None,
        context_parallel: Optional[GroupFn] = None,
        data_parallel_with_context: Optional[GroupFn] = None,
        model_parallel: Union[str, GroupFn] = "tensor",
        singleton: Optional[GroupFn] = None,
    ):
        if not callable(data_parallel):
            raise TypeError(f"data_parallel must be a callable returning a group, got {data_parallel!r}")
        if not (model_parallel == "tensor" or callable(model_parallel)):
            raise ValueError(f"model_parallel must be 'tensor' or a callable returning a group, got {model_parallel!r}")
        self._dp = data_parallel
        self._tp = tensor_parallel
        self._pp = pipeline_parallel
        self._cp = context_parallel
        self._dp_cp = data_parallel_with_context
        self._mp = model_parallel
        self._singleton_fn = singleton
        self._singleton = None

    def __repr__(self) -> str:
        have = [k for k, v in (("tp", self._tp), ("pp", self._pp), ("cp", self._cp)) if v is not None]
        return f"{type(self).__name__}(dp{', ' if have else ''}{', '.join(have)}, model_parallel={self._mp_name()})"

    def _mp_name(self) -> str:
        return "tensor" if self._mp == "tensor" else getattr(self._mp, "__name__", "callable")

    # ------------------------------------------------------------------ plumbing
    def singleton_group(self):
        """The group of this rank alone (a dimension of size 1)."""
        if self._singleton_fn is not None:
            return self._singleton_fn()
        if self._singleton is None:
            self._singleton = dist.new_group([dist.get_rank()], backend=self._singleton_backend(),
                                             use_local_synchronization=True)
        return self._singleton

    def _singleton_backend(self) -> str:
        """The data-parallel group's backend when it is a built-in one (a pitstop Python group reports its
        own name), else the platform's: the tensors DeepSpeed reduces over it live where the model does."""
        try:
            backend = str(dist.get_backend(self._dp()))
        except (RuntimeError, ValueError):
            backend = ""
        if backend in ("gloo", "nccl", "mpi", "ucc", "xccl"):
            return backend
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"

    def _group(self, fn: Optional[GroupFn]):
        return self.singleton_group() if fn is None else fn()

    def _size(self, kind: str) -> int:
        fn = self._kind(kind)
        return 1 if fn is None else dist.get_world_size(group=fn())

    def _rank(self, kind: str) -> int:
        fn = self._kind(kind)
        return 0 if fn is None else dist.get_rank(group=fn())

    def _kind(self, kind: str) -> Optional[GroupFn]:
        if kind == "mp":
            return self._tp if self._mp == "tensor" else self._mp
        if kind == "sdp":
            if self.get_sequence_parallel_world_size() == 1:
                return self._dp
            if self._dp_cp is None:
                raise ValueError(f"{type(self).__name__}: context parallel size "
                                 f"{self.get_sequence_parallel_world_size()} > 1 needs data_parallel_with_context, "
                                 "the group ZeRO partitions over and averages gradients across")
            return self._dp_cp
        return {"dp": self._dp, "tp": self._tp, "pp": self._pp, "cp": self._cp}[kind]

    # ------------------------------------------------------------- data parallel
    def get_data_parallel_group(self):
        return self._dp()

    def get_data_parallel_world_size(self) -> int:
        return self._size("dp")

    def get_data_parallel_rank(self) -> int:
        return self._rank("dp")

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(dist.get_process_group_ranks(self._dp()))

    # ------------------------------------------------------------ model parallel
    def get_model_parallel_group(self):
        return self._group(self._kind("mp"))

    def get_model_parallel_world_size(self) -> int:
        return self._size("mp")

    def get_model_parallel_rank(self) -> int:
        return self._rank("mp")

    # ----------------------------------------------------------- tensor parallel
    def get_tensor_model_parallel_group(self):
        return self._group(self._tp)

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._size("tp")

    def get_tensor_model_parallel_rank(self) -> int:
        return self._rank("tp")

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor-parallel rank 0 of this rank's group."""
        if self._tp is None:
            return dist.get_rank()
        return int(dist.get_process_group_ranks(self._tp())[0])

    # --------------------------------------------------------- pipeline parallel
    def get_pipeline_model_parallel_group(self):
        return self._group(self._pp)

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._size("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._rank("pp")

    # DeepSpeed's pipeline grid names for the same thing.
    def get_pipe_parallel_group(self):
        return self.get_pipeline_model_parallel_group()

    def get_pipe_parallel_world_size(self) -> int:
        return self.get_pipeline_model_parallel_world_size()

    def get_pipe_parallel_rank(self) -> int:
        return self.get_pipeline_model_parallel_rank()

    # ------------------------------------------- sequence (= context) parallel
    def get_sequence_parallel_group(self):
        return self._group(self._cp)

    def get_sequence_parallel_world_size(self) -> int:
        return self._size("cp")

    def get_sequence_parallel_rank(self) -> int:
        return self._rank("cp")

    def get_sequence_data_parallel_group(self):
        return self._kind("sdp")()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._size("sdp")

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank("sdp")


class MegatronMpu(GroupsMpu):
    """Megatron's ``parallel_state`` (or any object with its getter names) as DeepSpeed's mpu.

    ``source`` defaults to ``megatron.core.parallel_state``, looked up at every call, so groups
    that pitstop installs there later (:func:`pitstop.integrations.megatron.install`) are the
    ones answered. Sizes and ranks come from the source's own ``get_*_world_size/rank`` where it
    has them. A source without context parallel (no ``get_context_parallel_group``) has cp = 1.
    ``model_parallel``: ``"tensor"`` (default) or ``"model"`` for the source's
    ``get_model_parallel_group`` (tensor x pipeline).
    """

    def __init__(self, source: Any = None, model_parallel: str = "tensor"):
        if model_parallel not in ("tensor", "model"):
            raise ValueError(f"model_parallel must be 'tensor' or 'model', got {model_parallel!r}")
        if source is None:
            from megatron.core import parallel_state as source
        self.source = source
        has_cp = hasattr(source, "get_context_parallel_group")
        super().__init__(
            data_parallel=lambda: source.get_data_parallel_group(),
            tensor_parallel=lambda: source.get_tensor_model_parallel_group(),
            pipeline_parallel=lambda: source.get_pipeline_model_parallel_group(),
            context_parallel=(lambda: source.get_context_parallel_group()) if has_cp else None,
            data_parallel_with_context=(lambda: source.get_data_parallel_group(with_context_parallel=True))
            if has_cp else None,
            model_parallel="tensor" if model_parallel == "tensor" else (lambda: source.get_model_parallel_group()),
        )
        self._mp_label = model_parallel

    def _mp_name(self) -> str:
        return self._mp_label

    _SOURCE_SIZE = {"dp": "get_data_parallel_world_size", "tp": "get_tensor_model_parallel_world_size",
                    "pp": "get_pipeline_model_parallel_world_size", "cp": "get_context_parallel_world_size"}
    _SOURCE_RANK = {"dp": "get_data_parallel_rank", "tp": "get_tensor_model_parallel_rank",
                    "pp": "get_pipeline_model_parallel_rank", "cp": "get_context_parallel_rank"}

    def _alias(self, kind: str) -> str:
        if kind == "mp":
            return "tp" if self._mp_label == "tensor" else "mp"
        return kind

    def _size(self, kind: str) -> int:
        fn = getattr(self.source, self._SOURCE_SIZE.get(self._alias(kind), ""), None)
        if fn is not None:
            return int(fn())
        if kind == "cp" and self._cp is None:
            return 1
        return super()._size(kind)

    def _rank(self, kind: str) -> int:
        fn = getattr(self.source, self._SOURCE_RANK.get(self._alias(kind), ""), None)
        if fn is not None:
            return int(fn())
        if kind == "cp" and self._cp is None:
            return 0
        return super()._rank(kind)

    def get_tensor_model_parallel_src_rank(self) -> int:
        fn = getattr(self.source, "get_tensor_model_parallel_src_rank", None)
        return int(fn()) if fn is not None else super().get_tensor_model_parallel_src_rank()
