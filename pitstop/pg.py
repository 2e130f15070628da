"""Process-group plumbing on top of c10d: direct creation, registration, Python groups.

This is the only module that touches torch.distributed's private bookkeeping
(``distributed_c10d._new_process_group_helper``, ``_register_pg_in_world``,
``_world.pg_group_ranks``). ``tests/test_pg.py`` pins their signatures, so an
upstream change fails loudly there instead of silently here.

Two Python process groups live here:

* :class:`StoreWorldGroup` is pitstop's default ("world") group. It has no mesh of
  connections: barrier and the rare small world collective go through the control
  store, keyed by a sequence number. So a process can take over a role without any
  world-wide rebuild, which a gloo or NCCL world group would need.
* :class:`CompositeGroup` is the product of two orthogonal communicators (e.g.
  tp x dp): an all-reduce over it is an all-reduce over the inner group followed by
  one over the outer group. A world-spanning Megatron group (the distributed
  optimizer's grad-stats group) is built this way, so replacing one role never
  rebuilds a world-sized communicator.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from pitstop.errors import GroupError
from pitstop import memory
from pitstop.memory import untracked
from pitstop.protocol import Refused, open_raw, seal_raw
from pitstop.store import SharedConnection

log = logging.getLogger(__name__)

WORLD_BACKEND = "pitstop_world"

#: A hook that sees every operation of every guarded group and of the world group:
#: ``TAP(kind, what, args)`` is called as an operation is issued and may return a
#: callable, called once the operation has completed. The warmup recorder
#: (:mod:`pitstop.record`) sets it for one iteration; otherwise it is None
#: and costs one attribute test per operation.
TAP: Optional[Callable[[str, str, tuple], Optional[Callable[[], None]]]] = None


def _tapped(kind: str, what: str, args: tuple) -> Optional[Callable[[], None]]:
    return TAP(kind, what, args) if TAP is not None else None


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


def _op(reduce_op) -> "dist.ReduceOp.RedOpType":
    """The plain op type of an options' ``reduceOp`` (a ``ReduceOp`` wrapping a ``RedOpType``)."""
    return getattr(reduce_op, "op", reduce_op)


_COMPOSABLE = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)


def _reduce(op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    op = _op(op)
    if op == dist.ReduceOp.SUM:
        return a + b
    if op == dist.ReduceOp.MAX:
        return torch.maximum(a, b)
    if op == dist.ReduceOp.MIN:
        return torch.minimum(a, b)
    if op == dist.ReduceOp.PRODUCT:
        return a * b
    raise GroupError(f"reduce op {op} is not supported by pitstop's store-backed world group")


def _tensor(raw, like: torch.Tensor, offset: int = 0, whole: bool = True) -> torch.Tensor:
    """The inverse of :func:`_raw`: ``like``'s dtype and shape over ``raw`` from ``offset``
    (``whole``: ``raw`` must hold exactly that many bytes). An empty tensor has no bytes,
    which ``frombuffer`` refuses: it comes back empty."""
    n = like.numel() * like.element_size()
    if (len(raw) != n) if whole else (len(raw) < offset + n):
        raise GroupError(f"world operation: {len(raw)} bytes for a {like.dtype} tensor of shape "
                         f"{list(like.shape)} ({n} bytes) at offset {offset}")
    if n == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    return torch.frombuffer(raw, dtype=torch.uint8, count=n, offset=offset).view(like.dtype).view(like.shape)


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, for the store: flattened first, so a 0-dim tensor (DeepSpeed's ZeRO-3
    broadcasts scalars over the world) has bytes too (``view(uint8)`` refuses 0 dims)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class StoreWorldGroup(dist.ProcessGroup):
    """The default group: rank and size of the world, collectives through the store.

    It exists so that Megatron's incidental world operations (a barrier around
    dataset building, ``get_rank()``, ``get_world_size()``) work without a mesh of
    connections that every roster change would have to rebuild. Data collectives go
    through the store and are meant for small tensors only; the training step never
    uses the world group.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._seq = 0
        self._broken = False
        self._mark_lock = threading.Lock()  # a mark for an old epoch must not land after a rewind
        self._epoch = 0
        """Names this stream of operations: set to the generation at every replacement, so an
        operation redone after a rollback (same count) never reads a value the aborted
        attempt left in the store."""
        self.recording = True
        """Rank 0 records results for joiners' set-up replay until the first boundary
        (:meth:`stop_recording`); later operations would only pile up in the store."""
        self._can_delete = True
        from pitstop import store as _store

        self._token = _store.JOB_TOKEN
        """Seals every value this group writes (None outside a pitstop job)."""
        self.detached = False
        """A joiner builds its model before it is in step with the world: until
        :meth:`attach` its world operations are answered from rank 0's record."""

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return WORLD_BACKEND

    @property
    def seq(self) -> int:
        """How many world operations this process has done (equal on every rank at an iteration boundary)."""
        return self._seq

    @property
    def epoch(self) -> int:
        return self._epoch

    def attach(self, seq: int, epoch: Optional[int] = None) -> None:
        """Join the world's operation stream at ``seq`` (the leaver's or a peer's count),
        in the stayers' ``epoch`` (see :meth:`rewind`)."""
        self.rewind(seq, self._epoch if epoch is None else epoch)
        self.detached = False

    def rewind(self, seq: int, epoch: int) -> None:
        """Go back to the count ``seq`` of a rollback point, under a new ``epoch``.

        A failure leaves the stayers' counts wherever each was in the aborted step (one
        may have done a world operation its peers never reached). Every rank, and the
        joiner, restarts from the count at the last boundary; the epoch keeps the
        redone operations' keys apart from the aborted ones'::

            step 7 (aborted)   r0: e1/op41 e1/op42   r1: e1/op41      (r2 dies)
            step 7 (redone)    r0, r1, joiner: e2/op41 e2/op42 ...
        """
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise GroupError(f"world group: operation count {seq!r}: expected an integer >= 0")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise GroupError(f"world group: epoch {epoch!r}: expected an integer >= 0")
        with self._mark_lock:
            self._seq = seq
            self._epoch = epoch
            self._broken = False

    def stop_recording(self) -> None:
        """The set-up is over: joiners replay nothing later than this (see :meth:`_record`)."""
        self.recording = False

    # --- helpers -------------------------------------------------------------
    def _put(self, key: str, data: bytes) -> None:
        """Values are sealed with the job token when there is one (see :class:`pitstop.store.SealedStore`)."""
        self._store.set(key, data if self._token is None else seal_raw(self._token, key, bytes(data)))

    def _get(self, key: str) -> bytes:
        raw = self._store.get(key)
        if self._token is None:
            return raw
        try:
            return open_raw(self._token, key, raw)
        except Refused as exc:
            raise GroupError(f"world group rank {self.rank()}: {exc}") from None

    def _next(self) -> str:
        self._seq += 1
        return f"e{self._epoch}/op{self._seq}" if self._epoch else f"op{self._seq}"

    # A joiner repeats the set-up of its role (model, optimizer, data) alone, and the
    # set-up does world collectives (Megatron's optimizer all-gathers its param-group
    # keys). World rank 0 records every collective's result under ``rec/op<n>``; a
    # detached joiner replays its own n-th operation from that record.
    def _record(self, outs: List[torch.Tensor]) -> None:
        """Under the count, not the live key: a joiner replays by count, whatever the epoch."""
        if self.rank() == 0 and self.recording:
            self._put(f"rec/op{self._seq}", b"".join(_raw(o) for o in outs))

    def _replay(self, outs: List[torch.Tensor]) -> DoneWork:
        self._seq += 1
        op = f"op{self._seq}"
        self._wait_keys([f"rec/{op}"])
        raw = bytearray(self._get(f"rec/{op}"))
        need = sum(o.numel() * o.element_size() for o in outs)
        if len(raw) != need:
            raise GroupError(
                f"world operation {op} on a joiner: the record holds {len(raw)} bytes, this process "
                f"expects {need}: its set-up differs from the original process's"
            )
        off = 0
        for o in outs:
            n = o.numel() * o.element_size()
            o.copy_(_tensor(raw, o, off, whole=False))
            off += n
        return DoneWork(list(outs))

    def mark_broken(self, epoch: Optional[int] = None) -> None:
        """A member's failure is announced: a wait in progress gives up while the fence is
        armed (as a :class:`GuardedGroup`'s does), instead of waiting out the timeout for a
        key the dead rank will never write. Cleared by :meth:`rewind`; a mark for ``epoch``
        that comes after the rewind to a newer one (the heartbeat's watcher is a thread of
        its own) is ignored, or it would break the redone step."""
        with self._mark_lock:
            if epoch is None or epoch == self._epoch:
                self._broken = True

    #: The longest pause between two looks at the store while a step's fence is armed.
    POLL_MAX_S = 0.02

    def _wait_keys(self, keys: List[str]) -> None:
        if not FENCE.armed:  # set-up, or outside a pitstop job: one blocking wait
            self._wait_blocking(keys, self._timeout)
            return
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause = 0.0005
        while True:
            try:
                if self._store.check(keys):
                    return
            except RuntimeError as exc:  # a Python store under c10d's PrefixStore: no check; wait in slices
                if "pure virtual" not in str(exc):
                    raise
                try:
                    self._store.wait(keys, timedelta(seconds=self.POLL_MAX_S * 5))
                    return
                except Exception:  # noqa: BLE001 - a slice ran out; look at the mark, then wait again
                    pass
            if self._broken:
                FENCE.errors.append(f"world operation {keys[0].rsplit('/', 1)[0]}: abandoned (a member failed)")
                raise _Abandoned()
            if time.monotonic() > deadline:
                raise GroupError(f"world group rank {self.rank()}: peers did not arrive within "
                                 f"{self._timeout.total_seconds():.0f}s ({len(keys)} keys, first {keys[0]!r})")
            time.sleep(pause)
            pause = min(pause * 2, self.POLL_MAX_S)

    def _wait_blocking(self, keys: List[str], timeout: timedelta) -> None:
        try:
            self._store.wait(keys, timeout)
        except Exception as exc:
            raise GroupError(
                f"world group rank {self.rank()}: peers did not arrive within "
                f"{self._timeout.total_seconds():.0f}s ({len(keys)} keys): {exc}"
            ) from exc

    def _finish(self, op: str, keys: List[str]) -> None:
        if self._store.add(f"{op}/done", 1) == self.size() and self._can_delete:
            for k in keys + [f"{op}/done"]:
                try:
                    self._store.delete_key(k)
                except RuntimeError as exc:
                    # a Python store (etcd) under torch's own C++ PrefixStore: c10d's trampoline
                    # does not route deleteKey to it. The keys stay (each operation has its own
                    # names, so nothing reads them again); world operations are rare.
                    if "pure virtual" not in str(exc):
                        raise
                    self._can_delete = False
                    log.debug("world group: the store cannot delete through c10d's PrefixStore; keys are kept")
                    return

    def _exchange(self, op: str, t: torch.Tensor) -> List[torch.Tensor]:
        keys = [f"{op}/{r}" for r in range(self.size())]
        self._put(keys[self.rank()], _raw(t))
        self._wait_keys(keys)
        out = []
        for k in keys:
            raw = bytearray(self._get(k))
            out.append(_tensor(raw, t))
        return out

    # --- collectives -----------------------------------------------------------
    def _tap(self, what: str, args: tuple) -> None:
        """Show a completed world operation to :data:`TAP` (the warmup recorder)."""
        cb = _tapped("world", what, args)
        if cb is not None:
            cb()

    @_backend_work
    def barrier(self, opts=None):  # noqa: ARG002
        if self.detached:
            self._next()
            return DoneWork()
        if TAP is not None:
            self._tap("barrier", ())
        op = self._next()
        if self._store.add(f"{op}/n", 1) == self.size():
            self._put(f"{op}/go", b"1")  # the last to arrive opens the gate
        self._wait_keys([f"{op}/go"])
        self._finish(op, [f"{op}/n", f"{op}/go"])
        return DoneWork()

    @_backend_work
    def allreduce(self, tensors, opts=None):
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in tensors:
            if self.detached:
                self._replay([t])
                continue
            op = self._next()
            parts = self._exchange(op, t)
            acc = parts[0].clone()
            for p in parts[1:]:
                acc = _reduce(reduce_op, acc, p)
            t.copy_(acc)
            self._record([t])
            self._finish(op, [f"{op}/{r}" for r in range(self.size())])
        if TAP is not None and not self.detached:
            self._tap("allreduce", (tensors,))
        return DoneWork(list(tensors))

    @_backend_work
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            if self.detached:
                self._replay([t])
                continue
            op = self._next()
            if self.rank() == root:
                self._put(f"{op}/root", _raw(t))
            self._wait_keys([f"{op}/root"])
            raw = bytearray(self._get(f"{op}/root"))
            t.copy_(_tensor(raw, t))
            self._record([t])
            self._finish(op, [f"{op}/root"])
        if TAP is not None and not self.detached:
            self._tap("broadcast", (tensors,))
        return DoneWork(list(tensors))

    @_backend_work
    def allgather(self, output_tensors, input_tensors, opts=None):  # noqa: ARG002
        for outs, t in zip(output_tensors, input_tensors):
            if self.detached:
                self._replay(list(outs))
                continue
            op = self._next()
            for o, p in zip(outs, self._exchange(op, t)):
                o.copy_(p)
            self._record(list(outs))
            self._finish(op, [f"{op}/{r}" for r in range(self.size())])
        if TAP is not None and not self.detached:
            self._tap("allgather", (output_tensors, input_tensors))
        return DoneWork([o for outs in output_tensors for o in outs])

    def _no_replay(self, what: str) -> None:
        if self.detached:  # a joiner's set-up does not checkpoint
            raise GroupError(f"world {what} on a joiner before it joined: it is not recorded, so it cannot be replayed")

    @_backend_work
    def gather(self, output_tensors, input_tensors, opts=None):
        """Used by torch.distributed.checkpoint (``gather_object``) under Megatron's dist_checkpointing."""
        root = opts.rootRank if opts is not None else 0
        for i, t in enumerate(input_tensors):
            self._no_replay("gather")
            op = self._next()
            keys = [f"{op}/{r}" for r in range(self.size())]
            self._put(keys[self.rank()], _raw(t))
            if self.rank() == root:
                self._wait_keys(keys)
                for o, k in zip(output_tensors[i], keys):
                    o.copy_(_tensor(bytearray(self._get(k)), o))
            self._finish(op, keys)  # the last to finish deletes; the root has read by then
        return DoneWork([o for outs in output_tensors for o in outs])

    @_backend_work
    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for i, t in enumerate(output_tensors):
            self._no_replay("scatter")
            op = self._next()
            keys = [f"{op}/{r}" for r in range(self.size())]
            if self.rank() == root:
                for k, src in zip(keys, input_tensors[i]):
                    self._put(k, _raw(src))
            self._wait_keys([keys[self.rank()]])
            raw = bytearray(self._get(keys[self.rank()]))
            t.copy_(_tensor(raw, t))
            self._finish(op, keys)
        return DoneWork(list(output_tensors))

    def _gather_into(self, name: str, output, input):  # noqa: A002
        if self.detached:
            return self._replay([output])
        op = self._next()
        parts = self._exchange(op, input)
        output.copy_(torch.cat([p.reshape(-1) for p in parts]).view(output.shape))
        self._record([output])
        self._finish(op, [f"{op}/{r}" for r in range(self.size())])
        if TAP is not None:  # under the name torch called: a sandbox's virtual world sees the same one
            self._tap(name, (output, input))
        return DoneWork([output])

    @_backend_work
    def _allgather_base(self, output, input, opts=None):  # noqa: A002, ARG002
        return self._gather_into("_allgather_base", output, input)

    @_backend_work
    def all_gather_single(self, output, input, opts=None):  # noqa: A002, ARG002
        """torch >= 2.13's name for ``_allgather_base``: ``all_gather_into_tensor`` now calls it
        (Megatron-LM's timers gather every rank's times over the world with it)."""
        return self._gather_into("all_gather_single", output, input)


def _world_creator(store, rank, size, timeout):
    return StoreWorldGroup(store, rank, size, timeout)


def init_world(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta = timedelta(minutes=5),
    *, epoch: int = 0, detached: bool = False, spare: Optional[SharedConnection] = None,
) -> None:
    """Initialise torch.distributed with pitstop's store-backed world group.

    After this, ``dist.get_rank() == rank`` and ``dist.get_world_size() == world_size``,
    with no connection to any peer; real communicators come from the group registry.
    ``epoch`` counts full restarts (each gets fresh store keys); a joiner starts
    ``detached`` (see :class:`StoreWorldGroup`).
    """
    if WORLD_BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(WORLD_BACKEND, _world_creator, devices=["cpu", "cuda"])
    prefix = "pitstop/world" + (f"/e{epoch}" if epoch else "")
    # spare: the connection a standby opened to ``store`` while it waited for its role
    pool = (spare if spare is not None else SharedConnection(store)).prefixed(prefix)
    dist.init_process_group(WORLD_BACKEND, store=pool.store, rank=rank, world_size=world_size, timeout=timeout)
    g = world_group()
    g.detached = detached
    g.connections = pool


def world_connections() -> Optional[SharedConnection]:
    """The shared spare connection of the store the world group was initialised with (``.store``), for the
    group registry's rendezvous; None when the default group is not pitstop's (a plain
    ``init_process_group``, whose default store the registry then uses as it is)."""
    if not dist.is_initialized():
        return None
    g = c10d._get_default_group()
    return getattr(g, "connections", None) if isinstance(g, StoreWorldGroup) else None


def world_group() -> StoreWorldGroup:
    """The process's :class:`StoreWorldGroup` (pitstop's default group)."""
    g = c10d._get_default_group()
    if not isinstance(g, StoreWorldGroup):
        raise GroupError(f"the default process group is {g.name()}, not pitstop's world group")
    return g


class CompositeGroup(dist.ProcessGroup):
    """The product of two orthogonal communicators, reduced inner first, then outer (a
    one-element floating-point sum: gathered, and added in a flat group's order).

    ``ranks`` is the member list in Megatron's order; ``inner`` and ``outer`` are the
    two real groups of this rank whose product is exactly ``ranks``. Reductions
    (sum, max, min, product) and barrier are exact compositions; other collectives
    are refused with an error that names the group.
    """

    def __init__(self, ranks: Sequence[int], me: int, inner: dist.ProcessGroup, outer: dist.ProcessGroup, name: str) -> None:
        super().__init__(sorted(ranks).index(me), len(ranks))
        self.inner = inner
        self.outer = outer
        self._name = name
        self._me = me
        self._ranks = sorted(ranks)
        self._order: Optional[List[Tuple[int, int]]] = None
        """(outer rank, inner rank) of each member, by global rank: see :meth:`_sum_as_flat`."""

    def getBackendName(self) -> str:  # noqa: N802
        return "pitstop_composite"

    def shutdown(self) -> None:
        """Destroying a composite leaves its parts alone: the registry owns them."""

    @property
    def group_name(self) -> str:  # c10d's own setter keeps it on backends, which we have none of
        return self._name

    def allreduce(self, tensors, opts=None):
        if opts is None:
            opts = dist.AllreduceOptions()
        if _op(opts.reduceOp) not in _COMPOSABLE:
            raise GroupError(f"{self._name}: reduce op {opts.reduceOp} cannot be composed")
        if _op(opts.reduceOp) == dist.ReduceOp.SUM and all(t.numel() == 1 and t.is_floating_point() for t in tensors):
            for t in tensors:
                self._sum_as_flat(t)
            return DoneWork(list(tensors))
        self.inner.allreduce(tensors, opts).wait()
        self.outer.allreduce(tensors, opts).wait()
        return DoneWork(list(tensors))

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every member's ``t`` (one element), as an [outer rank, inner rank] matrix. The buffers
        start as copies of ``t``: a part that is broken (a peer died in this step) leaves them as
        they were, and uninitialised memory made a negative squared norm, whose square root is
        complex in Python, and Megatron's clipping raised on it: a stayer lost in a step that is
        discarded anyway."""
        row = [t.clone() for _ in range(self.inner.size())]
        self.inner.allgather([row], [t]).wait()
        flat = torch.cat([r.reshape(1) for r in row])
        rows = [flat.clone() for _ in range(self.outer.size())]
        self.outer.allgather([rows], [flat]).wait()
        return torch.stack(rows)

    def _member_order(self) -> List[Tuple[int, int]]:
        """(outer rank, inner rank) of each member, by global rank. Arithmetic, no message: every
        member must run the same collectives whatever it has cached (a joiner's first call and a
        stayer's hundredth), or a healthy part would see two different operations. The parts are
        orthogonal slices of one rank grid, so the member at (o, i) is ``inner[i] + outer[o] - me``."""
        inner = [dist.get_global_rank(self.inner, i) for i in range(self.inner.size())]
        outer = [dist.get_global_rank(self.outer, o) for o in range(self.outer.size())]
        grid = sorted((a + b - self._me, (o, i)) for o, b in enumerate(outer) for i, a in enumerate(inner))
        if [g for g, _ in grid] != self._ranks:
            raise GroupError(f"{self._name}: inner {inner} x outer {outer} around rank {self._me} does not make "
                             f"its members {self._ranks}")
        return [oi for _, oi in grid]

    def _sum_as_flat(self, t: torch.Tensor) -> None:
        """A floating-point sum of one element, added up in the order a flat gloo group of the
        same members adds it (its ring accumulates from the highest group rank down to rank 0:
        ``v0 + (v1 + (... + v(n-1)))``), not inner-then-outer.

        Why: the distributed optimizer's grad norm and zero count are one-element sums over
        this group (``intra-dist-opt``). Summed inner-then-outer, the norm differed from
        Megatron's own flat group in its last bit now and then, and with ``--clip-grad`` the
        parameters did too (seen in a 20-step Megatron-LM run: equal to plain torchrun up to
        step 19, a few elements one ulp apart after it). Larger tensors keep the two-step
        reduction: a ring splits them into chunks, each added in an order of its own.
        ``tests/test_pg.py`` checks the order against gloo itself."""
        if self._order is None:
            self._order = self._member_order()
        vals = self._gather(t.reshape(1))
        acc = vals[self._order[-1]].clone()
        for oi in reversed(self._order[:-1]):
            acc = vals[oi] + acc
        t.copy_(acc.reshape(t.shape))

    def barrier(self, opts=None):  # noqa: ARG002
        self.inner.barrier().wait()
        self.outer.barrier().wait()
        return DoneWork()

    def _unsupported(self, what: str):
        raise GroupError(
            f"{what} on composite group {self._name} (size {self.size()}) is not supported: "
            "pitstop composes only reductions and barrier; use the inner/outer groups"
        )

    def broadcast(self, *a, **k):
        self._unsupported("broadcast")

    def allgather(self, *a, **k):
        self._unsupported("allgather")

    def _allgather_base(self, *a, **k):
        self._unsupported("all_gather_into_tensor")

    def reduce_scatter(self, *a, **k):
        self._unsupported("reduce_scatter")

    def _reduce_scatter_base(self, *a, **k):
        self._unsupported("reduce_scatter_tensor")

    def alltoall_base(self, *a, **k):
        self._unsupported("all_to_all_single")

    def all_gather_single(self, *a, **k):
        self._unsupported("all_gather_into_tensor")

    def reduce_scatter_single(self, *a, **k):
        self._unsupported("reduce_scatter_tensor")


# --------------------------------------------------------------------------- fault fence
class Fence:
    """Decides what a failed collective does: raise (disarmed) or poison the step (armed).

    When a peer dies, a stayer blocked with it gets an error from gloo ("Connection
    closed by peer") or NCCL. Unwinding the stack there would strand every *other*
    stayer that waits for this one in a group that did not lose anyone. So while
    a training step runs the fence is armed: a failed operation marks its group
    broken and completes with whatever is in the output buffers; a member blocked
    on a live peer of a broken group gives up as soon as the group is marked broken
    (by its own error, or by the runtime when the controller announces the fault).
    The step goes on with garbage through the groups that are still whole, every
    stayer reaches the iteration boundary, and the runtime throws the step away::

        rank 5 dies       tp-pp [0,1,4,5]: 4 errors -> broken;  0, 1: broken by the announcement
                          dp [5,7]:        7 errors -> broken
        kept groups       tp [2,3], dp [0,2], ...: complete normally (garbage in, garbage out)
        boundary          every stayer arrives; the step is discarded and redone

    (gloo's ``abort()`` does not close a group's connections, so a live member
    cannot be woken through the group itself: waits poll the broken mark instead.)
    """

    def __init__(self) -> None:
        self.armed = False
        self.local = False
        """A joiner building its role: every operation completes locally, nothing is sent
        (Megatron's model set-up all-reduces the tied embeddings, which the stayers do not
        repeat; the joiner's values are replaced by the real state anyway)."""
        self.errors: List[str] = []
        """What failed in the current step, one line per failure."""
        self.broken: Dict[str, "GuardedGroup"] = {}

    @property
    def poisoned(self) -> bool:
        return bool(self.errors) or bool(self.broken)

    def trip(self, group: "GuardedGroup", what: str, exc: BaseException) -> None:
        self.broken[group.group_name] = group
        self.errors.append(f"{what} on {group.group_name}: {str(exc).splitlines()[0][:200]}")

    def reset(self) -> None:
        self.errors.clear()
        self.broken.clear()


#: The process's fence. One per process: a step is poisoned as a whole.
FENCE = Fence()


_P2P = ("send", "recv", "recv_anysource")
#: Operations whose wait is done in a helper thread, so that the waiting thread can look at
#: the group's broken mark while a dead peer keeps the operation from finishing: gloo ends a
#: send/recv whose timed wait expires, and its reduce-scatters ignore a wait's timeout
#: altogether (probed on torch 2.13: ``wait(100 ms)`` returned only when the peer left, 3 s
#: later; every other collective raised at 100 ms). DeepSpeed's ZeRO-3 reduce-scatters its
#: gradients every step.
_WAIT_IN_THREAD = _P2P + ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                          "reduce_scatter_single", "reduce_scatter_single_coalesced")


def _wait_into(work: dist._Work, done: threading.Event, box: dict) -> None:
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001
        box["error"] = exc
    finally:
        done.set()


class GuardedWork(dist._Work):
    """A real communicator's work, behind the fence (see :class:`Fence`)."""

    def __init__(self, inner: Optional[dist._Work], group: "GuardedGroup", what: str,
                 result: Optional[List[torch.Tensor]] = None, on_done: Optional[Callable[[], None]] = None,
                 held: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self._inner = inner
        self._on_done = on_done
        self._group = group
        self._what = what
        self._result = result or []
        self._held = held
        """A tensor the communicator's work holds (found in :meth:`GuardedGroup._call` by its
        reference count rising), watched in :meth:`wait` to see when that work object dies."""

    #: How often a blocked wait looks at its group's broken mark.
    POLL = timedelta(milliseconds=50)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._inner is None:
            return True
        inner, self._inner = self._inner, None
        ok = self._wait(inner, timeout)
        held, self._held = self._held, None
        if held is None or self._group.broken:  # an abandoned operation may never finish
            del inner
        else:
            before = held._use_count()
            del inner
            _until_released(held, before, f"{self._what} on {self._group.group_name}")
        if self._on_done is not None and not self._group.broken:
            self._on_done()
        return ok

    def _wait(self, inner: dist._Work, timeout: timedelta | None) -> bool:
        if isinstance(inner, DoneWork):  # a Python group answered synchronously (virtual, world)
            return True
        if self._group.getBackendName() in GuardedGroup.ABORT_BACKENDS:
            # NCCL: wait() orders the *calling thread's* current CUDA stream after the
            # operation and returns; the host never blocks (unless TORCH_NCCL_BLOCKING_WAIT
            # is set, and then the watcher's abort of a broken group ends it). So it is done
            # here, never in a helper thread, whose current stream is not the caller's.
            try:
                inner.wait()
            except Exception as exc:  # noqa: BLE001 - an aborted communicator raises
                self._group.failed(self._what, exc)
            return True
        # c10d passes timedelta(0) for "no timeout" (kNoTimeout)
        deadline = None if not timeout else time.monotonic() + timeout.total_seconds()
        p2p = self._what in _WAIT_IN_THREAD
        if p2p:
            # see _WAIT_IN_THREAD
            done, box = threading.Event(), {}
            waiter = threading.Thread(target=_wait_into, args=(inner, done, box), daemon=True)
            waiter.start()
        while True:
            if p2p:
                if done.wait(self.POLL.total_seconds()):
                    waiter.join()  # it held the work: let go of it before the caller goes on
                    if "error" in box:
                        self._group.failed(self._what, box["error"])
                    return True
            else:
                try:
                    inner.wait(self.POLL)  # c10d: raises "timed out" but leaves the operation running
                    return True
                except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise plain RuntimeError
                    if "operation timed out" not in str(exc).lower():
                        self._group.failed(self._what, exc)
                        return True
                    # (it may complete right after the timeout: the next wait says so)
            if self._group.broken and self._group.fence.armed:
                # a peer of this group died: give up on it; the operation stays pending
                # in the retired group, which is never waited on again
                self._group.fence.errors.append(f"{self._what} on {self._group.group_name}: abandoned")
                return True
            if deadline is not None and time.monotonic() > deadline:
                raise GroupError(f"{self._what} on group {self._group.group_name} timed out after {timeout}")

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed()

    def is_success(self) -> bool:
        return True

    def result(self) -> List[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        self.wait()
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


def _forward(what: str):
    def method(self: "GuardedGroup", *args, **kwargs):
        return self._call(what, args, kwargs)

    method.__name__ = what
    return method


class GuardedGroup(dist.ProcessGroup):
    """A real communicator (gloo or NCCL) that obeys the process's :class:`Fence`.

    Every operation is forwarded to the inner group. With the fence disarmed an
    error raises :class:`GroupError` naming the group; armed, the group is marked
    broken and aborted, and this and every later operation on it completes at
    once. Groups that are not broken behave exactly like the inner group.
    """

    def __init__(self, inner: Optional[dist.ProcessGroup], rank: int, size: int, name: str, fence: Fence = FENCE,
                 kind: str = "", backend: str = "") -> None:
        super().__init__(rank, size)
        self.inner = inner
        """The real communicator; None while it is still being built (a joiner's deferred group)."""
        self.kind = kind.split("+")[0]
        """The layout's group kind (``tp``, ``dp``, ...); a gloo twin shares its group's kind."""
        self.fence = fence
        self._name = name
        self._backend = inner.name() if inner is not None else backend
        self._marked = False

    def attach(self, inner: dist.ProcessGroup) -> None:
        """Put the communicator in a group created without one (``new_comm(deferred=...)``)."""
        if self.inner is not None:
            raise GroupError(f"group {self._name} has a communicator already")
        self.raw = inner
        self.inner = inner

    def getBackendName(self) -> str:  # noqa: N802
        return self._backend

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def broken(self) -> bool:
        return self._name in self.fence.broken or self._marked

    def mark_broken(self) -> None:
        """Waits on this group give up (see :class:`Fence`); set when its fault is announced."""
        self._marked = True
        self.fence.broken[self._name] = self
        self.abort()

    def failed(self, what: str, exc: BaseException) -> None:
        if not self.fence.armed:
            raise GroupError(f"{what} on group {self._name} (size {self.size()}) failed: {exc}") from exc
        self.fence.trip(self, what, exc)
        self.abort()

    #: Backends whose pending operations must be aborted, not just abandoned: an NCCL
    #: kernel waiting for a dead peer blocks its CUDA stream, and with it every later
    #: kernel of the process (gloo's operations run on its own threads and are left to
    #: finish or fail in the retired group; its ``abort()`` does not close connections).
    ABORT_BACKENDS = ("nccl",)

    def abort(self) -> bool:
        """Abort the communicator (ProcessGroupNCCL's abort path: ``ncclCommAbort``) once, from any
        thread; returns whether it was aborted now. The group is retired by the recovery anyway."""
        inner = self.inner
        if inner is None or self._backend not in self.ABORT_BACKENDS or getattr(self, "aborted", False):
            return False
        self.aborted = True
        try:
            inner.abort()
        except Exception as exc:  # noqa: BLE001 - already torn down: nothing more to free
            self.fence.errors.append(f"abort of {self._name}: {str(exc).splitlines()[0][:200]}")
            return False
        return True

    def _call(self, what: str, args, kwargs):
        if self.fence.local or (self.broken and self.fence.armed):
            return GuardedWork(None, self, what)
        if self.inner is None:
            raise GroupError(f"{what} on group {self._name}: its communicator is still being built "
                             "(a joiner must attach its deferred groups before its fence opens)")
        tap = _tapped(self.kind, what, args) if TAP is not None else None
        watch = memory.TRACKER is not None and self._backend == "gloo"
        counts = [(t, t._use_count()) for t in _tensors(args)] if watch else []
        try:
            work = getattr(self.inner, what)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self.failed(what, exc)
            return GuardedWork(None, self, what)
        held = next((t for t, n in counts if t._use_count() > n), None)
        return GuardedWork(work, self, what, _outputs(what, args), on_done=tap, held=held)

    def shutdown(self) -> None:
        if self.inner is None:
            return
        try:
            self.inner.shutdown()
        except Exception:  # noqa: BLE001
            pass


install_methods(GuardedGroup, _forward)


def _tensors(args) -> List[torch.Tensor]:
    """Every tensor among an operation's arguments (lists of lists included)."""
    out: List[torch.Tensor] = []
    for x in args:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(_tensors(x))
    return out


#: How long :func:`_until_released` waits for a communicator's thread to let go.
RELEASE_WAIT_S = 2.0


def _until_released(t: torch.Tensor, before: int, what: str) -> None:
    """Return once the work that held ``t`` has died (its references to ``t`` gone).

    Why, when memory is tracked: gloo's worker thread marks a work complete and only
    then lets go of its own reference to it. If the caller's reference goes first, the
    work's tensors die in that thread, a moment later, while the caller allocates on::

        caller   wait() returns | drops the work | allocates the next buffer (peak +1 buffer)
        worker   complete       |  ...           |  drops the work: its tensors die

    A counted peak then differs run to run by one buffer (seen under load: 16 KiB, a
    64x64 fp32 gradient Megatron all-reduces asynchronously). ``before`` is ``t``'s
    reference count taken while the caller still held the work: once the work is
    gone the count is lower. It is lower at once unless the worker still holds it.
    """
    if t._use_count() < before:
        return
    deadline = time.monotonic() + RELEASE_WAIT_S
    while t._use_count() >= before:
        if time.monotonic() > deadline:
            log.warning("%s: the communicator's thread still held its work after %.1fs; "
                        "the counted peak may include its buffers", what, RELEASE_WAIT_S)
            return
        os.sched_yield()
        time.sleep(0.0001)


def _outputs(what: str, args) -> List[torch.Tensor]:
    """The tensors an operation writes, for ``Work.result()``."""
    if not args:
        return []
    first = args[0]
    if isinstance(first, torch.Tensor):
        return [first]
    out: List[torch.Tensor] = []
    for x in first if isinstance(first, (list, tuple)) else ():
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(t for t in x if isinstance(t, torch.Tensor))
    return out
