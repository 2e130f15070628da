"""The buddy ring's wire: each rank's snapshot to the next data-parallel peer, in one message.

A snapshot is a JSON header (layout, RNG streams, step) and the shard's bytes. Sending them
as three point-to-point rounds (sizes, header, bytes) cost three round-trip latencies per
vote; a gloo round on a loaded CPU costs about a millisecond, the bytes themselves less.
So the sizes are agreed once per generation, and every later exchange is one round::

    agreement (first exchange of a generation):   [header capacity, shard bytes]  both ways
    each exchange:  | 24-byte prefix | header, padded to capacity | shard bytes |  both ways
                      meta_len, grow_cap, grow_bytes

The header's length moves a little from step to step (the RNG streams' digits), so its
capacity has a margin. A sender whose header outgrows it, or whose shard changed size,
sends the prefix with ``grow_*`` set and, right after, the whole message in the new
layout; its receiver reads the prefix and takes the second message. Each pair of peers
does this on its own, so nobody waits for a round it does not need.

Received messages alternate between two buffers: the one behind the committed buddy copy
is never overwritten by the next exchange, which may yet be discarded.

:class:`BuddyRing` is the session's piece that uses the wire: it owns this rank's rollback
point and its peer's copy, takes and swaps them at a vote, and hands them to a joiner::

    data-parallel ring of the shard group (dp 3):   r0 -> r2 -> r4 -> r0
    r2 holds: snap (its own state at the last vote), buddy (r0's)
    r2 dies:  r4 sends its buddy copy (r2's state), r0 its own (r2's buddy: r0's state)
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from pitstop import pg as pgmod
from pitstop.errors import RecoveryError
from pitstop.runtime import state
from pitstop.runtime.config import RuntimeConfig
from pitstop.runtime.framework import Framework
from pitstop.runtime.state import Snapshot

log = logging.getLogger(__name__)

PREFIX = 24
MAX_BYTES = 1 << 40


def capacity(meta_len: int) -> int:
    """Room for a header of ``meta_len`` bytes and its growth: a quarter more, in 4 KiB pages."""
    return ((meta_len + meta_len // 4 + 4096) + 4095) // 4096 * 4096


class BuddyWire:
    """One rank's side of the ring: the agreed sizes and the message buffers."""

    def __init__(self) -> None:
        self.gen: Optional[int] = None
        self.cap = self.nbytes = self.peer_cap = self.peer_nbytes = 0
        self._send: Optional[torch.Tensor] = None
        self._recv: List[Optional[torch.Tensor]] = [None, None]
        self._live: Optional[int] = None   # which receive buffer holds the committed buddy copy
        self._pending: Optional[int] = None

    def exchange(self, snap: Snapshot, gen: int, sendrecv: Callable[[torch.Tensor, torch.Tensor], None],
                 send: Callable[[torch.Tensor], object], recv: Callable[[torch.Tensor], object],
                 poisoned: Callable[[], bool]) -> Optional[Snapshot]:
        """Send ``snap`` to the next peer, receive the previous peer's. ``sendrecv(out, inp)``
        is one round both ways; ``send``/``recv`` post one direction and return a work to wait
        on. Returns the peer's snapshot (a view of a receive buffer); None when the step was
        poisoned meanwhile (a broken group short-circuits, so what arrived is not a message:
        it is not parsed, and the next exchange agrees on the sizes again). Raises
        :class:`RecoveryError` on a message that does not describe itself."""
        meta = snap.meta_bytes()
        data = snap.data
        if self.gen != gen:  # a new ring (start, replacement, drain): agree on the sizes once
            mine = torch.tensor([capacity(len(meta)), data.numel()], dtype=torch.int64)
            theirs = torch.zeros(2, dtype=torch.int64)
            sendrecv(mine, theirs)
            if poisoned():
                self.gen = None
                return None
            self.cap, self.nbytes = int(mine[0]), int(mine[1])
            self.peer_cap, self.peer_nbytes = self._sizes(int(theirs[0]), int(theirs[1]), "agreed")
            self.gen = gen
            self._recv, self._live = [None, None], None
        grow = len(meta) > self.cap or data.numel() != self.nbytes
        if grow:
            new_cap, new_nbytes = capacity(len(meta)), data.numel()
            out = self._buffer_out(self.cap, self.nbytes)
            out[:PREFIX].view(torch.int64).copy_(torch.tensor([len(meta), new_cap, new_nbytes]))
        else:
            out = self._fill(meta, data, self.cap, self.nbytes)
        i = 0 if self._live != 0 else 1
        inp = self._buffer_in(i, self.peer_cap, self.peer_nbytes)
        sendrecv(out, inp)
        if poisoned():
            self.gen = None
            return None
        works = []
        if grow:  # the whole message again, in the layout its receiver learns from the prefix
            self.cap, self.nbytes = new_cap, new_nbytes
            self._send = None
            works.append(send(self._fill(meta, data, self.cap, self.nbytes)))
        meta_len, grow_cap, grow_nbytes = (int(x) for x in inp[:PREFIX].view(torch.int64))
        if grow_cap or grow_nbytes:
            self.peer_cap, self.peer_nbytes = self._sizes(grow_cap, grow_nbytes, "grown")
            inp = self._buffer_in(i, self.peer_cap, self.peer_nbytes)
            works.append(recv(inp))
        for w in works:
            w.wait()
        if poisoned():
            self.gen = None
            return None
        if grow_cap or grow_nbytes:
            meta_len = int(inp[:PREFIX].view(torch.int64)[0])
        if not 0 < meta_len <= self.peer_cap:
            raise RecoveryError(f"buddy message: header length {meta_len}, expected 1..{self.peer_cap}")
        self._pending = i
        start = PREFIX + self.peer_cap
        return Snapshot.from_wire(bytes(inp[PREFIX:PREFIX + meta_len].numpy()), inp[start:start + self.peer_nbytes])

    def keep(self) -> None:
        """The last received copy is now the committed one: the next exchange receives elsewhere."""
        self._live = self._pending

    # ------------------------------------------------------------------ buffers
    @staticmethod
    def _sizes(cap: int, nbytes: int, what: str):
        if not (0 < cap <= MAX_BYTES and 0 <= nbytes <= MAX_BYTES):
            raise RecoveryError(f"buddy message: {what} sizes header {cap}, shard {nbytes}: expected 1..{MAX_BYTES} "
                                f"and 0..{MAX_BYTES}")
        return cap, nbytes

    def _buffer_out(self, cap: int, nbytes: int) -> torch.Tensor:
        if self._send is None or self._send.numel() != PREFIX + cap + nbytes:
            self._send = torch.zeros(PREFIX + cap + nbytes, dtype=torch.uint8)
        return self._send

    def _fill(self, meta: bytes, data: torch.Tensor, cap: int, nbytes: int) -> torch.Tensor:
        out = self._buffer_out(cap, nbytes)
        out[:PREFIX].view(torch.int64).copy_(torch.tensor([len(meta), 0, 0]))
        out[PREFIX:PREFIX + len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        out[PREFIX + cap:].copy_(data)
        return out

    def _buffer_in(self, i: int, cap: int, nbytes: int) -> torch.Tensor:
        b = self._recv[i]
        if b is None or b.numel() != PREFIX + cap + nbytes:
            b = self._recv[i] = torch.empty(PREFIX + cap + nbytes, dtype=torch.uint8)
        return b


class BuddyRing:
    """This rank's rollback point (``snap``) and its data-parallel peer's (``buddy``).

    Handed what it reads: the framework adapter (the extra state), the model and optimizer,
    the group registry (the shard group's ring) and the fence (a poisoned exchange keeps
    nothing). It holds no step bookkeeping; the session says when a vote committed."""

    def __init__(self, rank: int, cfg: RuntimeConfig, fw: Framework, model: Sequence[Any], optimizer: Any,
                 registry: Any, fence: pgmod.Fence) -> None:
        self.rank = rank
        self.cfg = cfg
        self.fw = fw
        self.model = model
        self.optimizer = optimizer
        self.registry = registry
        self.fence = fence
        self.snap: Optional[Snapshot] = None
        """This rank's state at the last committed vote: the rollback point."""
        self.buddy: Optional[Snapshot] = None
        """The previous data-parallel peer's state at the same vote."""
        self.spare: Optional[torch.Tensor] = None
        """The buffer of the rollback point before the last one: the next snapshot is packed into it."""
        self.wire = BuddyWire()
        """This rank's side of the ring (one message per exchange)."""
        self.seconds = 0.0
        """Seconds spent exchanging with the peers."""

    def group(self) -> Tuple[List[int], dist.ProcessGroup]:
        """The ranks of this rank's shard group (its data-parallel ring), and the group to send on."""
        e = self.registry.entry(self.fw.shard_kind)
        return e.ranks, (e.gloo or e.group)

    @staticmethod
    def neighbours(ranks: List[int], r: int) -> Tuple[int, int]:
        """The next and the previous rank of ``r`` on the ring ``ranks``."""
        i = ranks.index(r)
        return ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)]

    def take(self, step: int, seq: int, reports: Optional[list] = None) -> Snapshot:
        """Pack this rank's state after ``step`` (at world operation ``seq``) into the spare buffer."""
        return self.pack(self.capture(step, seq, reports))

    def capture(self, step: int, seq: int, reports: Optional[list] = None) -> state.Capture:
        """The part of :meth:`take` that must happen at the boundary itself (the RNG streams)."""
        return state.capture(step, seq, self.fw.extra_state(self.model, self.optimizer), reports)

    def pack(self, cap: state.Capture) -> Snapshot:
        """The rest of :meth:`take`: the shard's bytes, into the spare buffer (any thread, before
        the optimizer steps again)."""
        return state.pack(self.optimizer, cap, out=self.spare)

    def private_ring(self) -> Optional[Tuple[List[int], dist.ProcessGroup]]:
        """The shard group's ranks and the communicator only the ring uses (built when the
        registry was given a ``ring_kind``), or None: then the ring exchanges on the training
        thread (:meth:`take_and_exchange`)."""
        e = self.registry.entry(self.fw.shard_kind)
        return None if e is None or e.ring is None else (e.ranks, e.ring)

    def exchange_behind(self, snap: Snapshot, gen: int) -> Tuple[Optional[Snapshot], Optional[str]]:
        """Swap ``snap`` along the ring on its private communicator, from the background thread
        (:mod:`pitstop.runtime.pipeline`) while the next step runs. Returns (the peer's
        snapshot, None), or (None, why) when the exchange failed: then the vote is poisoned,
        because this rank holds no buddy copy of that step. Touches neither the fence's arming
        (the training thread's) nor its verdict: only the ring's own group says if it broke."""
        ranks, group = self.private_ring()
        try:
            got = self._swap(snap, gen, ranks, group, lambda: bool(getattr(group, "broken", False)))
        except Exception as exc:  # noqa: BLE001 - a dead peer (disarmed fence), or a message that does not parse
            self.wire.gen = None
            return None, f"buddy exchange on {getattr(group, 'uid', group)}: {str(exc).splitlines()[0][:300]}"
        if got is None:
            return None, f"buddy exchange on {getattr(group, 'uid', group)}: the ring's group broke"
        return got, None

    def take_and_exchange(self, step: int, seq: int, reports: Optional[list] = None
                          ) -> Tuple[Snapshot, Optional[Snapshot]]:
        """Pack this rank's state (with the reports of the steps it makes final, see
        :mod:`pitstop.runtime.reports`) and swap it along the ring. Returns (own, peer's);
        the peer's is None without a ring, or when the step was poisoned meanwhile."""
        snap = self.take(step, seq, reports)
        ranks, group = self.group()
        if not self.cfg.buddy or len(ranks) == 1:
            return snap, None
        # a poisoned rank still takes part (its peers wait for it); broken groups short-circuit
        self.fence.armed = True
        got = self._swap(snap, self.registry.generation, ranks, group, lambda: self.fence.poisoned)
        return snap, (None if self.fence.poisoned else got)

    def _swap(self, snap: Snapshot, gen: int, ranks: List[int], group: dist.ProcessGroup,
              poisoned: Callable[[], bool]) -> Optional[Snapshot]:
        """One exchange of ``snap`` along ``ranks`` on ``group`` (see :class:`BuddyWire`)."""
        t0 = time.perf_counter()
        nxt, prv = self.neighbours(ranks, self.rank)
        try:
            return self.wire.exchange(
                snap, gen, lambda out, inp: _sendrecv(out, inp, nxt, prv, group),
                lambda out: dist.isend(out, nxt, group=group), lambda inp: dist.irecv(inp, prv, group=group),
                poisoned)
        finally:
            self.seconds += time.perf_counter() - t0

    def keep(self, snap: Snapshot, received: Optional[Snapshot]) -> None:
        """The vote committed: ``snap`` is the rollback point, ``received`` (if any) the buddy copy."""
        self.spare = self.snap.data if self.snap else None
        self.snap = snap
        if received is not None:
            self.buddy = received
            self.wire.keep()

    def start(self, step: int, seq: int) -> None:
        """The first rollback point and buddy copy: the state before the first step."""
        self.snap, self.buddy = self.take_and_exchange(step, seq)
        self.wire.keep()

    def hand_to_joiners(self, roles: Sequence[int], step: int) -> None:
        """A stayer after a rollback to ``step``: send each joiner on this rank's ring its state.
        The same order on every rank; a joiner receives from its next peer (the buddy copy of
        its role), then from its previous one (its own copy of that peer, the role's buddy)."""
        ranks, group = self.group()
        for role in roles:
            if role not in ranks or len(ranks) == 1:
                continue
            nxt, prv = self.neighbours(ranks, role)
            if self.rank == nxt:
                if self.buddy is None or self.buddy.step != step:
                    raise RecoveryError(
                        f"r{self.rank} holds the buddy copy of role {role} for step "
                        f"{None if self.buddy is None else self.buddy.step}, needs step {step}")
                state.send_snapshot(self.buddy, role, group)
            if self.rank == prv and self.cfg.buddy:
                state.send_snapshot(self.snap, role, group)

    def receive(self) -> Tuple[Snapshot, int]:
        """A joiner: its role's state from the next peer, and the buddy copy from the previous
        one (what :meth:`hand_to_joiners` sends). Returns the state and the peer it came from;
        it becomes the rollback point once restored (:meth:`adopt`)."""
        ranks, group = self.group()
        nxt, prv = self.neighbours(ranks, self.rank)
        snap = state.recv_snapshot(nxt, group)
        self.buddy = state.recv_snapshot(prv, group) if self.cfg.buddy else None
        return snap, nxt

    def adopt(self, snap: Snapshot, buddy: Optional[Snapshot]) -> None:
        """A joiner's rollback point and buddy copy, taken over from its role's previous process."""
        self.snap, self.buddy = snap, buddy


def _sendrecv(out: torch.Tensor, inp: torch.Tensor, dst: int, src: int, group) -> None:
    works = [dist.isend(out, dst, group=group), dist.irecv(inp, src, group=group)]
    for w in works:
        w.wait()
