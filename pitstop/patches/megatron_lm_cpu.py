"""A CPU shim for Megatron-LM's own loop: ``megatron.training.pretrain`` with megatron-core 0.19
on CPU-only torch over gloo (fp32 and bf16).

Found by running a ``pretrain_gpt.py``-style script at world 1 and 8 (tp2 pp2 dp2, the
distributed optimizer, overlapped grad reduce and param gather, dropout 0.1, ``--manual-gc``,
``--bf16``, ``--save``/``--load`` in both checkpoint formats) and keeping each site that a
leave-one-out run showed is needed. Three kinds of patch, as in :mod:`megatron_cpu` (0.16):

* **``torch`` as one module sees it** (:class:`_CpuTorch`): ``torch.cuda`` answers as a
  one-device machine whose device is the CPU (``current_device()`` is ``cpu``, synchronise
  and streams do nothing, the RNG is the CPU generator, memory counters read 0), and tensor
  factories given a CUDA device make CPU tensors. Megatron-LM's loop reaches far more CUDA
  calls than Megatron-Core's (timers, logging, the rerun state machine, checkpointing), so the
  redirect answers every ``torch.cuda`` name instead of a list per module.
* **Functions wrapped** where a tensor *method* assumes CUDA (``.cuda()``, ``.type() ==
  'torch.cuda.FloatTensor'``, ``Module.cuda``): :func:`_cpu_methods` makes those answer as on
  CUDA for the duration of one call.
* **Not CUDA at all** (C1-C5 below): the wheel ships no Makefile for its dataset helpers, and
  without Apex or Transformer Engine the distributed optimizer falls back to torch's Adam, whose
  per-parameter ``step`` tensor three checkpoint paths get wrong. Each fix says which.

On CPU the "CUDA" generator is the CPU one, so a ``DataLoader`` drawing its base seed from the
default generator shifts dropout masks after a restore: loaders get a generator of their own
(B8). ``torch.compile`` (Megatron's ``jit_fuser``) is turned off: on CPU it would build each
fused helper with a C++ toolchain.

``apply()`` is a no-op when CUDA is available (unless ``force=True``).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable

from pitstop.patches._base import Patch, PatchSet
# the same CPU stand-ins as 0.16's shim: the "CUDA" generator is the CPU one
from pitstop.patches.megatron_cpu import _get_cuda_rng_state_cpu, _is_cuda_device, _set_cuda_rng_state_cpu

__all__ = ["PATCHES", "apply", "revert", "is_applied"]

REQUIRES = ">=0.19,<0.20"
MC, MT = "megatron.core", "megatron.training"


# ------------------------------------------------------------------------------ the redirect
def _cpu_device(d: Any) -> Any:
    import torch

    return torch.device("cpu") if _is_cuda_device(d) else d


class _NullEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NullStream(_NullEvent):
    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullEvent()


class _CpuCuda:
    """``torch.cuda`` for a machine whose one device is the CPU."""

    Stream = _NullStream
    Event = _NullEvent

    def __init__(self, real):
        self._real = real

    def current_device(self):
        import torch

        return torch.device("cpu")

    def device_count(self):
        return 1  # Megatron-LM builds its model parallel groups and seeds its RNG tracker only then

    def is_available(self):
        return True

    def synchronize(self, *a, **k):
        pass

    def empty_cache(self):
        pass

    def set_device(self, *a, **k):
        pass

    def current_stream(self, *a, **k):
        return _NullStream()

    def stream(self, *a, **k):
        return contextlib.nullcontext()

    def get_rng_state(self, *a, **k):
        import torch

        return torch.get_rng_state()

    def set_rng_state(self, state, *a, **k):
        import torch

        torch.set_rng_state(state)

    def manual_seed(self, seed):
        import torch

        torch.default_generator.manual_seed(int(seed))

    def memory_allocated(self, *a, **k):
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "zeros_like",
              "ones_like", "empty_like", "full_like", "as_tensor", "eye")


class _CpuTorch(types.ModuleType):
    """Stands in for ``torch`` as the module-global of one Megatron module (see the docstring)."""

    def __init__(self, real: types.ModuleType, owner: str):
        super().__init__(real.__name__)
        self.__dict__["_pitstop_real"] = real
        self.__dict__["_pitstop_owner"] = owner
        self.__dict__["cuda"] = _CpuCuda(real.cuda)
        for name in _FACTORIES:
            self.__dict__[name] = self._on_cpu(getattr(real, name))

    @staticmethod
    def _on_cpu(factory: Callable) -> Callable:
        @functools.wraps(factory)
        def wrapper(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return factory(*args, **kwargs)

        return wrapper

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_pitstop_real"], name)

    def __repr__(self) -> str:
        return f"<pitstop CPU redirect of torch for {self.__dict__['_pitstop_owner']}>"


def _torch(module: str, *lines: str) -> Patch:
    def replacement(real):
        if isinstance(real, _CpuTorch) or getattr(real, "__name__", "") != "torch":
            from pitstop.errors import PatchError

            raise PatchError(f"patch megatron_lm_cpu.torch@{module}: its torch is {real!r}, not the torch module")
        return _CpuTorch(real, module)

    return Patch(name=f"megatron_lm_cpu.torch@{module}", module=module, attr="torch", replacement=replacement,
                 params=None, requires=REQUIRES, source_contains=lines)


# ------------------------------------------------------------------------- scoped methods
@contextlib.contextmanager
def _cpu_methods():
    """For one call: ``Tensor.cuda()`` and ``Module.cuda()`` leave things where they are, and
    ``Tensor.type()`` names CPU tensors as CUDA ones (Megatron tells fp32 from 16-bit by it)."""
    import torch

    t_type, t_cuda, m_cuda = torch.Tensor.type, torch.Tensor.cuda, torch.nn.Module.cuda

    def type_(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw:
            name = t_type(self)
            return "torch.cuda." + name[len("torch."):] if name.startswith("torch.") and \
                not name.startswith("torch.cuda.") else name
        return t_type(self, dtype, non_blocking, **kw)

    torch.Tensor.type = type_
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda, torch.nn.Module.cuda = t_type, t_cuda, m_cuda


def _scoped(original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with _cpu_methods():
            return original(*args, **kwargs)

    return wrapper


def _fn(name: str, module: str, attr: str, replacement, *lines: str, params=None) -> Patch:
    return Patch(name=f"megatron_lm_cpu.{name}", module=module, attr=attr, replacement=replacement, params=params,
                 requires=REQUIRES, source_contains=lines)


# ------------------------------------------------------------------------ replacements
def _own_generator(original):
    """B8: a loader that draws its base seed from a generator of its own, not the CPU one."""
    import torch

    @functools.wraps(original)
    def build_pretraining_data_loader(dataset, consumed_samples, *args, **kwargs):
        loader = original(dataset, consumed_samples, *args, **kwargs)
        if loader is not None and getattr(loader, "generator", None) is None:
            from megatron.training import get_args

            loader.generator = torch.Generator().manual_seed(get_args().seed)
        return loader

    return build_pretraining_data_loader


class _MissingIsNone(dict):
    def __missing__(self, key):
        return None


def _set_states(original):
    """C3: a checkpoint load writes the fp32 main parameters (views of leaves that require
    grad) outside ``no_grad``, and reads a ``step`` that torch's Adam keeps per parameter and
    the torch format never saved. ``step`` comes back through ``load_state_dict``."""
    import torch

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        with torch.no_grad():
            return original(self, model_param, _MissingIsNone({k: v for k, v in tensors.items() if k != "step"}))

    return _set_main_param_and_optimizer_states


def _memory_without_psutil(original):
    """C2: a torch_dist save logs its memory through psutil, and raises when psutil is missing."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "HAVE_PSUTIL", True):
        return original
    return functools.wraps(original)(lambda: 0)


def _own_steps(original):
    """C4: after a load every parameter got the *same* ``step`` tensor, which torch's Adam
    then advances once per parameter per step: each gets its own copy."""
    import torch

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        for st in self.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].detach().clone()
        return out

    return load_state_dict


def _state_before_first_step(original):
    """C5: a torch_dist load asks a fresh optimizer for its state dict, which asserts one
    ``step`` value across parameters when torch's Adam has none yet: zero state, step 0."""
    import torch

    @functools.wraps(original)
    def state_dict(self):
        from megatron.core.optimizer import distrib_optimizer

        if not distrib_optimizer.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0 and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
            for st in self.optimizer.state.values():
                st.setdefault("step", torch.tensor(0.0))
        return original(self)

    return state_dict


# ---------------------------------------------------------------------------------- the set
def _build() -> PatchSet:
    return PatchSet("megatron_lm_cpu", [
        # --- A: torch as each module sees it
        _torch(f"{MT}.initialize", 'assert torch.cuda.is_available(), "Megatron requires CUDA."',
               "device_count = torch.cuda.device_count()", "if torch.cuda.device_count() > 0:"),
        _torch(f"{MC}.timers", "torch.cuda.synchronize()"),
        _torch(f"{MT}.training", "device='cuda'", "torch.cuda.Stream()"),
        _torch(f"{MC}.distributed.param_and_grad_buffer", "torch.cuda.current_device()"),
        _torch(f"{MC}.optimizer.optimizer", "device='cuda'"),
        _torch(f"{MC}.rerun_state_machine", "torch.cuda.get_rng_state()"),
        _torch(f"{MC}.pipeline_parallel.schedules", 'device="cuda"'),
        _torch(f"{MC}.utils", "torch.cuda.current_device()"),
        _torch(f"{MC}.optimizer.clip_grads", "device='cuda'"),
        _torch(f"{MT}.utils.common_utils", "torch.cuda"),
        _torch(f"{MC}.pipeline_parallel.p2p_communication", "torch.cuda.current_device()", "torch.cuda.synchronize()"),
        _torch(f"{MC}.tensor_parallel.random", "torch.cuda.get_rng_state()", "torch.cuda.manual_seed(seed)"),
        _torch(f"{MT}.checkpointing", "torch.cuda.get_rng_state()", "torch.cuda.set_rng_state("),
        _torch(f"{MC}.optimizer.distrib_optimizer", "device=torch.cuda.current_device()"),
        _torch(f"{MC}.dist_checkpointing.strategies.filesystem_async", "torch.cuda.synchronize()"),
        _torch(f"{MC}.dist_checkpointing.strategies.state_dict_saver", "torch.cuda.current_device()"),
        # --- B: functions
        _fn("random._get_cuda_rng_state", f"{MC}.tensor_parallel.random", "_get_cuda_rng_state", _get_cuda_rng_state_cpu,
            params=("device", "clone", "graph_safe")),
        _fn("random._set_cuda_rng_state", f"{MC}.tensor_parallel.random", "_set_cuda_rng_state", _set_cuda_rng_state_cpu,
            params=("new_state", "device", "graph_safe")),
        # validate_args asks for the GPU architecture when tp > 1 (imported by name): pre-Blackwell
        _fn("arguments.get_device_arch_version", f"{MT}.arguments", "get_device_arch_version",
            lambda original: functools.wraps(original)(lambda: 0), params=()),
        _fn("language_module.setup_embeddings_and_output_layer",
            f"{MC}.models.common.language_module.language_module",
            "LanguageModule.setup_embeddings_and_output_layer", _scoped, "weight.data = weight.data.cuda()",
            params=("self",)),
        _fn("distrib_optimizer._build_model_and_main_param_groups", f"{MC}.optimizer.distrib_optimizer",
            "DistributedOptimizer._build_model_and_main_param_groups", _scoped,
            "model_param.type() == 'torch.cuda.FloatTensor'"),
        _fn("clip_grads.clip_grad_by_total_norm_fp32", f"{MC}.optimizer.clip_grads",
            "clip_grad_by_total_norm_fp32", _scoped, "param.grad.type() == 'torch.cuda.FloatTensor'"),
        _fn("optimizer.clip_grad_by_total_norm_fp32", f"{MC}.optimizer.optimizer",
            "clip_grad_by_total_norm_fp32", _scoped, "param.grad.type() == 'torch.cuda.FloatTensor'"),
        _fn("optimizer.Float16OptimizerWithFloat16Params.__init__", f"{MC}.optimizer.optimizer",
            "Float16OptimizerWithFloat16Params.__init__", _scoped, "'torch.cuda.BFloat16Tensor'"),
        _fn("training.get_model", f"{MT}.training", "get_model", _scoped,
            "model_module.cuda(torch.cuda.current_device())"),
        _fn("training.build_pretraining_data_loader", f"{MT}.training", "build_pretraining_data_loader",
            _own_generator, params=("dataset", "consumed_samples")),
        # --- C: not CUDA
        _fn("datasets.compile_helpers", f"{MC}.datasets.utils", "compile_helpers",
            lambda original: functools.wraps(original)(lambda: None), '"make"', params=()),
        _fn("filesystem_async._process_memory", f"{MC}.dist_checkpointing.strategies.filesystem_async",
            "_process_memory", _memory_without_psutil, "psutil", params=()),
        _fn("distrib_optimizer._set_main_param_and_optimizer_states", f"{MC}.optimizer.distrib_optimizer",
            "DistributedOptimizer._set_main_param_and_optimizer_states", _set_states,
            params=("self", "model_param", "tensors")),
        _fn("distrib_optimizer.load_state_dict", f"{MC}.optimizer.distrib_optimizer",
            "DistributedOptimizer.load_state_dict", _own_steps, 's["step"] = step', params=("self", "state_dict")),
        _fn("distrib_optimizer.state_dict", f"{MC}.optimizer.distrib_optimizer", "DistributedOptimizer.state_dict",
            _state_before_first_step, "assert len(steps) == 1", params=("self",)),
    ])


PATCHES: PatchSet = _build()
_dynamo_disable: list = []
"""``torch._dynamo.config.disable`` before :func:`apply` (empty while not applied)."""


def apply(force: bool = False) -> bool:
    """Apply the shim when CUDA is unavailable (or when ``force``). Returns whether it is applied."""
    if PATCHES.applied:
        return True
    import torch

    if not force and torch.cuda.is_available():
        return False
    PATCHES.apply()
    import torch._dynamo

    _dynamo_disable[:] = [torch._dynamo.config.disable]
    torch._dynamo.config.disable = True  # Megatron's jit_fuser (torch.compile) runs eagerly
    return True


def revert() -> None:
    if not PATCHES.applied:
        return
    PATCHES.revert()
    import torch._dynamo

    torch._dynamo.config.disable = _dynamo_disable.pop()


def is_applied() -> bool:
    return PATCHES.applied
