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
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from pitstop.errors import RecoveryError
from pitstop.runtime.state import Snapshot

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
