"""Named, version-guarded, reversible patches of third-party code.

:class:`Patch` and :class:`PatchSet` are the framework; :mod:`pitstop.patches.megatron_cpu` is
the CPU shim for megatron-core (import it explicitly: it is not loaded by this package).
"""

from pitstop.errors import PatchError
from pitstop.patches._base import Patch, PatchSet

__all__ = ["Patch", "PatchSet", "PatchError"]
