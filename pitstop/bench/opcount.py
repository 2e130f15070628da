"""Every control-store operation of a real job, counted from outside the code it counts.

``pitstop bench scale`` says a simulated rank costs the store what a real worker does. That
claim needs a count of a real job that does not go through pitstop's own bookkeeping: this
module replaces ``torch.distributed.TCPStore`` in each process of the job with a factory
whose clients count every operation they forward, before any pitstop code runs (Python
imports ``sitecustomize`` at start-up from ``PYTHONPATH``; ``opcount_site/`` holds one that
calls :func:`install` when :data:`ENV_DIR` is set)::

    real job process (controller, agent, worker)
      torch.distributed.TCPStore(...)  ->  Counted(real TCPStore client)  --ops-->  TCPStore server
                                               | tally[label.op] += 1
                                               v
                                 $PITSTOP_OPCOUNT_DIR/<pid>.json  (a snapshot every 0.25 s)

A client counts under a label from the process's kind (its command line) and, in a worker,
the thread that sends the operation (:func:`label`): ``main`` (the training thread, the
asynchronous commit's vote thread), ``heartbeat`` (the beat thread and its looks),
``watch`` (a key watch), ``agent`` or ``controller``. c10d's own rendezvous goes through the
same clients; the bench reads a window of steady steps, after every group is built.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

#: The directory each counted process writes its snapshots to (unset: nothing is installed).
ENV_DIR = "PITSTOP_OPCOUNT_DIR"
#: The directory that holds the ``sitecustomize`` to put first on a job's ``PYTHONPATH``.
SITE_DIR = Path(__file__).resolve().parent / "opcount_site"

#: What a client of each kind counts: the store operations pitstop's code and c10d send.
OPS = ("set", "get", "add", "check", "wait", "compare_set", "delete_key", "multi_get", "multi_set",
       "num_keys", "append")

LABELS = ("main", "heartbeat", "watch", "agent", "controller")


def process_kind(argv: Sequence[str]) -> str:
    """``controller``, ``agent`` or ``worker``, from a process's whole command line
    (``sys.orig_argv``: ``python -m pitstop.launch.cli launch ...``); what follows ``--`` is
    the training script's, never the launcher's."""
    args = list(argv)
    head = args[:args.index("--")] if "--" in args else args
    if "pitstop.launch.node_agent" in head:
        return "agent"
    launcher = "pitstop.launch.cli" in head or any(a.endswith("/pitstop") or a == "pitstop" for a in head[:2])
    if launcher and "launch" in head:
        i = head.index("--node-rank") if "--node-rank" in head else -1
        return "agent" if 0 <= i < len(head) - 1 and head[i + 1] != "0" else "controller"
    return "worker"


def label(kind: str, thread_name: str) -> str:
    """The label an operation is counted under (see the module docstring)."""
    if kind in ("agent", "controller"):
        return kind
    if thread_name.startswith(("pitstop-heartbeat", "pitstop-look", "pitstop-ended")):
        return "heartbeat"
    if thread_name.startswith("pitstop-watch"):
        return "watch"
    return "main"


class Tally:
    """Operations by ``label.op``, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: Dict[str, int] = {}

    def add(self, key: str) -> None:
        with self._lock:
            self.ops[key] = self.ops.get(key, 0) + 1

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self.ops)


def _counted_class():
    import torch.distributed as dist

    class Counted(dist.Store):
        """A store client that counts each operation before it forwards it (a ``dist.Store``,
        so c10d takes it as it takes the client it wraps)."""

        def __init__(self, inner, tally: Tally, kind: str) -> None:
            super().__init__()  # the pybind trampoline needs it
            self._inner, self._tally, self._kind = inner, tally, kind

        def _n(self, op: str) -> None:
            self._tally.add(f"{label(self._kind, threading.current_thread().name)}.{op}")

        def set(self, key, value):
            self._n("set")
            return self._inner.set(key, value)

        def get(self, key):
            self._n("get")
            return self._inner.get(key)

        def add(self, key, value):
            self._n("add")
            return self._inner.add(key, value)

        def check(self, keys):
            self._n("check")
            return self._inner.check(keys)

        def wait(self, keys, timeout: Optional[timedelta] = None):
            self._n("wait")
            return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

        def compare_set(self, key, expected, desired):
            self._n("compare_set")
            return self._inner.compare_set(key, expected, desired)

        def delete_key(self, key):
            self._n("delete_key")
            return self._inner.delete_key(key)

        def num_keys(self):
            self._n("num_keys")
            return self._inner.num_keys()

        def multi_get(self, keys):
            self._n("multi_get")
            return self._inner.multi_get(keys)

        def multi_set(self, keys, values):
            self._n("multi_set")
            return self._inner.multi_set(keys, values)

        def append(self, key, value):
            self._n("append")
            return self._inner.append(key, value)

        def set_timeout(self, timeout):
            return self._inner.set_timeout(timeout)

        @property
        def timeout(self):
            return self._inner.timeout

        @property
        def port(self):
            return self._inner.port

        @property
        def host(self):
            return self._inner.host

        @property
        def libuvBackend(self):  # noqa: N802 - c10d's name
            return self._inner.libuvBackend

        def clone(self):
            return Counted(self._inner.clone(), self._tally, self._kind)

    return Counted


def install(out_dir: str, argv: Optional[Sequence[str]] = None, every_s: float = 0.25) -> Tally:
    """Count this process's store operations into ``out_dir/<pid>.json`` (see the module
    docstring). Called once, at start-up, before anything connects."""
    import torch.distributed as dist

    # orig_argv: at start-up a ``-m`` module's name is not yet in sys.argv
    argv = list(argv if argv is not None else getattr(sys, "orig_argv", sys.argv))
    kind = process_kind(argv)
    tally = Tally()
    real = dist.TCPStore
    Counted = _counted_class()

    def tcp_store(*a, **kw):
        return Counted(real(*a, **kw), tally, kind)

    dist.TCPStore = tcp_store
    path = Path(out_dir) / f"{os.getpid()}.json"
    snaps: List[List[Any]] = []
    argv_text = argv[:12]

    def write() -> None:
        snaps.append([round(time.time(), 3), tally.snapshot()])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "kind": kind, "argv": argv_text, "snaps": snaps[-2400:]}))
        os.replace(tmp, path)

    def loop() -> None:
        while True:
            time.sleep(every_s)
            try:
                write()
            except OSError:
                return

    threading.Thread(target=loop, name="opcount", daemon=True).start()
    return tally


def at(snaps: List[List[Any]], t: float) -> Dict[str, int]:
    """The counts of the last snapshot at or before ``t`` (nothing before the first)."""
    got: Dict[str, int] = {}
    for ts, counts in snaps:
        if ts > t:
            break
        got = counts
    return got


def window(files: Sequence[Path], t0: float, t1: float) -> Dict[str, Dict[str, int]]:
    """Per process kind, the operations by ``label.op`` counted between ``t0`` and ``t1``,
    over every process whose snapshots cover the window."""
    out: Dict[str, Dict[str, int]] = {}
    for f in files:
        try:
            d = json.loads(Path(f).read_text())
        except (OSError, ValueError):
            continue
        snaps = d.get("snaps") or []
        if not snaps or snaps[0][0] > t0 or snaps[-1][0] < t1:
            continue  # started or ended inside the window: not a steady process
        a, b = at(snaps, t0), at(snaps, t1)
        tot = out.setdefault(d["kind"], {})
        for k, v in b.items():
            if v - a.get(k, 0):
                tot[k] = tot.get(k, 0) + v - a.get(k, 0)
    return out


def kinds(files: Sequence[Path], t0: float, t1: float) -> Dict[str, int]:
    """How many processes of each kind :func:`window` counted (those whose snapshots cover it)."""
    out: Dict[str, int] = {}
    for f in files:
        try:
            d = json.loads(Path(f).read_text())
        except (OSError, ValueError):
            continue
        snaps = d.get("snaps") or []
        if snaps and snaps[0][0] <= t0 and snaps[-1][0] >= t1:
            out[d["kind"]] = out.get(d["kind"], 0) + 1
    return out
