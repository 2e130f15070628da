"""What ``commit`` hands back, kept so that a final step is never lost with the process that
would have logged it.

``commit(step, report)`` returns the steps its vote made final, each with its report. The
process may die right after, before its loop logged them. So the reports travel:

    vote commits steps S..T ──> rollback point (snapshot) carries [(S, r), ..., (T, r)]
        ├─ buddy copy ──> a joiner after a failure hands them back (at least once)
        ├─ the leaver's state ──> a drain's joiner hands them back (exactly once: the
        │                         leaver leaves at the vote, before its loop sees them)
        └─ --save-interval checkpoint ──> a restart from it hands them back (at least once)

In JSON form (numbers, strings, lists, dicts, tensors and arrays: :func:`state.encode_value`),
validated when read back: what a peer sent, or a file, is not trusted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from pitstop.errors import RecoveryError
from pitstop.runtime.state import Snapshot, _is_nat, _no_constant, decode_value, encode_value

#: Where a checkpoint keeps each rank's reports of its step, beside the library's own files.
DIRNAME = "pitstop-reports"


def encode(reports: Sequence[Tuple[int, Any]]) -> list:
    """``[(step, report)]`` in JSON form. A report that cannot cross the wire raises
    :class:`RecoveryError` naming its type."""
    return [[int(s), encode_value(r)] for s, r in reports]


def parse(raw: Any, last_step: int) -> List[Tuple[int, Any]]:
    """Decoded (step, report) pairs from :func:`encode`'s form, validated: integer steps,
    ascending, none after ``last_step``. Anything else is a :class:`RecoveryError`."""
    if not isinstance(raw, list):
        raise RecoveryError(f"reports: {type(raw).__name__}, expected a list of [step, report]")
    out: List[Tuple[int, Any]] = []
    for e in raw:
        if not (isinstance(e, list) and len(e) == 2 and _is_nat(e[0])):
            raise RecoveryError(f"report entry {str(e)[:80]}: expected [step, report]")
        if e[0] > last_step or (out and e[0] <= out[-1][0]):
            raise RecoveryError(f"report for step {e[0]}: expected steps ascending and at most step {last_step} "
                                f"(after {out[-1][0] if out else 'none'})")
        out.append((e[0], decode_value(e[1])))
    return out


def of_snapshot(snap: Snapshot) -> List[Tuple[int, Any]]:
    """The reports a snapshot carries (none when it carries none). Only the reports are
    decoded here: the RNG streams beside them were decoded and checked by ``state.restore``."""
    try:
        d = json.loads(bytes(snap.rng).decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecoveryError(f"snapshot header from a peer does not parse: {exc}") from None
    return parse(d.get("reports", []) if isinstance(d, dict) else None, snap.step)


def path(ckpt_dir: str | os.PathLike, step: int, rank: int) -> Path:
    return Path(ckpt_dir) / DIRNAME / f"step_{step:08d}_rank_{rank:05d}.json"


def write(ckpt_dir: str | os.PathLike, step: int, rank: int, encoded: list) -> None:
    """This rank's reports of checkpoint ``step``: written whole or not at all (rename)."""
    p = path(ckpt_dir, step, rank)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"step": step, "reports": encoded}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def read(ckpt_dir: str | os.PathLike, step: int, rank: int) -> Optional[List[Tuple[int, Any]]]:
    """What :func:`write` wrote for (``step``, ``rank``); None when there is no such file."""
    p = path(ckpt_dir, step, rank)
    if not p.exists():
        return None
    try:
        d = json.loads(p.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecoveryError(f"{p}: does not parse: {exc}") from None
    if not (isinstance(d, dict) and d.get("step") == step):
        raise RecoveryError(f"{p}: expected the reports of step {step}, found {str(d)[:80]}")
    return parse(d.get("reports"), step)
