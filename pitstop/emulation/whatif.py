"""What-if: the recorded execution graph replayed under another layout or network, no rerun.

Pure: no torch, no processes. ``pitstop emulate`` records one trace per pipeline stage; a
stage's program does not depend on how many data-parallel replicas there are, so the same
traces slice into the graph of any world with the same tp, pp, cp and ep (another dp), and
replay on any topology::

    traces (per stage)  ──slice_graph(layout')──>  graph'  ──replay(topology')──>  time per rank

    dp=N          the data-parallel collectives get groups of N (their bytes stay: Megatron's
                  DDP reduces the whole gradient buffer whatever dp is)
    topology=T    every operation priced on T instead

The premise holds for the bulk of a step, not for every byte: ``tests/test_failure_prediction.py``
records the example GPT at dp 1 and dp 2 and finds every collective of 1 KiB or more identical,
operation by operation, while Megatron's optimizer issues a few tiny ones that depend on dp (at
dp 1 one all_reduce of 4 bytes, at dp 2 two all_gathers of 8 and 16 bytes). The what-if keeps the
recorded ones.

What it cannot do without a rerun, and refuses by name: another tp, pp, cp or ep changes every
rank's program (activation sizes, layers per stage, compute), so the trace phase must run at
that layout (``pitstop emulate --tp ... --pp ...``). What it leaves alone: the compute of the
optimizer step, which a distributed optimizer shards by dp (measured at the recorded dp), and
memory under a dp change (the optimizer's shard moves with dp; the recorded peak holds for a
topology change only).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from pitstop.errors import ConfigError
from pitstop.layout import ParallelLayout

_KEYS = ("tp", "pp", "cp", "ep", "dp", "topology")
_FIXED = ("tp", "pp", "cp", "ep")


@dataclass(frozen=True)
class WhatIf:
    """One what-if: ``dp`` and/or ``topology`` (None: as recorded)."""

    text: str
    dp: Optional[int] = None
    topology: Optional[str] = None
    fixed: Optional[Dict[str, int]] = None
    """tp/pp/cp/ep as written (they must equal the recorded ones)."""

    @classmethod
    def parse(cls, text: str) -> "WhatIf":
        got: Dict[str, str] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, eq, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or key not in _KEYS or key in got or not value:
                raise ConfigError(f"--what-if {text!r}: expected KEY=VALUE pairs, each once, keys "
                                  f"{', '.join(_KEYS)} (e.g. 'dp=64,topology=h200-nvlink-ib')")
            got[key] = value
        if not got:
            raise ConfigError(f"--what-if {text!r}: name at least one of {', '.join(_KEYS)}")
        ints: Dict[str, int] = {}
        for k, v in got.items():
            if k == "topology":
                continue
            try:
                ints[k] = int(v)
            except ValueError:
                ints[k] = 0
            if ints[k] < 1:
                raise ConfigError(f"--what-if {text!r}: {k}({v!r}) must be an integer >= 1")
        return cls(text, ints.get("dp"), got.get("topology"), {k: ints[k] for k in _FIXED if k in ints})

    def layout(self, recorded: ParallelLayout) -> ParallelLayout:
        """The what-if layout: the recorded one with its dp (and so its world) changed."""
        for k, v in (self.fixed or {}).items():
            if getattr(recorded, k) != v:
                raise ConfigError(
                    f"--what-if {self.text!r}: {k}({v}) differs from the recorded {k}({getattr(recorded, k)}); "
                    f"changing {k} changes every rank's program (activation sizes, layers per stage, compute), "
                    f"which a replay cannot invent: run `pitstop emulate --{k} {v} ...` at that layout instead")
        if self.dp is None:
            return recorded
        world = recorded.tp * recorded.pp * recorded.cp * self.dp
        return ParallelLayout(world, tp=recorded.tp, pp=recorded.pp, cp=recorded.cp, ep=recorded.ep,
                              etp=recorded.etp, order=recorded.order)


def ranks_to_report(layout: ParallelLayout, recorded_real: Sequence[int]) -> List[int]:
    """Rank 0, the last rank, and every recorded real rank that still exists."""
    return sorted({0, layout.world_size - 1} | {r for r in recorded_real if r < layout.world_size})


def summarise(result: Any, layout: ParallelLayout, ranks: Sequence[int]) -> List[Dict[str, Any]]:
    """Per rank: the replayed steady iteration (median after the first) and its breakdown."""
    out = []
    for r in ranks:
        times = result.iteration_times(r)
        steady = times[1:] or times
        out.append({"rank": r, "coords": layout.coords(r), "iter_s": round(statistics.median(steady), 6),
                    "breakdown_s": {k: round(v, 6) for k, v in result.breakdown(r).items()}})
    return out
