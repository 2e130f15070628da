"""The virtual process-group backend: a group whose peers have no process behind them.

Every operation of a :class:`VirtualGroup` is answered by an *oracle*, in the calling
thread, with nothing sent anywhere. The oracle decides what the peers' contributions
were: the warmup sandbox replays the values a real rank recorded
(:class:`pitstop.record.ReplayOracle`); emulation synthesises them. The
group plugs in behind torch.distributed's backend interface, so Megatron, DeepSpeed
and pitstop's own registry create it exactly as they create a gloo group::

    dist.init_process_group("pitstop_virtual", store=HashStore(), rank=5, world_size=8)
    registry = GroupRegistry(layout, store, backend="pitstop_virtual")   # no peer, no network

The oracle in charge is the one installed with :func:`serving` when the group is
created.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Protocol

import torch
import torch.distributed as dist

from pitstop.memory import untracked
from pitstop.errors import GroupError
from pitstop.pg import DoneWork, _outputs, install_methods

VIRTUAL_BACKEND = "pitstop_virtual"


class Oracle(Protocol):
    """Answers the operations of virtual groups."""

    def serve(self, group: "VirtualGroup", what: str, args: tuple) -> None:
        """Fill the output tensors of operation ``what`` (a ProcessGroup method name, e.g.
        ``allreduce``, ``_allgather_base``, ``send``) on ``group`` (its ``kind``, global
        ``ranks``, ``rank()`` and ``size()``); ``args`` are the method's positional
        arguments exactly as c10d passes them (tensor lists, then an options object or
        the peer and tag for send/recv)."""


_ORACLE: Optional[Oracle] = None


@contextlib.contextmanager
def serving(oracle: Oracle) -> Iterator[Oracle]:
    """Virtual groups created inside this block are answered by ``oracle``."""
    global _ORACLE
    old, _ORACLE = _ORACLE, oracle
    try:
        yield oracle
    finally:
        _ORACLE = old


def set_oracle(oracle: Optional[Oracle]) -> None:
    """Answer every virtual group created from now on with ``oracle`` (for a process that
    lives in an emulated world; a bounded use is :func:`serving`)."""
    global _ORACLE
    _ORACLE = oracle


def kind_of(group_name: str, ranks: List[int]) -> str:
    """The layout kind of a group from its name (``pitstop:g0:tp+gloo:ab12`` -> ``tp``);
    the default group (no explicit ranks) is ``world``."""
    if not ranks or group_name in ("", "0", "default_pg"):
        return "world"
    parts = group_name.split(":")
    base = parts[2] if len(parts) >= 4 and parts[0] == "pitstop" else group_name
    return base.split("+")[0].split("~")[0]


def _method(what: str):
    def method(self: "VirtualGroup", *args, **kwargs):  # noqa: ARG001 - options carry nothing we need
        with untracked():  # an oracle's scratch for virtual peers is not the program's memory
            self.oracle.serve(self, what, args)
        self.ops += 1
        return DoneWork(_outputs(what, args) if what not in ("send", "barrier", "monitored_barrier") else [])

    method.__name__ = what
    return method


class VirtualGroup(dist.ProcessGroup):
    """A process group answered entirely by an :class:`Oracle` (see the module docstring)."""

    def __init__(self, rank: int, size: int, kind: str, ranks: List[int], oracle: Oracle, name: str = "") -> None:
        super().__init__(rank, size)
        self._name = name or kind
        self.kind = kind
        self.ranks = list(ranks)
        self.oracle = oracle
        self.ops = 0
        """How many operations this group has answered."""

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return VIRTUAL_BACKEND

    def shutdown(self) -> None:
        """Nothing to close."""

    @property
    def group_name(self) -> str:  # c10d keeps names on backends; a Python group has none
        return self._name


install_methods(VirtualGroup, _method)


def _create(dist_opts, backend_opts) -> VirtualGroup:  # noqa: ARG001
    if _ORACLE is None:
        raise GroupError(
            f"a {VIRTUAL_BACKEND} group ({dist_opts.group_id!r}) was created outside "
            "pitstop.virtual.serving(oracle): nothing would answer its operations"
        )
    ranks = list(dist_opts.global_ranks_in_group)
    name = str(dist_opts.group_id)
    return VirtualGroup(dist_opts.group_rank, dist_opts.group_size, kind_of(name, ranks), ranks, _ORACLE, name)


def register() -> str:
    """Register the backend with torch.distributed (idempotent); returns its name."""
    if VIRTUAL_BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(VIRTUAL_BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    return VIRTUAL_BACKEND


def tensors_of(args: tuple) -> List[torch.Tensor]:
    """Every tensor in an operation's first argument (its outputs, or a send's payload)."""
    return _outputs("", args)
