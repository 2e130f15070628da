"""The fault fence: what a failed collective does, and real communicators behind it.

:class:`Fence` decides (raise when disarmed, poison the step when armed); a
:class:`GuardedGroup` wraps a real gloo or NCCL communicator so that every operation
obeys it, and :class:`GuardedWork` waits for one in a way that a dead peer cannot hold
forever."""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from pitstop.errors import GroupError
from pitstop import memory
from pitstop.pg.base import DoneWork, install_methods
from pitstop.pg import tap as tapmod

log = logging.getLogger(__name__)


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
        self.broken[group.uid] = group
        self.errors.append(f"{what} on {group.uid}: {str(exc).splitlines()[0][:200]}")

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
            _until_released(held, before, f"{self._what} on {self._group.uid}")
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
                self._group.fence.errors.append(f"{self._what} on {self._group.uid}: abandoned")
                return True
            if deadline is not None and time.monotonic() > deadline:
                raise GroupError(f"{self._what} on group {self._group.uid} timed out after {timeout}")

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
        self.public: Optional[str] = None
        """The name c10d knows the group by once :func:`pitstop.pg.create.rename` gave it a
        stable one (``pitstop:tp``): what ``group_name`` answers, and what ``torch.compile``
        guards on. ``uid`` stays the generation's unique name (the fence's key)."""
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
        return self.public or self._name

    @property
    def uid(self) -> str:
        """The generation's unique name (``pitstop:g1:tp:<digest>``), whatever c10d calls the group."""
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
        tap = tapmod._tapped(self.kind, what, args) if tapmod.TAP is not None else None
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
