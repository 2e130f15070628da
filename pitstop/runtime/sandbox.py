"""The warmup sandbox: a standby runs real training iterations of every stage kind, alone.

A process that has just joined is cold: lazy initialisation, first-call allocations
and, with ``torch.compile``, compilation make its first iteration several times
slower than steady state, and in a pipeline every rank waits for it. A pitstop
standby pays that before it is needed::

    job start      rank 0 (first), 2 (middle), 4 (last) record iteration 1 -> <run>/warmup/<class>.pt
    standby        for class in first, middle, last:
                       world = pitstop_virtual(rank=<recorder>, size=N)   no peer, no network
                       the script's own set-up + one train step, collectives served from the record
                       tear down (groups, model) -- caches, allocator and compiled code stay warm
    assignment     builds its real role and joins at full speed

Everything runs in the standby's main thread between checks for an assignment, so a
failure is answered at most one sandboxed iteration late. A record that does not
match (another model, another layout) is refused with a
:class:`~pitstop.errors.RecordMismatchError`, logged, and the standby stays a cold
one: it never takes the job down.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

from pitstop.record import Record, ReplayOracle
from pitstop.errors import RecordMismatchError
from pitstop.virtual import VIRTUAL_BACKEND, register, serving

log = logging.getLogger(__name__)

#: A script's warmup: set up the current role exactly as the script does at start,
#: run one training step, tear down; returns that step's outputs (loss, grad norm).
WarmupFn = Callable[[], Dict[str, Any]]


class _State:
    active: Optional[Record] = None


def active() -> Optional[Record]:
    """The record being replayed, while a sandboxed iteration runs in this process."""
    return _State.active


@dataclass
class WarmupResult:
    """What one sandboxed iteration did."""

    cls: str
    role: int
    ok: bool
    seconds: float
    out: Dict[str, Any] = field(default_factory=dict)
    error: str = ""
    ops: int = 0
    unused: Dict[str, int] = field(default_factory=dict)
    local_checked: int = 0
    """Operations whose own inputs (computed by the sandbox) were compared with the recorder's."""
    local_equal: int = 0
    """... and were equal, bit for bit: the evidence that the sandboxed iteration computed
    what the real one did (a replayed result would match whatever was computed)."""
    local_mismatch: str = ""


def record_file(run_dir: Path, cls: str) -> Path:
    """Where the recorder of role class ``cls`` writes its iteration (and standbys look)."""
    return Path(run_dir) / "warmup" / f"{cls}.pt"


def run_sandboxed(record: Record, fn: WarmupFn) -> WarmupResult:
    """Run ``fn`` as rank ``record.role`` of a world of ``record.world_size``, every
    operation answered from ``record``. torch.distributed must not be initialised
    (a standby before its assignment); it is not initialised afterwards either."""
    from pitstop.errors import PitstopError

    if dist.is_initialized():
        raise PitstopError("the warmup sandbox needs a process without torch.distributed (a standby before it joins)")
    register()
    oracle = ReplayOracle(record)
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(record.role), WORLD_SIZE=str(record.world_size))
    t0 = time.perf_counter()
    res = WarmupResult(record.cls, record.role, False, 0.0)
    try:
        with serving(oracle):
            dist.init_process_group(VIRTUAL_BACKEND, store=dist.HashStore(), rank=record.role, world_size=record.world_size)
            _State.active = record
            try:
                res.out = dict(fn() or {})
                res.ok = True
            finally:
                _teardown()
    except Exception as exc:  # noqa: BLE001 - a failed warmup leaves a cold standby, never a dead job
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:400] if str(exc) else ''}"
        log.debug("sandboxed iteration as rank %d failed", record.role, exc_info=True)
        log.info("sandbox traceback:\n%s", traceback.format_exc(limit=12))
    finally:
        _State.active = None
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    res.seconds = time.perf_counter() - t0
    res.ops = oracle.served
    res.unused = oracle.unused()
    res.local_checked, res.local_equal, res.local_mismatch = (oracle.local_checked, oracle.local_equal,
                                                              oracle.local_mismatch)
    return res


#: What the integrations left installed after a sandboxed iteration, they take down:
#: each registers a function here (:func:`on_teardown`); the runtime does not import them.
_TEARDOWN: List[Callable[[], None]] = []


def on_teardown(fn: Callable[[], None]) -> None:
    """Run ``fn`` after every sandboxed iteration, also a failed one (idempotent per ``fn``)."""
    if fn not in _TEARDOWN:
        _TEARDOWN.append(fn)


def _teardown() -> None:
    """Leave no group, no installed ``parallel_state`` and no default group behind."""
    try:
        for fn in _TEARDOWN:
            fn()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rss_bytes() -> int:
    """This process's resident set size now (not the high-water mark)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the high-water mark is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def record_path(meta: Dict[str, Any]) -> Path:
    """Where a published record lies; refused unless it is ``<run-dir>/warmup/<class>.pt``
    of this job (a path read from the store is never opened blindly)."""
    run_dir = Path(os.environ.get("PITSTOP_RUN_DIR", ".")).resolve()
    want = record_file(run_dir, meta["cls"])
    if Path(meta["path"]).resolve() != want:
        raise RecordMismatchError(f"record of class {meta['cls']} at {meta['path']!r}: expected {want}")
    return want


def warm_up(ch, slot: int, fn: WarmupFn, *, interrupted: Callable[[], bool], timeout_s: float = 600.0) -> List[WarmupResult]:
    """A standby's warmup: one sandboxed iteration per role class, in the order the
    records name. Stops early when ``interrupted()`` (an assignment came, or the job
    ended). Reports to the controller under ``ctl/warm/<slot>``. ``ch`` is the
    authenticated control channel (:class:`pitstop.protocol.Channel`)."""
    from pitstop import protocol
    from pitstop.runtime import keys

    results: List[WarmupResult] = []
    deadline = time.monotonic() + timeout_s

    def await_msg(k: str, schema) -> Any:
        while True:
            body = ch.read(k, schema)
            if body is not None:
                return body
            if interrupted():
                return "interrupted"
            if time.monotonic() > deadline:
                return f"no {k} within {timeout_s:.0f}s"
            time.sleep(0.05)

    classes = await_msg(keys.RECORD_CLASSES, protocol.CLASSES)
    if isinstance(classes, str):
        return _report(ch, slot, results, classes)
    for cls in classes["classes"]:
        if cls not in ("only", "first", "middle", "last"):
            ch.refuse(keys.RECORD_CLASSES, f"unknown role class {cls!r}")
            return _report(ch, slot, results, f"unknown role class {cls!r}")
        k = keys.record(cls)
        meta = await_msg(k, protocol.RECORD)
        if isinstance(meta, str):
            return _report(ch, slot, results, meta)
        if interrupted():
            return _report(ch, slot, results, "interrupted")
        try:
            record = Record.load(record_path(meta))
        except Exception as exc:  # noqa: BLE001
            results.append(WarmupResult(cls, meta.get("role", -1), False, 0.0, error=f"{type(exc).__name__}: {exc}"))
            break
        res = run_sandboxed(record, fn)
        results.append(res)
        if res.ok:
            log.info("[standby %d] warmed up as %s-stage rank %d in %.2fs (%d operations replayed, own inputs of "
                     "%d of %d equal to the recorder's; loss %s, grad norm %s)", slot, cls, res.role, res.seconds,
                     res.ops, res.local_equal, res.local_checked, res.out.get("loss"), res.out.get("grad_norm"))
            if res.local_mismatch:
                log.warning("[standby %d] the sandboxed %s-stage iteration computed something else than the "
                            "recorder: %s", slot, cls, res.local_mismatch)
        else:
            log.warning("[standby %d] warmup as %s-stage rank %d refused, staying a cold standby: %s",
                        slot, cls, res.role, res.error)
            break
    return _report(ch, slot, results, "")


def _report(ch, slot: int, results: List[WarmupResult], stopped: str) -> List[WarmupResult]:
    from pitstop.runtime import keys

    # through JSON once: the results' ``out`` may hold values JSON cannot carry as they are
    ch.put(keys.warm(slot), json.loads(json.dumps({
        "pid": os.getpid(), "results": [asdict(r) for r in results], "stopped": stopped,
        "ok": bool(results) and all(r.ok for r in results) and not stopped, "rss_bytes": rss_bytes(),
    }, default=str)))
    return results


# --------------------------------------------------------------------------- the recording side
class _Recording:
    recorder = None


def maybe_start_recording(layout, rank: int, m=None) -> bool:
    """At job start, on the one rank of each role class: record until the first commit.

    Called by the integration right before the groups are built, so the set-up's
    operations (Megatron's tied-embedding all-reduce, the optimizer's world
    all-gather) are in the record too: the sandbox repeats the whole set-up.
    """
    from pitstop.record import Recorder, recorder_class
    from pitstop.runtime import keys

    # ``m``: this process's :class:`~pitstop.runtime.worker.Membership` (the caller has it;
    # the worker imports this module, so this module does not import the worker)
    # a checkpoint restart's set-up loads a checkpoint, which a sandbox does not: only a
    # fresh start records (the first one, or a start over before any step committed)
    if (m is None or not m.controlled or not m.config.warmup or m.mode != "worker"
            or m.generation != 0 or _Recording.recorder is not None or active() is not None):
        return False
    cls = recorder_class(layout, rank)
    from pitstop import protocol

    if cls is None or m.channel.read(keys.record(cls), protocol.RECORD) is not None:
        return False
    _Recording.recorder = Recorder(layout, rank, cls).start()
    return True


def recording() -> bool:
    return _Recording.recorder is not None


class paused:
    """Operations inside this block are pitstop's own (buddy exchange), not the script's: not recorded."""

    def __enter__(self) -> None:
        from pitstop import pg as pgmod

        self._tap, pgmod.TAP = pgmod.TAP, None

    def __exit__(self, *exc) -> None:
        from pitstop import pg as pgmod

        pgmod.TAP = self._tap


def finish_recording(ch, keep: bool, layout=None) -> Optional[Dict[str, Any]]:
    """Stop recording; with ``keep`` (the first step committed) write the record to
    ``<run-dir>/warmup/<class>.pt`` and publish it to standbys. Returns its metadata."""
    from pitstop.record import stage_classes
    from pitstop.runtime import keys

    rec = _Recording.recorder
    if rec is None:
        return None
    _Recording.recorder = None
    record = rec.stop()
    if not keep or ch is None:
        log.info("warmup record of class %s dropped: the first step was discarded", record.cls)
        return None
    run_dir = Path(os.environ.get("PITSTOP_RUN_DIR", "."))
    path = record_file(run_dir, record.cls)
    size = record.save(path)
    meta = {"cls": record.cls, "role": record.role, "path": str(path.resolve()), "bytes": size,
            "value_bytes": record.nbytes, "ops": record.count,
            "record_s": round(time.perf_counter() - rec.started, 3)}
    if layout is not None:
        ch.put(keys.RECORD_CLASSES, {"classes": list(stage_classes(layout))})
    ch.put(keys.record(record.cls), meta)
    log.info("[r%d] recorded %d operations of the %s stage (%d bytes) for standby warmup", record.role, record.count, record.cls, size)
    return meta
