r"""Process groups on top of c10d: pitstop's communication layer, one module per concern::

    tap        the recording tap: one hook sees every operation (the warmup recorder's)
    base       what every Python group shares: synchronous work, the c10d method table
    fence      the fault fence, and real communicators behind it (GuardedGroup, GuardedWork)
    create     real communicators made and registered through c10d's private helpers
    world      StoreWorldGroup, the default group: collectives through the control store
    composite  CompositeGroup, the product of two orthogonal communicators (tp x dp)

    tap   base              each module imports only the modules above it;
      \   /  \             this package file imports them all, and none
      fence    composite    of them imports this file's names
      /   \
  create  world

Every name is re-exported here, so ``from pitstop.pg import GuardedGroup`` and
``pitstop.pg.FENCE`` read as before. ``TAP`` lives in :mod:`pitstop.pg.tap`; reading or
setting ``pitstop.pg.TAP`` reads or sets that one (the operations look there).
"""

from __future__ import annotations

import sys
import types

from pitstop.pg import tap
from pitstop.pg.base import (  # noqa: F401
    _Abandoned, _backend_work, DoneWork, C10D_METHODS, install_methods, _op, _COMPOSABLE,
)
from pitstop.pg.fence import (  # noqa: F401
    Fence, FENCE, _P2P, _WAIT_IN_THREAD, _wait_into, GuardedWork, _forward, GuardedGroup, _tensors, RELEASE_WAIT_S, _until_released, _outputs,
)
from pitstop.pg.create import (  # noqa: F401
    new_comm, register_python_group, _register_pg_in_world_compat, GRAVEYARD, destroy, rename,
)
from pitstop.pg.world import (  # noqa: F401
    WORLD_BACKEND, _reduce, _tensor, _raw, StoreWorldGroup, _world_creator, init_world, world_connections, world_group,
)
from pitstop.pg.composite import (  # noqa: F401
    CompositeGroup,
)
from pitstop.pg.tap import _tapped  # noqa: F401,E402


class _Facade(types.ModuleType):
    """``pitstop.pg.TAP`` is :data:`pitstop.pg.tap.TAP`, for reads and writes alike: an
    assignment to a plain module attribute would shadow it where no operation looks."""

    def __getattr__(self, name: str):
        if name == "TAP":
            return tap.TAP
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name == "TAP":
            tap.TAP = value
        else:
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade
