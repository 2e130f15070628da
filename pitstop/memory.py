"""Peak tensor memory of a process, counted the same way in a real run and in emulation.

On a GPU the caching allocator's peak (``torch.cuda.max_memory_allocated``) is the
answer. On CPU there is no allocator statistic, and RSS counts the interpreter,
libraries and freed-but-cached pages, so two runs of one program differ. Instead a
dispatch mode sees every tensor an operator creates and counts the bytes of the
*storages* alive at each moment::

    empty(1 MiB) -> storage A  live 1 MiB        peak 1 MiB
    view of A                  live 1 MiB        (same storage: counted once)
    empty(2 MiB) -> storage B  live 3 MiB        peak 3 MiB
    del A and its views        live 2 MiB

It counts what the program allocates, wherever it allocates it. What emulation's
oracles allocate for virtual peers (mirrored contributions, gloo sub-communicator
buffers) happens inside :meth:`PeakTracker.paused`, so it is not counted: a real
rank's peak in emulation is the peak of the same rank in a real run, byte for byte,
when the program allocates the same tensors.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Dict, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages created while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: Dict[int, int] = {}
        self._lock = threading.Lock()
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._paused:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._see(t)
        return out

    def _see(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. a tensor without storage
            return
        # torch keeps one Python object per live storage, so its id names the storage
        # until the storage itself dies, whichever way it dies (the last tensor going,
        # or ``p.data = other`` swapping it out from under a live tensor). A data
        # pointer would not do: a freed address is reused at once.
        key, size = id(st), st.nbytes()
        with self._lock:
            old = self._sizes.get(key)
            if old is None:
                if size == 0:
                    return
                self._sizes[key] = size
                self.live_bytes += size
                weakref.finalize(st, self._release, key)
            elif old != size:  # resized in place (e.g. resize_(0) to free a buffer)
                self.live_bytes += size - old
                self._sizes[key] = size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self.live_bytes -= size

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Allocations inside are not the program's (an oracle's scratch for virtual peers)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1


#: The process's tracker, if memory tracking is on.
TRACKER: Optional[PeakTracker] = None


def start() -> PeakTracker:
    """Track this process's tensor memory from now on (idempotent).

    Also turns Python's automatic garbage collection off; :func:`boundary` collects at
    every iteration boundary instead (Megatron's ``--manual-gc``). Tensors held by
    reference cycles die when a collection runs, and an automatic collection runs
    after some number of Python allocations, a number that differs between a real run
    and emulation (the oracles allocate Python objects). Seen here: 16 KiB of peak
    came and went with that timing. Collected at boundaries, the peak is the program's.
    """
    global TRACKER
    if TRACKER is None:
        gc.disable()
        TRACKER = PeakTracker()
        TRACKER.__enter__()
    return TRACKER


def boundary() -> None:
    """An iteration boundary (the session calls this): collect cycles when tracking."""
    if TRACKER is not None:
        gc.collect()


def peak_bytes() -> Optional[int]:
    """The peak: the CUDA allocator's on a GPU, else the tracker's (None when not tracking)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None if TRACKER is None else TRACKER.peak_bytes


def cuda_memory_report(device: Optional[int] = None) -> Dict[str, int]:
    """The current CUDA device's memory, split by who holds it::

        device used = allocator reserved (tensors + cached free blocks)
                    + outside the allocator (CUDA context, NCCL's buffers, library handles)

    ``outside_allocator_bytes`` is what ``max_memory_allocated`` never sees: on a rank
    with NCCL communicators it holds their buffers, so a peak meant to predict whether a
    job fits on a device adds it (``scripts/gpu_check`` measures it around a communicator's
    first collective).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_memory_report: CUDA is not available in this process")
    dev = torch.cuda.current_device() if device is None else device
    free, total = torch.cuda.mem_get_info(dev)
    reserved = int(torch.cuda.memory_reserved(dev))
    return {
        "allocator_peak_bytes": int(torch.cuda.max_memory_allocated(dev)),
        "allocator_allocated_bytes": int(torch.cuda.memory_allocated(dev)),
        "allocator_reserved_bytes": reserved,
        "allocator_reserved_peak_bytes": int(torch.cuda.max_memory_reserved(dev)),
        "device_total_bytes": int(total),
        "device_used_bytes": int(total - free),
        "outside_allocator_bytes": int(total - free) - reserved,
    }


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """For oracles: what they allocate on behalf of virtual peers is not the program's."""
    if TRACKER is None:
        yield
    else:
        with TRACKER.paused():
            yield
