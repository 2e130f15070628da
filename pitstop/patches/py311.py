"""``typing.override`` on Python 3.11, for megatron-core 0.19's ``megatron.training``.

megatron-core 0.19.2 ships one wheel, tagged cp311, whose metadata says
``Requires-Python >=3.12``; pitstop's second lane installs it on 3.11 with
``--ignore-requires-python`` (README, "Two lanes"). Byte-compiling every module of the
wheel under 3.11 finds no syntax of 3.12; the one thing 3.12 has that it imports is
``typing.override`` (``megatron/training/models/hybrid.py`` and one other module), a
decorator that only marks a method. ``typing_extensions.override`` is the same
decorator, back-ported by the typing maintainers.

:func:`apply` puts it on ``typing`` only where it is missing and only for megatron-core
0.19.x; :func:`revert` takes it off again. ``tests/lm/test_patches_lm.py`` fails when an
upstream release no longer needs it, or needs more.
"""

from __future__ import annotations

import sys
import typing

from pitstop.errors import PatchError

REQUIRES = ">=0.19,<0.20"

_applied = False


def apply() -> bool:
    """Give ``typing`` an ``override`` when it has none. Returns whether it was added now.

    Raises :class:`PatchError` when the installed megatron-core is not 0.19.x (the only
    release checked to need exactly this)."""
    global _applied
    if _applied or hasattr(typing, "override"):
        return False
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    try:
        have = version("megatron-core")
    except PackageNotFoundError:
        raise PatchError("patch 'py311.typing.override': megatron-core is not installed") from None
    if have not in SpecifierSet(REQUIRES):
        raise PatchError(f"patch 'py311.typing.override': megatron-core {have} is not in {REQUIRES!r}; "
                         f"check what it needs of Python {sys.version_info.major}.{sys.version_info.minor} first")
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]
    _applied = True
    return True


def revert() -> None:
    """Take back what :func:`apply` added (nothing when it added nothing)."""
    global _applied
    if _applied:
        del typing.override  # type: ignore[attr-defined]
        _applied = False


def is_applied() -> bool:
    return _applied
