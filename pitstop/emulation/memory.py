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
        self._refs: Dict[int, int] = {}
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
        key, size = st.data_ptr(), st.nbytes()
        if key == 0 or size == 0:
            return
        with self._lock:
            if key in self._sizes:
                self._refs[key] += 1
                if size != self._sizes[key]:  # resized in place
                    self.live_bytes += size - self._sizes[key]
                    self._sizes[key] = size
            else:
                self._sizes[key] = size
                self._refs[key] = 1
                self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            n = self._refs.get(key)
            if n is None:
                return
            if n > 1:
                self._refs[key] = n - 1
                return
            del self._refs[key]
            self.live_bytes -= self._sizes.pop(key)

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
    """Track this process's tensor memory from now on (idempotent)."""
    global TRACKER
    if TRACKER is None:
        TRACKER = PeakTracker()
        TRACKER.__enter__()
    return TRACKER


def peak_bytes() -> Optional[int]:
    """The peak: the CUDA allocator's on a GPU, else the tracker's (None when not tracking)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None if TRACKER is None else TRACKER.peak_bytes


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """For oracles: what they allocate on behalf of virtual peers is not the program's."""
    if TRACKER is None:
        yield
    else:
        with TRACKER.paused():
            yield
