"""pitstop's default ("world") group, :class:`StoreWorldGroup`.

It has no mesh of connections: barrier and the rare small world collective go through
the control store, keyed by a sequence number. So a process can take over a role without
any world-wide rebuild, which a gloo or NCCL world group would need.

No operation goes all-to-all through the store: each costs O(N) store operations in all,
O(1) per rank and O(N) keys for one (see :meth:`StoreWorldGroup._combine`)."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from pitstop.errors import GroupError
from pitstop.protocol import MAGIC_RAW, Refused, open_raw, seal_raw
from pitstop.store import SharedConnection
from pitstop.pg.base import DoneWork, _Abandoned, _backend_work, _op
from pitstop.pg.fence import FENCE, GuardedGroup
from pitstop.pg import tap as tapmod

log = logging.getLogger(__name__)

WORLD_BACKEND = "pitstop_world"

#: The largest value a ``TCPStore`` takes (its libuv server's payload limit; one byte more and
#: the server resets the connection). A world operation whose value would not fit is refused
#: with a :class:`GroupError` naming the sizes, on every rank, before anything is written.
MAX_VALUE_BYTES = 8 * 1024 * 1024

#: What :func:`seal_raw` adds to a value: ``ps1r.<64 hex>.``
SEAL_OVERHEAD = len(MAGIC_RAW) + 65

# The first byte of a combined value (``<op>/out``): the result follows, or the gatherer's error.
_OK, _FAILED = b"\x00", b"\x01"


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


def _concat(parts: List[torch.Tensor]) -> bytes:
    """An all-gather's combined value: the parts' bytes end to end, in rank order."""
    return b"".join(_raw(p) for p in parts)


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
        self._multi_get = True
        """False once the store turned ``multi_get`` down: reads go key by key."""
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
        value = data if self._token is None else seal_raw(self._token, key, bytes(data))
        if len(value) > MAX_VALUE_BYTES:  # the operations check first (_fits); this is the last guard
            raise GroupError(f"world group rank {self.rank()}: the value for {key!r} is {len(value)} bytes, "
                             f"over the store's limit of {MAX_VALUE_BYTES} bytes (8 MiB)")
        self._store.set(key, value)

    def _fits(self, what: str, nbytes: int, detail: str) -> None:
        """Refuse, before anything is written, an operation whose value would be over the
        store's limit: every rank knows the sizes (they come from the tensors' shapes), so
        every rank refuses alike instead of one resetting its connection and the rest waiting."""
        stored = 1 + nbytes + (0 if self._token is None else SEAL_OVERHEAD)
        if stored > MAX_VALUE_BYTES:
            raise GroupError(
                f"world {what} through the store: its value would be {stored} bytes ({detail}), over the "
                f"store's limit of {MAX_VALUE_BYTES} bytes (8 MiB); the world group is for small tensors"
            )

    def _get(self, key: str) -> bytes:
        raw = self._store.get(key)
        if self._token is None:
            return raw
        try:
            return open_raw(self._token, key, raw)
        except Refused as exc:
            raise GroupError(f"world group rank {self.rank()}: {exc}") from None

    def _get_many(self, keys: List[str]) -> List[bytes]:
        """The values of ``keys`` (which exist), in one request where the store has ``multi_get``
        (a TCPStore, and a Python store under c10d's PrefixStore through c10d's per-key default);
        else one ``get`` per key."""
        raws = None
        if self._multi_get:
            try:
                raws = self._store.multi_get(keys)
            except (AttributeError, NotImplementedError):
                self._multi_get = False
            except RuntimeError as exc:  # c10d's trampoline with nothing to route to
                if "pure virtual" not in str(exc) and "Not implemented" not in str(exc):
                    raise
                self._multi_get = False
                log.debug("world group: the store has no multi_get (%s); reading key by key", exc)
        if raws is None:
            raws = [self._store.get(k) for k in keys]
        if self._token is None:
            return list(raws)
        try:
            return [open_raw(self._token, k, r) for k, r in zip(keys, raws)]
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

    def _delete(self, keys: List[str]) -> None:
        for k in keys:
            if not self._can_delete:
                return
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

    def _finish(self, op: str, keys: List[str], own: Optional[str] = None) -> None:
        """Clean up once this rank has read what it needs: ``own`` (a key only this rank
        still needed) at once, and ``keys`` by whichever rank is the last to finish."""
        if own is not None:
            self._delete([own])
        if self._store.add(f"{op}/done", 1) == self.size():
            self._delete(keys + [f"{op}/done"])

    def _combine(self, op: str, t: torch.Tensor, combine) -> bytearray:
        """Every rank's ``t``, combined once: O(N) store operations in all, not N^2.

        Each rank writes its part and counts itself in; the last to arrive (the gatherer)
        reads the N parts in one request, computes ``combine(parts)`` (the parts as tensors
        like ``t``, in rank order; returns bytes) and writes the one result, which every
        other rank waits for and reads once::

            rank r:     set op/r   add op/n -> k   (k < N)  wait op/out   get op/out
            gatherer:   set op/g   add op/n -> N   multi_get op/0..N-1   set op/out

        Per rank: set, add, wait, get, and the clean-up (its own part, then ``op/done``);
        the gatherer's one ``multi_get`` holds the N parts. A gatherer that fails (a part of
        the wrong size) writes its error as the result, so no peer waits out the timeout for it.
        """
        keys = [f"{op}/{r}" for r in range(self.size())]
        self._put(keys[self.rank()], _raw(t))
        if self._store.add(f"{op}/n", 1) == self.size():
            self._wait_keys(keys)  # each part was set before its add; a store read from a copy may lag
            try:
                out = bytes(combine([_tensor(bytearray(raw), t) for raw in self._get_many(keys)]))
            except _Abandoned:
                raise
            except Exception as exc:  # noqa: BLE001 - told to the peers, then raised here
                if self.size() > 1:
                    try:
                        self._put(f"{op}/out", _FAILED + f"world operation {op}: {exc}".encode()[:4096])
                    except Exception:  # noqa: BLE001 - the store itself failed: the peers time out
                        log.debug("world group: could not tell the peers that %s failed", op, exc_info=True)
                raise
            if self.size() > 1:  # nobody else would read it
                self._put(f"{op}/out", _OK + out)
            return bytearray(out)
        self._wait_keys([f"{op}/out"])
        raw = self._get(f"{op}/out")
        if raw[:1] != _OK:
            raise GroupError(f"world group rank {self.rank()}: the gatherer failed: "
                             f"{bytes(raw[1:]).decode(errors='replace')}")
        return bytearray(raw[1:])

    def _combined_keys(self, op: str) -> List[str]:
        """What the last rank to finish a :meth:`_combine` deletes (each rank deletes its own part)."""
        return [f"{op}/n", f"{op}/out"]

    # --- collectives -----------------------------------------------------------
    def _tap(self, what: str, args: tuple) -> None:
        """Show a completed world operation to :data:`TAP` (the warmup recorder)."""
        cb = tapmod._tapped("world", what, args)
        if cb is not None:
            cb()

    @_backend_work
    def barrier(self, opts=None):  # noqa: ARG002
        if self.detached:
            self._next()
            return DoneWork()
        if tapmod.TAP is not None:
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

        def reduce(parts: List[torch.Tensor]) -> bytes:  # in rank order 0..N-1, as every rank once did alone
            acc = parts[0].clone()
            for p in parts[1:]:
                acc = _reduce(reduce_op, acc, p)
            return _raw(acc)

        for t in tensors:
            if self.detached:
                self._replay([t])
                continue
            if self.size() > 1:  # an unsupported op is refused here, by every rank, not by the gatherer alone
                probe = t.new_empty(0, device="meta")
                _reduce(reduce_op, probe, probe)
            self._fits("all_reduce", t.numel() * t.element_size(), f"one {t.dtype} tensor of shape {list(t.shape)}")
            op = self._next()
            t.copy_(_tensor(self._combine(op, t, reduce), t))
            self._record([t])
            self._finish(op, self._combined_keys(op), own=f"{op}/{self.rank()}")
        if tapmod.TAP is not None and not self.detached:
            self._tap("allreduce", (tensors,))
        return DoneWork(list(tensors))

    @_backend_work
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            if self.detached:
                self._replay([t])
                continue
            self._fits("broadcast", t.numel() * t.element_size(), f"one {t.dtype} tensor of shape {list(t.shape)}")
            op = self._next()
            if self.rank() == root:  # O(N) in all: one write, one read per rank
                self._put(f"{op}/root", _raw(t))
            self._wait_keys([f"{op}/root"])
            raw = bytearray(self._get(f"{op}/root"))
            t.copy_(_tensor(raw, t))
            self._record([t])
            self._finish(op, [f"{op}/root"])
        if tapmod.TAP is not None and not self.detached:
            self._tap("broadcast", (tensors,))
        return DoneWork(list(tensors))

    @_backend_work
    def allgather(self, output_tensors, input_tensors, opts=None):  # noqa: ARG002
        for outs, t in zip(output_tensors, input_tensors):
            if self.detached:
                self._replay(list(outs))
                continue
            n = t.numel() * t.element_size()
            self._fits("all_gather", n * self.size(),
                       f"{self.size()} ranks x {n} bytes, a {t.dtype} tensor of shape {list(t.shape)}")
            op = self._next()
            raw = self._combine(op, t, _concat)
            if len(raw) != n * self.size():
                raise GroupError(f"world all_gather {op}: {len(raw)} bytes gathered, this rank expects "
                                 f"{self.size()} x {n} (a {t.dtype} tensor of shape {list(t.shape)})")
            for r, o in enumerate(outs):
                o.copy_(_tensor(raw, t, r * n, whole=False))
            self._record(list(outs))
            self._finish(op, self._combined_keys(op), own=f"{op}/{self.rank()}")
        if tapmod.TAP is not None and not self.detached:
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
            self._fits("gather", t.numel() * t.element_size(), f"one {t.dtype} tensor of shape {list(t.shape)}")
            op = self._next()
            keys = [f"{op}/{r}" for r in range(self.size())]
            self._put(keys[self.rank()], _raw(t))
            if self.rank() == root:  # O(N) in all: one write per rank, the root's one read of N keys
                self._wait_keys(keys)
                for o, raw in zip(output_tensors[i], self._get_many(keys)):
                    o.copy_(_tensor(bytearray(raw), o))
            self._finish(op, keys)  # the last to finish deletes; the root has read by then
        return DoneWork([o for outs in output_tensors for o in outs])

    @_backend_work
    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for i, t in enumerate(output_tensors):
            self._no_replay("scatter")
            self._fits("scatter", t.numel() * t.element_size(), f"one {t.dtype} tensor of shape {list(t.shape)}")
            op = self._next()
            keys = [f"{op}/{r}" for r in range(self.size())]
            if self.rank() == root:
                for k, src in zip(keys, input_tensors[i]):
                    self._put(k, _raw(src))
            self._wait_keys([keys[self.rank()]])
            raw = bytearray(self._get(keys[self.rank()]))
            t.copy_(_tensor(raw, t))
            self._finish(op, [], own=keys[self.rank()])  # O(N) in all: the root's N writes, one read each
        return DoneWork(list(output_tensors))

    def _gather_into(self, name: str, output, input):  # noqa: A002
        if self.detached:
            return self._replay([output])
        n = input.numel() * input.element_size()
        self._fits(name, n * self.size(),
                   f"{self.size()} ranks x {n} bytes, a {input.dtype} tensor of shape {list(input.shape)}")
        op = self._next()
        flat = torch.empty(input.numel() * self.size(), dtype=input.dtype, device="meta")  # the parts, end to end
        output.copy_(_tensor(self._combine(op, input, _concat), flat).view(output.shape))
        self._record([output])
        self._finish(op, self._combined_keys(op), own=f"{op}/{self.rank()}")
        if tapmod.TAP is not None:  # under the name torch called: a sandbox's virtual world sees the same one
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
