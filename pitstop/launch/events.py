"""The event log (JSON lines in the run directory) and the status table a person reads."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

from pitstop.roster import Roster

EVENTS = "events.jsonl"
ROSTER = "roster.json"
CONTROLLER = "controller.json"
CHECKPOINTS = "checkpoints"  # the fallback's checkpoints, unless --save-dir names another place


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (mode 0600), atomically:
    the file never exists with wider permissions, not even for a moment."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older tmp file may have had other bits
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


class EventLog:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / EVENTS
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields: Any) -> Dict[str, Any]:
        ev = {"time": round(time.time(), 6), "event": kind, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(ev, sort_keys=True) + "\n")
        return ev


def read_events(run_dir: Path) -> List[Dict[str, Any]]:
    path = Path(run_dir) / EVENTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def status_table(run_dir: Path, last: int = 10) -> str:
    """The roster (role -> process, standbys) and the last events, as plain text."""
    run_dir = Path(run_dir)
    out: List[str] = []
    rp = run_dir / ROSTER
    if rp.exists():
        r = Roster.from_json(rp.read_text())
        out.append(f"roster generation {r.generation}: {r.world_size} roles, {len(r.standbys)} standby(s)")
        out.append(f"  {'role':>4}  process")
        for i, p in enumerate(r.roles):
            out.append(f"  {i:>4}  {p.describe()}")
        for p in r.standbys:
            out.append(f"  {'sb':>4}  {p.describe()}")
    else:
        out.append(f"no roster yet in {run_dir}")
    events = read_events(run_dir)[-last:]
    out.append(f"last {len(events)} event(s):")
    for ev in events:
        t = time.strftime("%H:%M:%S", time.localtime(ev["time"]))
        rest = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("time", "event"))
        out.append(f"  {t}  {ev['event']:<18} {rest}")
    return "\n".join(out)
