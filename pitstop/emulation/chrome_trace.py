"""A replay as Chrome / Perfetto trace JSON (open it in ui.perfetto.dev or chrome://tracing).

One process (pid) per rank, two threads: ``compute`` (tid 0) and ``comm`` (tid 1).
Every op is a complete ("X") event with ``ts``/``dur`` in microseconds; a comm op
that waited on peers gets a nested ``wait`` event covering its first ``wait`` seconds.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from pitstop.errors import ReplayError
from pitstop.emulation.graph import Compute
from pitstop.emulation.replay import ReplayResult

COMPUTE_TID = 0
COMM_TID = 1
_US = 1e6


def _label(op) -> str:
    if isinstance(op, Compute):
        return op.name or "compute"
    if op.is_p2p:
        return op.name or f"{op.op} {op.peer:+d}"
    return op.name or f"{op.op} {op.group_kind}"


def to_chrome_trace(result: ReplayResult, ranks: Optional[Iterable[int]] = None) -> Dict[str, Any]:
    """``{"traceEvents": [...]}`` for ``ranks``; default: one representative per
    distinct timeline (a world of 8,192 usually has a handful)."""
    chosen = list(result.partition.reps if ranks is None else ranks)
    world = result.graph.world_size
    bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world]
    if bad:
        raise ReplayError(f"ranks {bad[:5]} out of range 0..{world - 1}")
    layout, graph = result.graph.layout, result.graph
    events: List[Dict[str, Any]] = []
    for r in chosen:
        c = layout.coords(r)
        name = f"rank {r} (tp{c['tp']} cp{c['cp']} dp{c['dp']} pp{c['pp']}, {graph.class_of(r)})"
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for tid, tname in ((COMPUTE_TID, "compute"), (COMM_TID, "comm")):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": tname}})
        for t in result.timeline(r):
            op = t.op
            ev: Dict[str, Any] = {
                "name": _label(op), "ph": "X", "pid": r,
                "ts": t.start * _US, "dur": (t.end - t.start) * _US,
                "args": {"iteration": t.iteration, "index": t.index},
            }
            if isinstance(op, Compute):
                ev.update(cat="compute", tid=COMPUTE_TID)
            else:
                ev.update(cat="p2p" if op.is_p2p else "collective", tid=COMM_TID)
                target = graph.target(r, op)
                ev["args"].update(op=op.op, group=op.group_kind, nbytes=op.nbytes, wait_us=t.wait * _US)
                if op.is_p2p:
                    ev["args"]["peer_rank"] = target
                else:
                    ev["args"]["group_size"] = len(target)
            events.append(ev)
            if not isinstance(op, Compute) and t.wait > 0:
                events.append({
                    "name": "bubble" if op.is_p2p else "wait", "ph": "X", "pid": r, "tid": COMM_TID,
                    "cat": "wait", "ts": t.start * _US, "dur": t.wait * _US, "args": {},
                })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"layout": layout.describe(), "topology": result.topology.name}}
