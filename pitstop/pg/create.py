"""Real communicators made directly through c10d's private helpers, registered like torch's
own, and destroyed one at a time.

This is the only module that touches torch.distributed's private bookkeeping
(``distributed_c10d._new_process_group_helper``, ``_register_pg_in_world``,
``_world.pg_group_ranks``; :mod:`pitstop.pg.world` only asks ``_get_default_group``). ``tests/test_pg.py`` pins their signatures, so an
upstream change fails loudly there instead of silently here."""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from pitstop.errors import GroupError
from pitstop.pg.fence import Fence, GuardedGroup


def new_comm(
    ranks: Sequence[int],
    backend: str,
    store: dist.Store,
    name: str,
    timeout: timedelta,
    desc: str,
    fence: Optional["Fence"] = None,
    deferred: Optional[List[Callable[[], None]]] = None,
) -> dist.ProcessGroup:
    """Create one communicator of ``ranks``, called by its members only (no world barrier).

    ``store`` should already carry the generation prefix; the group's own keys go
    under ``name/``. Registers the group with c10d so that ``get_rank(group)``,
    ``get_process_group_ranks(group)``, ``broadcast(src=<global>)`` and
    ``destroy_process_group(group)`` work. Like ``new_group``, the group rank of
    a member is its position among the sorted global ranks. With a ``fence`` the
    communicator is returned wrapped in a :class:`GuardedGroup` (registered under
    ``name``; the raw one under ``name~raw``).

    ``deferred`` (a joiner building its role, see :class:`Fence.local`): the guarded
    group is returned at once with no communicator inside, and a function that
    rendezvouses and attaches the communicator is appended to ``deferred`` (``store``
    may then be a function that returns the store, called by that function). Until it
    ran, the group answers only while the fence is local; the caller runs the list
    (in order, in a background thread) and waits for it before the fence opens.
    """
    ranks = sorted(ranks)  # as torch's new_group does: group rank = position in sorted order
    me = dist.get_rank()
    if me not in ranks:
        raise GroupError(f"rank {me} is not a member of group {name} {ranks}")
    if deferred is not None:
        if fence is None:
            raise GroupError(f"group {name}: a deferred communicator needs a fence to answer for it until it exists")
        guarded = GuardedGroup(None, ranks.index(me), len(ranks), name, fence, kind=desc, backend=backend)
        register_python_group(guarded, name, ranks, desc)

        def attach() -> None:  # ``store`` may be a function that opens the connection only now
            guarded.attach(new_comm(ranks, backend, store() if callable(store) else store, name + "~raw", timeout, desc))

        deferred.append(attach)
        return guarded
    raw_name = name if fence is None else name + "~raw"
    try:
        pg, _ = c10d._new_process_group_helper(
            len(ranks), ranks.index(me), ranks, backend, store, raw_name,
            timeout=timeout, group_desc=desc,
        )
    except Exception as exc:  # gloo reports a peer that never came as a generic error
        raise GroupError(f"creating {desc} group {name} over ranks {ranks} failed: {exc}") from exc
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    if fence is None:
        return pg
    guarded = GuardedGroup(pg, ranks.index(me), len(ranks), name, fence, kind=desc)
    guarded.raw = pg
    register_python_group(guarded, name, ranks, desc)
    return guarded


def register_python_group(pg: dist.ProcessGroup, name: str, ranks: Sequence[int], desc: str) -> None:
    """Make a Python-implemented group known to c10d like a real one."""
    pg._set_group_name(name)
    pg._set_group_desc(desc)
    mapping = {g: i for i, g in enumerate(sorted(ranks))}
    if hasattr(c10d, "_register_pg_in_world"):
        c10d._register_pg_in_world(pg, backend_name=pg.getBackendName(), store=None, group_name=name,
                                   backend_config=pg.getBackendName(), rank_mapping=mapping)
    else:
        _register_pg_in_world_compat(pg, name, mapping)


def _register_pg_in_world_compat(pg: dist.ProcessGroup, name: str, mapping: Dict[int, int]) -> None:
    """What torch 2.13's ``c10d._register_pg_in_world`` does, for a torch without it (2.11,
    the CUDA image ``scripts/gpu_check`` met): the same tables, filled the same way, so
    ``get_rank(group)``, tags and name resolution behave alike. ``tests/test_pg.py`` checks
    the two agree table by table on the torch that has both."""
    w = c10d._world
    w.pg_map[pg] = (pg.getBackendName(), None)
    w.pg_names[pg] = name
    w.pg_backend_config[pg] = pg.getBackendName()
    c10d._register_process_group(name, pg)
    w.pg_group_ranks[pg] = mapping
    tag = f"ptd:{name}"
    w.tags_to_pg.setdefault(tag, []).append(pg)
    w.pg_to_tag[pg] = tag


def rename(pg: dist.ProcessGroup, new: str) -> bool:
    """Give a registered Python group (:class:`GuardedGroup`, :class:`CompositeGroup`) the
    c10d name ``new``: its entry in c10d's tables, its tag and the name registry that
    functional collectives resolve by. Returns False, changing nothing, if another live group
    holds ``new`` or ``pg`` is not a registered Python group.

    Why: ``torch.compile`` guards a collective on its group's ``group_name``. A generation's
    unique name (``pitstop:g1:tp:<digest>``) makes every rebuilt group, and a joiner's groups
    against the ones its warmup sandbox compiled with, a guard failure and a recompile. A
    group installed under a name that does not change (``pitstop:tp``) reuses the code."""
    w = c10d._world
    old = w.pg_names.get(pg)
    if old is None or not hasattr(pg, "public"):
        return False
    if old == new:
        return True
    if new in w.pg_names.values():
        return False
    c10d._unregister_process_group(old)
    pg.public = new
    w.pg_names[pg] = new
    c10d._register_process_group(new, pg)
    tag = w.pg_to_tag.get(pg)
    if tag is not None and tag == f"ptd:{old}":
        members = w.tags_to_pg.get(tag, [])
        if pg in members:
            members.remove(pg)
        if not members:
            w.tags_to_pg.pop(tag, None)
        w.tags_to_pg.setdefault(f"ptd:{new}", []).append(pg)
        w.pg_to_tag[pg] = f"ptd:{new}"
    return True


#: Broken groups whose operations may still be pending in their worker threads:
#: kept alive (never destroyed, whose join would block) until the process exits.
GRAVEYARD: List[dist.ProcessGroup] = []


def destroy(pg: dist.ProcessGroup) -> None:
    """Destroy one group; the rest of the process's groups stay usable."""
    raw = getattr(pg, "raw", None)
    if isinstance(pg, GuardedGroup) and pg.broken:
        if pg in c10d._world.pg_map:
            dist.destroy_process_group(pg)  # the Python wrapper: unregistered, nothing to join
        GRAVEYARD.append(raw)
        return
    if pg in c10d._world.pg_map:
        dist.destroy_process_group(pg)
    if raw is not None and raw in c10d._world.pg_map:
        dist.destroy_process_group(raw)
