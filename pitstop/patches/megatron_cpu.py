"""A CPU shim for megatron-core 0.16: train ``GPTModel`` with DDP and the distributed optimizer
on CPU-only torch over gloo, in fp32.

Megatron-Core assumes CUDA in a handful of places on the training path. Every one of them is
redirected here by a small :class:`~pitstop.patches.Patch`, scoped as narrowly as possible:

* **``torch`` as seen by one Megatron module.** Most sites are ``torch.cuda.current_device()``
  or ``torch.zeros(..., device="cuda")`` inside function bodies (some in closures). Rather than
  patch ``torch.cuda`` for the whole process, the module-global name ``torch`` of just that
  Megatron module is rebound to a :class:`_TorchRedirect`, which forwards everything to the real
  ``torch`` except the few names listed for that module (e.g. only ``torch.cuda.synchronize`` and
  ``torch.cuda.current_device`` for ``p2p_communication``). Anything else CUDA-only still fails
  loudly, as it would without the shim.
* **Functions** (the RNG-state helpers) are replaced outright.
* **Tensor-method checks** (``param.type() == 'torch.cuda.FloatTensor'``, ``weight.data.cuda()``)
  cannot be reached through a module global; the enclosing function is wrapped instead, see
  :func:`_reporting_cuda_type` and the ``language_module`` patch.

The set was found by running ``examples/train_gpt.py`` (TP2 PP2 DP2, TP1 PP2 DP4, TP2 PP1 DP4,
TP1 PP4 DP2) with a logging redirect of every ``torch.cuda.*`` call, ``device="cuda"`` factory,
``.cuda()`` and ``.type()``, and keeping exactly the sites that were hit.

fp32 only: the checks on 16-bit parameter types (``'torch.cuda.BFloat16Tensor'``) in the
distributed optimizer's ``__init__`` are not redirected.

``apply()`` is a no-op when CUDA is available (unless ``force=True``); ``revert()`` restores
every original object.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Iterable, Iterator

from pitstop.errors import PatchError
from pitstop.patches._base import Patch, PatchSet

__all__ = ["PATCHES", "apply", "revert", "is_applied"]

REQUIRES = ">=0.16,<0.17"


# --------------------------------------------------------------------------- helpers
def _is_cuda_device(device: Any) -> bool:
    import torch

    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # A bare int is a CUDA ordinal (what torch.cuda.current_device() returns).
    return isinstance(device, int) and not isinstance(device, bool)


def _on_cpu(factory: Callable) -> Callable:
    """``factory(..., device="cuda")`` -> ``factory(..., device="cpu")``."""

    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


def _cpu_current_device():
    import torch

    return torch.device("cpu")


def _noop_synchronize(device=None) -> None:
    return None


def _cpu_get_rng_state(device="cuda"):
    import torch

    return torch.get_rng_state()


def _cpu_manual_seed(seed) -> None:
    import torch

    torch.default_generator.manual_seed(int(seed))


#: The torch.cuda replacements a module may ask for, by name.
_CUDA_ON_CPU: dict[str, Callable] = {
    "current_device": _cpu_current_device,
    "synchronize": _noop_synchronize,
    "get_rng_state": _cpu_get_rng_state,
    "manual_seed": _cpu_manual_seed,
}


class _CudaRedirect:
    """``torch.cuda`` for one module: the listed functions run on CPU, the rest is real."""

    def __init__(self, real_cuda: types.ModuleType, names: Iterable[str]):
        self._real = real_cuda
        for name in names:
            setattr(self, name, _CUDA_ON_CPU[name])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __repr__(self) -> str:
        return f"<pitstop CPU redirect of {self._real.__name__}>"


class _TorchRedirect(types.ModuleType):
    """Stands in for ``torch`` as the module-global of one Megatron module.

    Only ``cuda.<name>`` for ``cuda`` names and ``<factory>(device="cuda")`` for ``factories``
    are changed; every other attribute is looked up on the real ``torch`` at each access.
    """

    def __init__(self, real_torch: types.ModuleType, owner: str,
                 cuda: Iterable[str] = (), factories: Iterable[str] = ()):
        super().__init__(real_torch.__name__)
        self.__dict__["_pitstop_real"] = real_torch
        self.__dict__["_pitstop_owner"] = owner
        cuda = tuple(cuda)
        if cuda:
            self.__dict__["cuda"] = _CudaRedirect(real_torch.cuda, cuda)
        for name in factories:
            self.__dict__[name] = _on_cpu(getattr(real_torch, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_pitstop_real"], name)

    def __repr__(self) -> str:
        return f"<pitstop CPU redirect of torch for {self.__dict__['_pitstop_owner']}>"


def _torch_patch(module: str, short: str, *, cuda: Iterable[str] = (),
                 factories: Iterable[str] = (), source_contains: tuple[str, ...]) -> Patch:
    cuda, factories = tuple(cuda), tuple(factories)
    name = f"megatron_cpu.torch@{short}"

    def replacement(real_torch):
        if isinstance(real_torch, _TorchRedirect) or getattr(real_torch, "__name__", "") != "torch":
            raise PatchError(f"patch {name!r}: {module}.torch is {real_torch!r}, not the torch "
                             "module (patched by someone else?)")
        return _TorchRedirect(real_torch, module, cuda=cuda, factories=factories)

    return Patch(
        name=name,
        module=module,
        attr="torch",
        replacement=replacement,
        params=None,  # a module: nothing to sign; source_contains pins the call sites
        requires=REQUIRES,
        source_contains=source_contains,
    )


@contextlib.contextmanager
def _reporting_cuda_type(tensors: Iterable[Any]) -> Iterator[None]:
    """While inside, ``t.type()`` (no arguments) on each tensor answers ``'torch.cuda.<T>'``.

    Megatron tells fp32 / fp16 / bf16 parameters apart with ``param.type() ==
    'torch.cuda.FloatTensor'``; on CPU the answer is ``'torch.FloatTensor'``. The override is an
    instance attribute on exactly these tensors and is removed on exit.
    """
    import torch

    done = []
    try:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.is_cuda or "type" in t.__dict__:
                continue

            def cuda_type(*args, _t=t, **kwargs):
                if args or kwargs:
                    return torch.Tensor.type(_t, *args, **kwargs)
                name = torch.Tensor.type(_t)
                return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") else name

            t.type = cuda_type
            done.append(t)
        yield
    finally:
        for t in done:
            t.__dict__.pop("type", None)


# ------------------------------------------------------------------ function patches
def _get_cuda_rng_state_cpu(original):
    import torch

    @functools.wraps(original)
    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        # The CPU generator stands in for the CUDA one; get_rng_state() already copies.
        return torch.get_rng_state()

    return _get_cuda_rng_state


def _set_cuda_rng_state_cpu(original):
    import torch

    @functools.wraps(original)
    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return _set_cuda_rng_state


def _setup_embeddings_cpu(original):
    """Upstream ends with ``weight.data = weight.data.cuda()`` then an all-reduce over the
    embedding group (tied word embeddings across first and last pipeline stage). Run upstream
    with the group test answering False, then do that all-reduce on CPU ourselves."""
    import torch

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self):
        in_group = self._is_in_embd_group
        self.__dict__["_is_in_embd_group"] = lambda: False
        try:
            original(self)
        finally:
            self.__dict__.pop("_is_in_embd_group", None)
        if torch.distributed.is_initialized() and in_group():
            weight = self.shared_embedding_or_output_weight()
            torch.distributed.all_reduce(weight.data, group=self.embd_group)

    return setup_embeddings_and_output_layer


def _clip_grad_cpu(original):
    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        import torch

        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        grads = [getattr(p, "grad", None) for p in parameters]
        with _reporting_cuda_type(g for g in grads if g is not None):
            return original(parameters, max_norm, total_norm, use_decoupled_grad)

    return clip_grad_by_total_norm_fp32


def _build_main_param_groups_cpu(original):
    @functools.wraps(original)
    def _build_model_and_main_param_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges,
                                           config):
        params = [p for group_range in opt_group_ranges for p in group_range["params"]]
        with _reporting_cuda_type(params):
            return original(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)

    return _build_model_and_main_param_groups


# ---------------------------------------------------------------------------- the set
def _build_patches() -> PatchSet:
    mc = "megatron.core"
    return PatchSet(
        "megatron_cpu",
        [
            # --- RNG: the "CUDA" generator is the CPU default generator.
            Patch(
                name="megatron_cpu.random._get_cuda_rng_state",
                module=f"{mc}.tensor_parallel.random",
                attr="_get_cuda_rng_state",
                replacement=_get_cuda_rng_state_cpu,
                params=("device", "clone", "graph_safe"),
                requires=REQUIRES,
            ),
            Patch(
                name="megatron_cpu.random._set_cuda_rng_state",
                module=f"{mc}.tensor_parallel.random",
                attr="_set_cuda_rng_state",
                replacement=_set_cuda_rng_state_cpu,
                params=("new_state", "device", "graph_safe"),
                requires=REQUIRES,
            ),
            # CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed.
            _torch_patch(
                f"{mc}.tensor_parallel.random", "random",
                cuda=("get_rng_state", "manual_seed"),
                source_contains=("torch.cuda.get_rng_state()", "torch.cuda.manual_seed(seed)",
                                 "torch.cuda.manual_seed(data_parallel_seed)"),
            ),
            # --- GlobalMemoryBuffer.get_tensor; local_multi_tensor_l2_norm (grad norm).
            _torch_patch(
                f"{mc}.utils", "utils",
                cuda=("current_device",), factories=("tensor",),
                source_contains=("device=torch.cuda.current_device()",
                                 'l2_cuda = torch.tensor([float(l2_reduced)], dtype=torch.float, '
                                 'device="cuda")'),
            ),
            # --- Pipeline: receive buffers, batch_p2p_sync, token counters.
            _torch_patch(
                f"{mc}.pipeline_parallel.p2p_communication", "p2p_communication",
                cuda=("current_device", "synchronize"),
                source_contains=("device=torch.cuda.current_device()",
                                 "torch.cuda.synchronize()"),
            ),
            _torch_patch(
                f"{mc}.pipeline_parallel.schedules", "schedules",
                factories=("zeros",),
                source_contains=('total_num_tokens = torch.zeros([], dtype=torch.int, '
                                 'device="cuda")',),
            ),
            # --- Tied embeddings across pipeline stages: weight.data.cuda() + all-reduce.
            Patch(
                name="megatron_cpu.language_module.setup_embeddings_and_output_layer",
                module=f"{mc}.models.common.language_module.language_module",
                attr="LanguageModule.setup_embeddings_and_output_layer",
                replacement=_setup_embeddings_cpu,
                params=("self",),
                requires=REQUIRES,
                source_contains=(
                    "if self._is_in_embd_group():",
                    "weight = self.shared_embedding_or_output_weight()",
                    "weight.data = weight.data.cuda()",
                    "torch.distributed.all_reduce(weight.data, group=self.embd_group)",
                ),
            ),
            # --- DDP: the contiguous param/grad buffers are allocated on current_device().
            _torch_patch(
                f"{mc}.distributed.param_and_grad_buffer", "param_and_grad_buffer",
                cuda=("current_device",),
                source_contains=("device=torch.cuda.current_device()",),
            ),
            # --- Optimizers: found-inf / dummy-overflow / unit-scale tensors on 'cuda'.
            _torch_patch(
                f"{mc}.optimizer.optimizer", "optimizer",
                factories=("tensor",),
                source_contains=("torch.tensor([0], dtype=torch.int, device='cuda')",
                                 "torch.tensor([1.0], dtype=torch.float, device='cuda')"),
            ),
            # Grad-norm and clipping scratch tensors on 'cuda'.
            _torch_patch(
                f"{mc}.optimizer.clip_grads", "clip_grads",
                factories=("zeros", "tensor"),
                source_contains=("torch.zeros(1, dtype=torch.int, device='cuda')",),
            ),
            # assert param.grad.type() == 'torch.cuda.FloatTensor' (the name as optimizer.py
            # imported it; clip_grads.clip_grad_by_total_norm_fp32 itself is left alone).
            Patch(
                name="megatron_cpu.optimizer.clip_grad_by_total_norm_fp32",
                module=f"{mc}.optimizer.optimizer",
                attr="clip_grad_by_total_norm_fp32",
                replacement=_clip_grad_cpu,
                params=("parameters", "max_norm", "total_norm", "use_decoupled_grad"),
                requires=REQUIRES,
                source_contains=("assert param.grad.type() == 'torch.cuda.FloatTensor'",),
            ),
            # Distributed optimizer: `elif model_param.type() == 'torch.cuda.FloatTensor'`,
            # else TypeError.
            Patch(
                name="megatron_cpu.distrib_optimizer._build_model_and_main_param_groups",
                module=f"{mc}.optimizer.distrib_optimizer",
                attr="DistributedOptimizer._build_model_and_main_param_groups",
                replacement=_build_main_param_groups_cpu,
                params=("cls", "gbuf_ranges", "param_gbuf_map", "opt_group_ranges", "config"),
                requires=REQUIRES,
                source_contains=("model_param.type() == 'torch.cuda.FloatTensor'",
                                 'for model_param in group_range["params"]:'),
            ),
        ],
    )


PATCHES: PatchSet = _build_patches()


def apply(force: bool = False) -> bool:
    """Apply the shim when CUDA is unavailable (or when ``force``). Returns whether it is applied.

    Raises :class:`pitstop.errors.PatchError`, with nothing applied, if any patch does not fit
    the installed megatron-core.
    """
    if PATCHES.applied:
        return True
    if not force:
        import torch

        if torch.cuda.is_available():
            return False
    PATCHES.apply()
    return True


def revert() -> None:
    """Restore every patched Megatron attribute. A no-op when not applied."""
    PATCHES.revert()


def is_applied() -> bool:
    return PATCHES.applied
