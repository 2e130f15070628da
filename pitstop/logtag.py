"""The prefix of a rank's log lines, built in one place: ``[g3 r5 step 120]``.

g is the group generation (it grows with every replacement or drain), r the role's rank,
step the training step when there is one. Grepping a job's logs for ``[g1 r5`` then finds
everything the process playing role 5 did after the first change, whichever process it was.
"""

from __future__ import annotations

from typing import Optional


def tag(generation: int, rank: int, step: Optional[int] = None) -> str:
    return f"[g{generation} r{rank}" + (f" step {step}]" if step is not None else "]")
