"""``pitstop bench``: measurements that print JSON. Benchmarks are not tests.

``groups``: how long group set-up takes (Megatron's init vs pitstop's, and one
role's delta rebuild, measured side by side in one run at world 8 on this machine),
and how the delta scales with the job (from the pure plan, up to 8,192 ranks).
"""

from __future__ import annotations

import json
import platform
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Dict, List

from pitstop.layout import ParallelLayout
from pitstop.plan import job_group_count, plan_replace

#: The rows of the delta table: (world, tp, pp).
DELTA_ROWS = ((8, 2, 2), (64, 2, 4), (1024, 8, 4), (8192, 8, 8))


def delta_rows() -> List[Dict]:
    """One row per job size; the role is the worst case over first, middle and last stages."""
    rows = []
    for world, tp, pp in DELTA_ROWS:
        lay = ParallelLayout(world, tp=tp, pp=pp)
        roles = sorted({0, lay.rank(pp=pp // 2), lay.rank(pp=pp - 1, tp=tp - 1, dp=lay.dp - 1)})
        plans = [plan_replace(lay, (r,)) for r in roles]
        worst = max(plans, key=lambda p: (len(p.rebuilt), len(p.ranks_involved)))
        rows.append({
            "world_size": world, "tp": tp, "pp": pp, "dp": lay.dp,
            "groups_total": job_group_count(lay),
            "groups_rebuilt": len(worst.rebuilt),
            "ranks_involved": len(worst.ranks_involved),
            "mp_plus_dp": tp * pp + lay.dp * lay.cp,
            "role": worst.replaced[0],
        })
    return rows


def _versions() -> Dict[str, str]:
    out = {"python": platform.python_version()}
    for d in ("torch", "megatron-core"):
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = "absent"
    return out


def timing(world: int = 8, tp: int = 2, pp: int = 2, role: int = 5, timeout: float = 600) -> Dict:
    """Run the timing worker on ``world`` local processes; max over ranks of each figure."""
    from pitstop.launch.local import LocalJob

    worker = str(Path(__file__).with_name("groups_worker.py"))
    with tempfile.TemporaryDirectory(prefix="pitstop-bench-") as tmp:
        job = LocalJob(Path(tmp))
        try:
            ctx = job.start("bench", [worker, str(tp), str(pp), str(role)], range(world), world)
            res = ctx.wait(timeout=timeout, period=0.2)
            if res is None or res.is_failed():
                raise RuntimeError(f"bench workers failed: {res.failures if res else 'timeout'}\n{job.log_tail(ctx)}")
            lines = [json.loads(l) for p in ctx.stdouts.values() for l in Path(p).read_text().splitlines() if l.startswith("{")]
        finally:
            job.close()
    if len(lines) != world:
        raise RuntimeError(f"expected {world} timing lines, got {len(lines)}")
    first = lines[0]
    return {
        "world_size": world, "tp": tp, "pp": pp, "role_replaced": role,
        "megatron_init_s": round(first["megatron_init_s"], 4),
        "pitstop_init_s": round(first["pitstop_init_s"], 4),
        "delta_rebuild_s": round(first["delta_rebuild_s"], 4),
        "ratio_pitstop_vs_megatron_init": round(first["pitstop_init_s"] / first["megatron_init_s"], 3),
        "ranks_that_rebuilt": sum(1 for l in lines if l["rebuilt"]),
    }


def bench_groups(with_timing: bool = True) -> Dict:
    out: Dict = {"bench": "groups", "versions": _versions()}
    if with_timing:
        out["timing"] = timing()
    out["delta"] = delta_rows()
    return out
