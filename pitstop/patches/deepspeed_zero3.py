"""DeepSpeed 0.19: do not format every parameter's values when a ZeRO-3 optimizer is built.

``DeepSpeedZeroOptimizer_Stage3.__init__`` starts with::

    print_rank_0(f"initialized {__class__.__name__} with args: {locals()}", force=False)

The f-string is evaluated before ``print_rank_0`` decides, with ``force=False``, to print
nothing. ``locals()`` holds ``param_names``, the engine's ``{parameter: name}`` dict, and the
repr of that dict is the repr of every parameter, values included: torch walks each tensor to
choose a format and prints a summary of it, and on CUDA each summary is a copy to the host.
On the benchmark's 29-parameter CPU model that is 0.05-0.09 s of a joiner's 0.15-0.23 s engine
build (cProfile of the joiner, ``torch._tensor_str``), on the critical path of a replacement,
and the same again in every process of a restart.

The one patch here wraps ``__init__``: ``param_names`` goes on as a :class:`ParamNames`, a
``dict`` with the same items whose repr gives the number of parameters instead of their
values. The optimizer only looks names up in it (``param in self.param_names``,
``self.param_names[param]``), which a dict subclass answers the same. Nothing else changes;
the message that is never printed says ``{<29 parameters>}`` where it would have said the
values. Guarded by the deepspeed version (``>=0.19,<0.20``), the ``param_names`` parameter
and the source line above; ``revert()`` restores the original ``__init__``.
"""

from __future__ import annotations

import functools
import inspect
import logging

from pitstop.errors import PatchError
from pitstop.patches._base import Patch, PatchSet

__all__ = ["PATCHES", "ParamNames", "apply", "revert", "is_applied"]

log = logging.getLogger(__name__)

REQUIRES = ">=0.19,<0.20"
DIST = "deepspeed"
TARGET_SOURCE = ('print_rank_0(f"initialized {__class__.__name__} with args: {locals()}", force=False)',
                 "self.param_names = param_names")


class ParamNames(dict):
    """The engine's ``{parameter: name}``, whose repr counts the parameters instead of printing them."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{{<{len(self)} parameters>}}"


def _short_param_names(original):
    sig = inspect.signature(original)
    if "param_names" not in sig.parameters:
        raise PatchError("patch 'deepspeed_zero3' on DeepSpeedZeroOptimizer_Stage3.__init__: "
                         f"no parameter 'param_names' in ({', '.join(sig.parameters)})")

    @functools.wraps(original)
    def __init__(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        names = bound.arguments.get("param_names")
        if type(names) is dict:
            bound.arguments["param_names"] = ParamNames(names)
        return original(*bound.args, **bound.kwargs)

    __init__.__pitstop_patch__ = "deepspeed_zero3.DeepSpeedZeroOptimizer_Stage3.__init__"
    return __init__


PATCHES = PatchSet(
    "deepspeed_zero3",
    [
        Patch(
            name="deepspeed_zero3.DeepSpeedZeroOptimizer_Stage3.__init__",
            module="deepspeed.runtime.zero.stage3",
            attr="DeepSpeedZeroOptimizer_Stage3.__init__",
            replacement=_short_param_names,
            params=None,  # checked by name in the wrapper: the optimizer's 40-odd keywords move between releases
            requires=REQUIRES,
            dist=DIST,
            source_contains=TARGET_SOURCE,
        ),
    ],
)


def apply() -> bool:
    """Apply the patch; returns whether it is applied. An installed deepspeed that does not fit
    is logged and left as it is (the patch saves time only; training is the same without it);
    ``tests/test_deepspeed_engine.py`` fails loudly on it instead."""
    if PATCHES.applied:
        return True
    try:
        PATCHES.apply()
    except PatchError as exc:
        log.warning("ZeRO-3 engine builds format every parameter (pitstop's patch does not fit): %s", exc)
        return False
    return True


def revert() -> None:
    """Restore ``DeepSpeedZeroOptimizer_Stage3.__init__``. A no-op when not applied."""
    PATCHES.revert()


def is_applied() -> bool:
    return PATCHES.applied
