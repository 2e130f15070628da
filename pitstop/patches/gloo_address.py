"""Bind every gloo communicator of this process to one address: a "machine" on one host.

c10d builds gloo groups with ``ProcessGroupGloo(store, rank, size, timeout=...)``, whose
device comes from the host name (or ``GLOO_SOCKET_IFNAME``, an interface, whose first
address is taken): every process on a host listens on the same address. pitstop's
multi-machine tests give each agent ("machine") its own loopback address (127.0.0.2,
127.0.0.3, ...), so that a group's connections really go between machine addresses.
c10d ignores gloo options in ``new_group`` (``backend_options`` is dropped for gloo), so
the one patch here replaces ``torch.distributed.distributed_c10d.ProcessGroupGloo``, the
name c10d constructs through, with a subclass that passes a device bound to
``PITSTOP_GLOO_ADDR``. It is a subclass, so c10d's ``isinstance`` checks hold.

Guarded by torch's version and by the line of c10d it relies on; ``revert()`` restores
the original class. Applied by ``pitstop.runtime.worker.join`` when an agent set
``PITSTOP_GLOO_ADDR``; a no-op otherwise.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

from pitstop.patches._base import Patch, PatchSet

ENV_ADDR = "PITSTOP_GLOO_ADDR"
REQUIRES = ">=2.6,<2.15"


def options(addr: str, timeout: Optional[timedelta]):
    """Gloo options with one device listening on ``addr`` (for groups pitstop builds itself)."""
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    if timeout is not None:
        opts._timeout = timeout
    opts._devices = [ProcessGroupGloo.create_device(hostname=addr)]
    return opts


def _bound(original):
    class ProcessGroupGloo(original):  # noqa: D401 - same name as what c10d prints
        """c10d's ``ProcessGroupGloo``, listening on ``PITSTOP_GLOO_ADDR``."""

        def __init__(self, store, rank, size, *args, timeout: Optional[timedelta] = None, **kw):
            addr = os.environ.get(ENV_ADDR)
            if addr and not args and not kw:
                super().__init__(store, rank, size, options(addr, timeout))
            elif timeout is not None:
                super().__init__(store, rank, size, *args, timeout=timeout, **kw)
            else:
                super().__init__(store, rank, size, *args, **kw)

    ProcessGroupGloo.__pitstop_patch__ = "gloo_address"
    ProcessGroupGloo.__module__ = original.__module__
    return ProcessGroupGloo


PATCHES = PatchSet("gloo_address", [
    Patch(
        name="gloo_address.ProcessGroupGloo",
        module="torch.distributed.distributed_c10d",
        attr="ProcessGroupGloo",
        replacement=_bound,
        params=None,
        requires=REQUIRES,
        dist="torch",
        source_contains=("backend_class = ProcessGroupGloo(",),
    ),
])


def apply() -> bool:
    """Apply when ``PITSTOP_GLOO_ADDR`` is set; returns whether it is applied."""
    if os.environ.get(ENV_ADDR):
        PATCHES.apply()
    return PATCHES.applied


def revert() -> None:
    PATCHES.revert()
