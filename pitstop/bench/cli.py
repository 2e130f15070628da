"""The benchmarks' and the demo's command line: ``pitstop bench ...``, ``pitstop demo`` and
``pitstop-bench ...`` (the same benchmarks, their own entry point).

Benchmarks and the demo sit above everything they measure (they start jobs through
``pitstop.launch`` and read back what the controller wrote), so they live in a package of
their own, the top layer with the command line. ``pitstop.cli`` puts these commands
beside the launcher's.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from pitstop.errors import PitstopError
from pitstop.launch.cli import _count, _endpoint, _seconds

COMMANDS = ("bench", "demo")


def add_commands(sub) -> None:
    """Add ``demo`` and ``bench`` to a ``pitstop`` parser's subcommands."""
    d = sub.add_parser("demo", help="world-8 GPT with one standby: kill a rank, drain another, compare with an uninterrupted run")
    d.add_argument("--steps", type=int, default=80,
                   help="training iterations (default 80: long enough for the refilled standby to warm up before the drain)")
    d.add_argument("--run-dir", default="runs/demo", help="logs and events go here (default runs/demo)")

    b = sub.add_parser("bench", help="benchmarks; each prints one JSON object")
    add_benchmarks(b.add_subparsers(dest="bench", required=True, metavar="BENCH"))


def add_benchmarks(bsub) -> None:
    """One subcommand per benchmark."""
    g = bsub.add_parser("groups", help="group init time (Megatron vs pitstop), delta rebuild time, delta size up to 8,192 ranks")
    g.add_argument("--json", action="store_true", help="print JSON only (the default output is JSON too, indented)")
    g.add_argument("--no-timing", action="store_true", help="skip the multi-process timing; print only the plan rows")
    r = bsub.add_parser("recovery", help="checkpoint restart vs pitstop replacement vs drain, one run, same job")
    r.add_argument("--json", action="store_true")
    r.add_argument("--steps", type=_count(2), default=None, help="default 8 (12 with --framework megatron-lm)")
    r.add_argument("--run-dir", default=None, help="default runs/bench-recovery[-deepspeed|-megatron-lm]")
    r.add_argument("--framework", choices=("megatron", "megatron-lm", "deepspeed"), default="megatron",
                   help="megatron: world-8 GPT vs dist_checkpointing restart; megatron-lm: world-8 Megatron-LM "
                        "pretrain vs its own --save/--load restart (run with .venv-lm's interpreter); deepspeed: "
                        "world-4 ZeRO-2 engine vs DeepSpeed's save_checkpoint/load_checkpoint restart")
    r.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="with --framework deepspeed: the engine's ZeRO stage (default 2); the JSON says which")
    r.add_argument("--repeat", type=_count(1), default=1,
                   help="run the checkpoint restart and the warm replacement N times each, interleaved, and report "
                        "the lower medians, with every repeat under \"repeats\" (megatron and deepspeed)")
    fm = bsub.add_parser("faults", help="the full fault matrix (4 roles x 5 phases), each bitwise against an uninterrupted run")
    fm.add_argument("--json", action="store_true")
    fm.add_argument("--run-dir", default="runs/bench-faults")
    fm.add_argument("--layout", choices=("tp2pp2", "pp3"), default="tp2pp2",
                    help="tp2pp2: world 8, 4 roles; pp3: world 6 with a middle stage and warmed general standbys")
    w = bsub.add_parser("warmup", help="a joiner's first iteration, cold vs after the sandboxed warmup, eager and --compile")
    w.add_argument("--json", action="store_true")
    w.add_argument("--steps", type=_count(4), default=20,
                   help="steps per job (the kill is at step 3; the rest give the joiner's steady iteration)")
    w.add_argument("--modes", default="eager,compiled", help="comma-separated subset of eager,compiled")
    w.add_argument("--run-dir", default="runs/bench-warmup")
    e = bsub.add_parser("emulation", help="emulation fidelity (world 2: emulated vs repeated plain torchrun runs, "
                                          "network from pitstop calibrate) and scale (world 8192)")
    e.add_argument("--json", action="store_true")
    e.add_argument("--steps", type=_count(2), default=10, help="steps per run (the first is left out of the medians)")
    e.add_argument("--configs", default="tp2,pp2,dp2,tp2-deep",
                   help="comma-separated subset of tp2,pp2,dp2,tp2-deep (empty: none)")
    e.add_argument("--repeats", type=_count(1), default=5, help="plain torchrun runs per config (median and spread)")
    e.add_argument("--no-scale", action="store_true", help="skip the world-8192 row")
    e.add_argument("--no-what-if", action="store_true",
                   help="skip the what-if rows (a recorded graph replayed at another dp, against torchrun)")
    e.add_argument("--no-failure", action="store_true",
                   help="skip the failure row (emulate --fault against real world-2 replacements)")
    e.add_argument("--run-dir", default="runs/bench-emulation")
    mc = bsub.add_parser("machines", help="a machine failure and a host drain on 4+1 machines (one launch each) "
                         "vs a checkpoint restart of every machine; overlapping failures")
    mc.add_argument("--json", action="store_true")
    mc.add_argument("--steps", type=_count(8), default=10)
    mc.add_argument("--run-dir", default="runs/bench-machines")
    hk = bsub.add_parser("hook", help="what the iteration boundary costs a steady step: plain torchrun vs pitstop at "
                         "commit_interval 1 and K, world 8 and world 2; and a kill between votes at K")
    hk.add_argument("--json", action="store_true")
    hk.add_argument("--rounds", type=_count(1), default=3, help="runs of each variant, interleaved (default 3)")
    hk.add_argument("--commit-intervals", default="8,32", metavar="K,K,...",
                    help="the intervals compared with 1, each > 1 (default 8,32)")
    hk.add_argument("--run-dir", default="runs/bench-hook")
    c = bsub.add_parser("control", help="junk on every control key while a job loses a rank: refused, job bitwise")
    c.add_argument("--json", action="store_true")
    c.add_argument("--steps", type=_count(6), default=10)
    c.add_argument("--fuzz-seconds", type=_seconds, default=60.0, metavar="S")
    c.add_argument("--run-dir", default="runs/bench-control")
    c.add_argument("--parts", default="fuzz,restart,etcd", help="comma-separated subset of fuzz,restart,etcd")
    c.add_argument("--etcd-endpoint", default=None, metavar="HOST:PORT", type=_endpoint,
                   help="an etcd to use (default: start Debian's etcd-server on free loopback ports)")
    sc = bsub.add_parser("scale", help="the real controller, agents and store with thousands of simulated ranks "
                         "(8 per machine): store operations per step and per second, vote latency, detection, "
                         "control path, controller cost; one row per N")
    sc.add_argument("--json", action="store_true")
    sc.add_argument("--ranks", default="64,256,1024,4096,8192", metavar="N,N,...",
                    help="simulated ranks per row, each a multiple of 8 with at least 3 machines (default "
                         "64,256,1024,4096,8192)")
    sc.add_argument("--backends", default="tcpstore", metavar="B,B",
                    help="comma-separated subset of tcpstore,etcd (default tcpstore)")
    sc.add_argument("--window", type=_seconds, default=10.0, metavar="S",
                    help="the steady window in which operations and votes are counted (default 10)")
    sc.add_argument("--run-dir", default="runs/bench-scale")
    sc.add_argument("--no-real-world8", action="store_true",
                    help="skip real_world8: a real world-8 GPT job's store operations, counted from outside "
                         "pitstop's code, beside a simulated world 8 of the same shape (about 2 minutes)")


def _ranks(text: str) -> tuple:
    try:
        ns = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        ns = ()
    bad = [n for n in ns if n % 8 or n < 24]
    if not ns or bad:
        raise PitstopError(f"--ranks {text!r}: expected comma-separated multiples of 8, each >= 24 (3 machines of 8)"
                           + (f"; not {bad}" if bad else ""))
    return ns


def run(args: argparse.Namespace) -> int:
    """Run the ``demo`` or ``bench`` command that ``args`` names; PitstopError propagates."""
    if args.cmd == "bench" and args.bench == "scale":
        from pathlib import Path

        from pitstop.bench.scale import run as bench_scale

        backends = tuple(x for x in args.backends.split(",") if x)
        bad = [b for b in backends if b not in ("tcpstore", "etcd")]
        if bad or not backends:
            raise PitstopError(f"--backends {args.backends!r}: expected a comma-separated subset of tcpstore,etcd")
        out = bench_scale(ranks=_ranks(args.ranks), backends=backends, work=Path(args.run_dir), window_s=args.window,
                          real8=not args.no_real_world8)
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0 if all("error" not in r for r in out["rows"]) else 1
    if args.cmd == "bench" and args.bench == "machines":
        from pitstop.bench.machines import bench_machines

        out = bench_machines(steps=args.steps, run_dir=args.run_dir)
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0
    if args.cmd == "bench" and args.bench == "control":
        from pitstop.bench.control import bench_control

        parts = tuple(x for x in args.parts.split(",") if x)
        bad = [x for x in parts if x not in ("fuzz", "restart", "etcd")]
        if bad or not parts:
            raise PitstopError(f"--parts {args.parts!r}: expected a comma-separated subset of fuzz,restart,etcd")
        out = bench_control(run_dir=args.run_dir, steps=args.steps, fuzz_s=args.fuzz_seconds, parts=parts,
                            etcd_endpoint=args.etcd_endpoint)
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        ok = [out["fuzz"]["job_ok"]] if "fuzz" in out else []
        ok += [out["controller_restart"]["replaced_after_restart"]] if "controller_restart" in out else []
        return 0 if all(ok) else 1
    if args.cmd == "bench" and args.bench == "hook":
        from pitstop.bench.hook import bench_hook

        try:
            ks = [int(x) for x in args.commit_intervals.split(",") if x]
        except ValueError:
            ks = []
        from pitstop.bench.hook import check_intervals

        try:
            check_intervals(ks)
        except ValueError as exc:
            raise PitstopError(f"--commit-intervals {args.commit_intervals!r}: {exc}") from None
        if not ks:
            raise PitstopError(f"--commit-intervals {args.commit_intervals!r}: expected comma-separated integers")
        out = bench_hook(run_dir=args.run_dir, rounds=args.rounds, intervals=ks)
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0 if all(r["loss_identical"] for r in out["recovery"]) else 1
    if args.cmd == "bench" and args.bench == "recovery":
        from pitstop.bench.recovery import bench_recovery, bench_recovery_deepspeed

        if args.framework == "deepspeed":
            stage = 2 if args.zero_stage is None else args.zero_stage
            from pitstop.integrations.deepspeed_config import unsupported

            bad = unsupported({"zero_optimization": {"stage": stage}})
            if bad:  # before any process starts: nothing half-way
                raise PitstopError(f"--zero-stage {stage}: " + "; ".join(bad))
            out = bench_recovery_deepspeed(steps=args.steps or 8, zero_stage=stage, repeat=args.repeat,
                                           run_dir=args.run_dir or "runs/bench-recovery-deepspeed")
        elif args.framework == "megatron-lm":
            if args.zero_stage is not None:
                raise PitstopError(f"--zero-stage {args.zero_stage}: only with --framework deepspeed")
            if args.repeat != 1:
                raise PitstopError(f"--repeat {args.repeat}: not with --framework megatron-lm (one run of each)")
            from pitstop.bench.megatron_lm import bench_recovery_megatron_lm

            out = bench_recovery_megatron_lm(steps=args.steps or 12,
                                             run_dir=args.run_dir or "runs/bench-recovery-megatron-lm")
        elif args.zero_stage is not None:
            raise PitstopError(f"--zero-stage {args.zero_stage}: only with --framework deepspeed (the Megatron "
                               "bench uses Megatron's distributed optimizer)")
        else:
            out = bench_recovery(steps=args.steps or 8, run_dir=args.run_dir or "runs/bench-recovery", repeat=args.repeat)
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0
    if args.cmd == "bench" and args.bench == "faults":
        from pitstop.bench.recovery import bench_faults

        out = bench_faults(run_dir=args.run_dir, layout=args.layout)
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0
    if args.cmd == "bench" and args.bench == "warmup":
        from pitstop.bench.warmup import bench_warmup

        modes = [m for m in args.modes.split(",") if m]
        bad = [m for m in modes if m not in ("eager", "compiled")]
        if bad or not modes:
            print(f"pitstop: error: --modes {args.modes!r}: expected a comma-separated subset of eager,compiled", file=sys.stderr)
            return 2
        out = bench_warmup(steps=args.steps, run_dir=args.run_dir, modes=modes)
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0
    if args.cmd == "bench" and args.bench == "emulation":
        from pitstop.bench.emulation import main as bench_emulation

        out = bench_emulation(args.run_dir, args.steps, args.configs, not args.no_scale, args.repeats,
                              not args.no_failure, not args.no_what_if)
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0
    if args.cmd == "demo":
        from pitstop.bench.demo import run_demo

        return run_demo(args.steps, args.run_dir)
    if args.cmd == "bench" and args.bench == "groups":
        from pitstop.bench.groups import bench_groups

        out = bench_groups(with_timing=not args.no_timing)
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0
    raise PitstopError(f"unknown command {args.cmd!r} {getattr(args, 'bench', '')}")


def main(argv: Optional[List[str]] = None) -> int:
    """``pitstop-bench BENCH ...`` is ``pitstop bench BENCH ...``."""
    p = argparse.ArgumentParser(prog="pitstop-bench", description="pitstop's benchmarks; each prints one JSON object")
    add_benchmarks(p.add_subparsers(dest="bench", required=True, metavar="BENCH"))
    args = p.parse_args(argv)
    args.cmd = "bench"
    try:
        return run(args)
    except PitstopError as exc:
        print(f"pitstop-bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
