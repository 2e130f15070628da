"""The ``pitstop`` command line.

    pitstop demo [--steps N] [--run-dir DIR]   train the world-8 GPT (tp2 pp2 dp2) on CPU
    pitstop bench groups [--json] [--no-timing] group set-up timing and delta scaling

Later subcommands (launch, drain, status, emulate) follow torchrun's flag names.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from pitstop.errors import PitstopError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pitstop", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="train the world-8 Megatron-Core GPT (tp2 pp2 dp2) on CPU with pitstop-owned groups")
    d.add_argument("--steps", type=int, default=10, help="training iterations (default 10)")
    d.add_argument("--nproc-per-node", type=int, default=8, help="worker processes (default 8)")
    d.add_argument("--tp", type=int, default=2)
    d.add_argument("--pp", type=int, default=2)
    d.add_argument("--run-dir", default="runs/demo", help="logs and loss file go here (default runs/demo)")

    b = sub.add_parser("bench", help="benchmarks; each prints one JSON object")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    g = bsub.add_parser("groups", help="group init time (Megatron vs pitstop), delta rebuild time, delta size up to 8,192 ranks")
    g.add_argument("--json", action="store_true", help="print JSON only (the default output is JSON too, indented)")
    g.add_argument("--no-timing", action="store_true", help="skip the multi-process timing; print only the plan rows")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            from pitstop.launch.demo import run_demo

            return run_demo(args.steps, args.nproc_per_node, args.tp, args.pp, args.run_dir)
        if args.cmd == "bench" and args.bench == "groups":
            from pitstop.launch.bench import bench_groups

            out = bench_groups(with_timing=not args.no_timing)
            print(json.dumps(out) if args.json else json.dumps(out, indent=2))
            return 0
    except PitstopError as exc:
        print(f"pitstop: error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
