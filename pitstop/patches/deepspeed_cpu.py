"""A CPU shim for DeepSpeed 0.19: do not JIT-compile ``deepspeed_shm_comm`` for training on gloo.

With ``DS_ACCELERATOR=cpu``, the first ``deepspeed.comm.torch.TorchBackend`` (created by
``deepspeed.init_distributed`` or ``deepspeed.initialize``) calls ``build_shm_op()``, which
JIT-compiles the shared-memory all-reduce op with g++ and ninja into ``TORCH_EXTENSIONS_DIR``
(about 40 s per fresh directory on two cores; a cached build loads in milliseconds). The op
serves one call only, ``TorchBackend.inference_all_reduce`` (AutoTP inference), and even there
it is used only when ``torch.ops.deepspeed.inference_all_reduce_`` exists; without it that call
falls back to ``torch.distributed.all_reduce``. Training (ZeRO 0-3, the engine, gradient
reduction) never calls it. Its ``initialize(world_size, rank)`` only maps shared memory when the
environment variable ``LOCAL_SIZE`` equals the world size, which torchrun does not set.

The one patch here makes ``deepspeed.comm.torch.build_shm_op`` return ``None``: the value
``TorchBackend.__init__`` already handles (``if self.shm_comm_op != None:``) when the op is not
compatible, so the backend takes its own, upstream, no-op path: no build, no import of the
extension, no ``shm_comm_op.initialize``. Nothing else changes. The patch is guarded by the
deepspeed version (``>=0.19,<0.20``), the empty signature, and the source lines it relies on,
in ``build_shm_op`` and in its two callers' handling of ``None``.

It must be applied before the first ``TorchBackend`` exists (before ``deepspeed.init_distributed``
/ ``deepspeed.initialize``) to save anything; applied later it still applies (a later backend
skips the build) and logs a warning that this process already built or loaded the op.
``apply()`` is a no-op with CUDA present (unless ``force=True``); ``revert()`` restores the
original function.

The alternative, keeping the op and paying its build once, is a persistent
``TORCH_EXTENSIONS_DIR`` (see :func:`extensions_dir_has_shm_op`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
from typing import Optional

from pitstop.errors import PatchError
from pitstop.patches._base import Patch, PatchSet

__all__ = ["PATCHES", "apply", "revert", "is_applied", "extensions_dir_has_shm_op"]

log = logging.getLogger(__name__)

REQUIRES = ">=0.19,<0.20"
DIST = "deepspeed"


def _no_shm_op(original):
    @functools.wraps(original)
    def build_shm_op():
        # Same answer as upstream when ShareMemCommBuilder is not compatible: no op.
        return None

    build_shm_op.__pitstop_patch__ = "deepspeed_cpu.comm.torch.build_shm_op"
    return build_shm_op


def _build_patches() -> PatchSet:
    return PatchSet(
        "deepspeed_cpu",
        [
            Patch(
                name="deepspeed_cpu.comm.torch.build_shm_op",
                module="deepspeed.comm.torch",
                attr="build_shm_op",
                replacement=_no_shm_op,
                params=(),
                requires=REQUIRES,
                dist=DIST,
                source_contains=(
                    'get_accelerator().create_op_builder("ShareMemCommBuilder")',
                    "return None",
                    "shm_cpp_module = builder.load()",
                ),
            ),
        ],
    )


PATCHES: PatchSet = _build_patches()

#: What the callers of ``build_shm_op`` must still do for ``None`` to be safe.
_CALLER_SOURCE = {
    "TorchBackend.__init__": ("self.shm_comm_op = build_shm_op()", "if self.shm_comm_op != None:"),
    "TorchBackend.inference_all_reduce": ("hasattr(torch.ops.deepspeed, 'inference_all_reduce_')",
                                          "torch.distributed.all_reduce("),
}


def _check_callers() -> None:
    mod = importlib.import_module("deepspeed.comm.torch")
    errors = []
    for qual, fragments in _CALLER_SOURCE.items():
        obj = mod
        for part in qual.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            errors.append(f"deepspeed.comm.torch.{qual} is gone")
            continue
        src = inspect.getsource(obj)
        missing = [f for f in fragments if f not in src]
        if missing:
            errors.append(f"deepspeed.comm.torch.{qual}: source changed, no longer contains {missing!r}")
    if errors:
        raise PatchError("patch set 'deepspeed_cpu' does not fit the installed code, nothing applied:\n  "
                         + "\n  ".join(errors))


def _backend_exists() -> bool:
    comm = importlib.import_module("deepspeed.comm.comm")
    return getattr(comm, "cdb", None) is not None


def apply(force: bool = False) -> bool:
    """Skip the ``deepspeed_shm_comm`` build when CUDA is unavailable (or when ``force``).

    Returns whether the patch is applied. Raises :class:`PatchError`, with nothing applied, if
    the installed deepspeed does not fit. If a DeepSpeed communication backend exists already
    (the op was built or loaded), a warning says so.
    """
    if PATCHES.applied:
        return True
    if not force:
        import torch

        if torch.cuda.is_available():
            return False
    PATCHES.check()
    _check_callers()
    if _backend_exists():
        log.warning("deepspeed_cpu applied after deepspeed.comm made its backend: this process has built or "
                    "loaded deepspeed_shm_comm already; apply it before deepspeed.init_distributed")
    PATCHES.apply()
    return True


def revert() -> None:
    """Restore ``deepspeed.comm.torch.build_shm_op``. A no-op when not applied."""
    PATCHES.revert()


def is_applied() -> bool:
    return PATCHES.applied


def extensions_dir_has_shm_op(path: Optional[str] = None) -> bool:
    """Whether the extensions root ``path`` holds a built ``deepspeed_shm_comm``, so DeepSpeed loads
    it instead of compiling. ``path`` defaults to ``TORCH_EXTENSIONS_DIR``, else torch's default
    root (``~/.cache/torch_extensions/py311_cpu`` on a CPU build). Creates nothing."""
    if path is None:
        path = os.environ.get("TORCH_EXTENSIONS_DIR")
    if path is None:
        import sys

        import torch
        from torch.utils.cpp_extension import get_default_build_root

        acc = ("rocm" + torch.version.hip.replace(".", "") if torch.version.hip
               else "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu")
        path = os.path.join(get_default_build_root(),
                            f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{acc}")
    d = os.path.join(path, "deepspeed_shm_comm")
    return os.path.isfile(os.path.join(d, "deepspeed_shm_comm.so"))
