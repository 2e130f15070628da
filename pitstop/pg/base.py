"""What every Python process group of pitstop shares: the work object of a synchronous
operation, backend work kept out of the tensor-memory tracker, and the one table of c10d
methods a group written in Python must define (the guarded group and the virtual backend
both take theirs from it)."""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from pitstop.memory import untracked


class _Abandoned(Exception):
    """A world operation given up because a member failed (the step is poisoned)."""


def _backend_work(method):
    """Run a Python group's operation as backend work: what it allocates to do its work is
    the backend's, not the program's, so the tensor-memory tracker (if one runs) skips it.
    An operation abandoned under an armed fence completes at once, its outputs untouched:
    the fence already holds the error that discards the step."""
    def wrapped(self, *args, **kwargs):
        with untracked():
            try:
                return method(self, *args, **kwargs)
            except _Abandoned:
                return DoneWork()

    wrapped.__name__ = method.__name__
    wrapped.__doc__ = method.__doc__
    return wrapped


class DoneWork(dist._Work):
    """A work object for an operation that already completed synchronously."""

    def __init__(self, result: Optional[List[torch.Tensor]] = None) -> None:
        super().__init__()
        self._result = result or []

    def wait(self, timeout: timedelta | None = None) -> bool:  # noqa: ARG002
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> List[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


#: Every ProcessGroup method that c10d's Python API calls on a group, collectives and
#: point-to-point alike. A group written in Python must define each one, or the call
#: reaches the C++ base and fails; the guarded group and the virtual backend both take
#: their methods from this one table (:func:`install_methods`). torch 2.13's
#: ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (and coalesced forms) call the
#: ``*_single`` ones.
C10D_METHODS = (
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "all_gather_single", "reduce_scatter_single",
    "all_gather_single_coalesced", "reduce_scatter_single_coalesced", "broadcast", "reduce", "gather",
    "scatter", "alltoall", "alltoall_base", "send", "recv", "recv_anysource", "barrier", "monitored_barrier",
)


def install_methods(cls: type, make: Callable[[str], Callable]) -> type:
    """Give ``cls`` every method of :data:`C10D_METHODS`, each built by ``make(name)``."""
    for name in C10D_METHODS:
        setattr(cls, name, make(name))
    return cls


def _op(reduce_op) -> "dist.ReduceOp.RedOpType":
    """The plain op type of an options' ``reduceOp`` (a ``ReduceOp`` wrapping a ``RedOpType``)."""
    return getattr(reduce_op, "op", reduce_op)


_COMPOSABLE = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)
