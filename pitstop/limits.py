"""Size limits a control message meets on its way, as named constants, and which a size crosses.

Pure (layer 0). Measured here (docs: /work/shared/STACK.md, "Limits met at scale")::

    pitstop message (open_)   MAX_BYTES            256 KiB   a Roster of 8,192 roles is ~0.55 MB
    etcd request              ETCD_MAX_REQUEST     1.5 MiB   etcd's --max-request-bytes default
    TCPStore value            TCPSTORE_MAX_VALUE   8 MiB     the libuv server resets the client

A body past :data:`MAX_BYTES` goes through :meth:`pitstop.protocol.Channel.put_big`, whose
stored values are each at most ``BIG_CHUNK_BYTES`` + ``RAW_ENVELOPE`` (128 KiB + 70 bytes).
"""

from __future__ import annotations

from typing import Dict, List

from pitstop.protocol import BIG_CHUNK_BYTES, MAX_BYTES, RAW_ENVELOPE

TCPSTORE_MAX_VALUE = 8 * 1024 * 1024
"""TCPStore's libuv server refuses a payload over this ("Invalid payload size ... max: 8388608")."""
ETCD_MAX_REQUEST = 1536 * 1024
"""etcd refuses a request over this by default (``--max-request-bytes`` 1,572,864)."""
BIG_VALUE_MAX = BIG_CHUNK_BYTES + RAW_ENVELOPE
"""The largest value :meth:`pitstop.protocol.Channel.put_big` stores with its default chunk."""

LIMITS: Dict[str, int] = {
    "MAX_BYTES": MAX_BYTES,
    "ETCD_MAX_REQUEST": ETCD_MAX_REQUEST,
    "TCPSTORE_MAX_VALUE": TCPSTORE_MAX_VALUE,
}
"""Name -> bytes, smallest first."""


def crossed(nbytes: int) -> List[str]:
    """The names of the :data:`LIMITS` a payload of ``nbytes`` exceeds, smallest first ([] if none)."""
    return [name for name, limit in LIMITS.items() if nbytes > limit]


def describe(nbytes: int) -> str:
    """``nbytes`` and the limits it crosses, in words (for logs and test messages)."""
    over = crossed(nbytes)
    return f"{nbytes:,} bytes" + (f", over {', '.join(f'{n} ({LIMITS[n]:,})' for n in over)}" if over else "")
