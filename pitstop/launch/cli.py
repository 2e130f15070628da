"""The ``pitstop`` command line.

    pitstop launch --nproc-per-node N --standby S [--run-dir DIR] -- SCRIPT ARGS...
    pitstop drain --run-dir DIR (--rank R | --host H)
    pitstop status --run-dir DIR
    pitstop emulate --world-size N --real-ranks R,... -- SCRIPT ARGS...

``pitstop bench ...`` and ``pitstop demo`` are added by :mod:`pitstop.cli` from
:mod:`pitstop.bench.cli` (the benchmarks sit above the launcher they measure).

Flag names follow torchrun's (``--nproc-per-node``, ``--nnodes``, ``--rdzv-endpoint``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional

from pitstop.errors import PitstopError


def _seconds(text: str) -> float:
    """A finite number of seconds > 0 (argparse turns the error into a usage line, exit 2)."""
    return _number(text, positive=True)


def _number(text: str, positive: bool) -> float:
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of seconds {'> 0' if positive else '>= 0'}")
    return v


def _count(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {lo}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {lo}")
        return v
    return parse


def _endpoint(text: str) -> str:
    from pitstop.store import parse_endpoint

    try:
        parse_endpoint(text)
    except PitstopError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parser(more: Optional[Callable] = None) -> argparse.ArgumentParser:
    """The launcher's commands; ``more(subparsers)`` adds others (``pitstop.cli`` adds the
    benchmarks' and the demo's, which sit above this layer)."""
    p = argparse.ArgumentParser(prog="pitstop", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    if more is not None:
        more(sub)

    la = sub.add_parser("launch", help="run a training script with a controller, standbys and heartbeats")
    la.add_argument("--nproc-per-node", type=_count(1), default=None, help="workers on this machine (required, "
                    "but with --resume)")
    la.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                    help="machines, one agent each: N train; MIN:MAX adds MAX-MIN standby machines "
                         "(default 1, or SLURM_NNODES under srun)")
    la.add_argument("--node-rank", type=_count(0), default=None,
                    help="this machine's rank: 0 runs the controller (default 0, or SLURM_NODEID under srun)")
    la.add_argument("--local-addr", default=None, metavar="ADDR",
                    help="this machine's address: its processes' gloo groups listen there (default: the "
                         "--rdzv-endpoint host on the head, 127.0.0.1 otherwise)")
    la.add_argument("--max-restarts", type=_count(0), default=3,
                    help="full restarts (checkpoint fallback or from scratch) before the job is given up (default 3; "
                         "replacements and drains do not count)")
    la.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", type=_endpoint,
                    help="c10d: where the control store listens, that one interface (default 127.0.0.1 and a free "
                         "port); etcd: an etcd client address")
    la.add_argument("--rdzv-backend", default="c10d", choices=("c10d", "etcd"),
                    help="c10d (default): a TCPStore inside the controller, whose death ends the job; etcd: the "
                         "control plane in etcd, training goes on while the controller is down and it restarts")
    la.add_argument("--resume", action="store_true",
                    help="re-attach a controller to the etcd-backed job of --run-dir (its workers still running)")
    la.add_argument("--run-dir", default="runs/latest", help="logs, events.jsonl, roster.json (default runs/latest)")
    from pitstop.settings import add_flags

    add_flags(la.add_argument_group(
        "settings", "the same as the script's --pitstop-* flags and the DeepSpeed config's \"pitstop\" keys; "
                    "strongest first: these flags, the script's flags, the DeepSpeed section, the default"))
    la.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")

    dr = sub.add_parser("drain", help="move a rank (or every rank of a host) to a standby, training on")
    dr.add_argument("--run-dir", required=True)
    who = dr.add_mutually_exclusive_group(required=True)
    who.add_argument("--rank", type=_count(0))
    who.add_argument("--host")

    st = sub.add_parser("status", help="print the roster and the last events of a run")
    st.add_argument("--run-dir", required=True)
    st.add_argument("--last", type=_count(0), default=10)

    em = sub.add_parser("emulate", help="run a job of N ranks with a few real processes; the rest are virtual")
    em.add_argument("--world-size", type=_count(1), required=True, metavar="N")
    em.add_argument("--tp", type=_count(1), default=1)
    em.add_argument("--pp", type=_count(1), default=1)
    em.add_argument("--cp", type=_count(1), default=1)
    em.add_argument("--ep", type=_count(1), default=1)
    em.add_argument("--real-ranks", required=True, metavar="R,R,...", help="ranks that run for real, e.g. 0,8191")
    em.add_argument("--topology", default="cpu-gloo-loopback",
                    help="a topology JSON/TOML file, or a shipped name: cpu-gloo-loopback (default), h200-nvlink-ib")
    em.add_argument("--out", default="runs/emulate", help="report.json, trace.json, logs (default runs/emulate)")
    em.add_argument("--timeout", type=_seconds, default=900.0, metavar="S", help="per phase")
    em.add_argument("--trace-all", action="store_true",
                    help="trace every rank for real (a small world only): the trace is of a real run")
    em.add_argument("--fit-network", action="store_true",
                    help="with --trace-all: fit the link's alpha and bandwidth to the collectives the trace measured")
    em.add_argument("--no-memory", action="store_true",
                    help="skip the memory phase (the real ranks' peak tensor bytes; one more run of the script)")
    em.add_argument("--fault", metavar="rank=R,step=S",
                    help="also predict the downtime of a standby replacing rank R during step S (R becomes a real "
                         "rank; needs --recovery-costs and a topology from `pitstop calibrate`)")
    em.add_argument("--recovery-costs", metavar="PATH",
                    help="with --fault: a real replacement's detection and planning times: a `pitstop launch` run "
                         "directory, its events.jsonl, a JSON {detect_s, plan_s}, or `pitstop bench scale --json` "
                         "output (its row at --world-size ranks, or the nearest; the report names it)")
    em.add_argument("--chakra", action="store_true",
                    help="also write the target-scale graph as Chakra execution traces, one file per rank "
                         "(OUT/chakra/et.RANK.et and et.comm_groups.json, for ASTRA-sim); needs protobuf")
    em.add_argument("--chakra-ranks", metavar="R,R,...", help="with --chakra: only these ranks' files")
    em.add_argument("--what-if", action="append", default=[], metavar="dp=N,topology=T",
                    help="also replay the recorded graph with another data-parallel degree and/or network, "
                         "without rerunning (repeatable); another tp/pp/cp/ep is refused: it needs its own trace")
    em.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS... (give the script the same --tp/--pp)")

    ca = sub.add_parser("calibrate", help="measure this machine's collective costs into a topology file "
                                          "(per operation, group size and message size; for `pitstop emulate --topology`)")
    ca.add_argument("--out", required=True, help="the topology JSON to write")
    ca.add_argument("--name", default="cpu-gloo-calibrated", help="the topology's name (default cpu-gloo-calibrated)")
    ca.add_argument("--group-sizes", default="2", metavar="N,N,...", help="world sizes to measure, each >= 2 (default 2)")
    ca.add_argument("--sizes", default=None, metavar="B,B,...",
                    help="message sizes in bytes (default 4 KiB to 16 MiB, every 4x)")
    ca.add_argument("--repeats", type=_count(1), default=20, help="timed repetitions per (op, size); their mean is kept (the replay sums costs)")
    ca.add_argument("--gpus-per-node", type=_count(1), default=8)

    return p


def main(argv: Optional[List[str]] = None) -> int:
    """The launcher's commands alone (``python -m pitstop.launch.cli``); the ``pitstop``
    command is :func:`pitstop.cli.main`, which adds ``bench`` and ``demo``."""
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except PitstopError as exc:
        print(f"pitstop: error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    """Run the launcher command ``args`` names; PitstopError propagates to the caller."""
    if args.cmd == "launch":
        return _launch(args)
    if args.cmd == "drain":
        from pitstop.launch.controller import request_drain

        n = request_drain(args.run_dir, rank=args.rank, host=args.host)
        print(f"drain request {n} sent ({'rank ' + str(args.rank) if args.rank is not None else 'host ' + args.host}); "
              f"follow it with: pitstop status --run-dir {args.run_dir}")
        return 0
    if args.cmd == "status":
        from pathlib import Path

        from pitstop.launch.events import status_table

        if not Path(args.run_dir).is_dir():
            raise PitstopError(f"--run-dir {args.run_dir!r}: no such run directory (give the one `pitstop launch --run-dir` used)")
        print(status_table(args.run_dir, args.last))
        return 0
    if args.cmd == "emulate":
        return _emulate(args)
    if args.cmd == "calibrate":
        return _calibrate(args)
    raise PitstopError(f"unknown command {args.cmd!r}")


def _int_list(flag: str, text: str, lo: int) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PitstopError(f"{flag} {text!r}: expected comma-separated integers >= {lo}") from None
    if not out or min(out) < lo:
        raise PitstopError(f"{flag} {text!r}: expected comma-separated integers >= {lo}")
    return out


def _calibrate(args) -> int:
    import json
    import shlex

    from pitstop.emulation.calibrate import TABLE_SIZES, calibrate_topology

    groups = _int_list("--group-sizes", args.group_sizes, 2)
    sizes = _int_list("--sizes", args.sizes, 4) if args.sizes else list(TABLE_SIZES)
    if len(set(sizes)) < 2:
        raise PitstopError(f"--sizes {args.sizes!r}: expected >= 2 distinct sizes")
    command = (f"pitstop calibrate --out {shlex.quote(args.out)} --name {shlex.quote(args.name)} --group-sizes "
               f"{','.join(map(str, groups))} --sizes {','.join(map(str, sizes))} --repeats {args.repeats} "
               f"--gpus-per-node {args.gpus_per_node}")
    data = calibrate_topology(args.name, groups, sizes, args.repeats, args.gpus_per_node, command)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    for op, rows in data["intra_node"]["table"].items():
        for n, pts in rows.items():
            print(f"{op:15s} n={n:>3s}  " + "  ".join(f"{b}B {t * 1e3:.3f}ms" for b, t in pts))
    print("group build     " + "  ".join(f"n={n} {t * 1e3:.2f}ms" for n, t in data.get("group_build_s", {}).items()))
    print(f"wrote {args.out}")
    return 0


def _emulate(args) -> int:
    from pathlib import Path

    from pitstop.launch.emulate import EmulateSpec, emulate, parse_ranks, table

    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    from pitstop.layout import ParallelLayout

    ParallelLayout(args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)  # names every factor
    from pitstop.emulation.whatif import WhatIf

    real = parse_ranks(args.real_ranks, args.world_size)
    fault = costs = None
    if args.fault:
        from pitstop.emulation.failure import FaultSpec
        from pitstop.launch.emulate import load_recovery_costs

        fault = FaultSpec.parse(args.fault, args.world_size)
        real = sorted(set(real) | {fault.rank})
        if not args.recovery_costs:
            raise PitstopError("--fault needs --recovery-costs PATH: a real replacement's detection and planning "
                               "times (a `pitstop launch` run directory, its events.jsonl, or {detect_s, plan_s})")
        costs = load_recovery_costs(Path(args.recovery_costs), args.world_size)
    elif args.recovery_costs:
        raise PitstopError("--recovery-costs is read only with --fault rank=R,step=S")
    spec = EmulateSpec(args.world_size, args.tp, args.pp, real, script,
                       Path(args.out), args.topology, args.cp, args.ep, args.timeout, memory=not args.no_memory,
                       trace_ranks=list(range(args.world_size)) if args.trace_all else None, fit_network=args.fit_network,
                       fault=fault, recovery_costs=costs, what_if=[WhatIf.parse(w) for w in args.what_if],
                       chakra=args.chakra or bool(args.chakra_ranks),
                       chakra_ranks=parse_ranks(args.chakra_ranks, args.world_size) if args.chakra_ranks else None)
    report = emulate(spec)
    print(table(report))
    print(f"report: {spec.out / 'report.json'}   trace: {spec.out / 'trace.json'} (ui.perfetto.dev)")
    if report.get("chakra"):
        c = report["chakra"]
        print(f"chakra: {c['ranks']} rank file(s) {c['prefix']}.RANK.et, {c['nodes']} nodes, {c['bytes']:,} B "
              f"(schema {c['schema_version']}); comm groups: {c['prefix']}.comm_groups.json")
    return 0


def _launch(args) -> int:
    from pathlib import Path

    from pitstop.launch.controller import Controller

    if args.resume:
        from pitstop.launch.supervisor import load_spec, supervise

        if args.script and args.script != ["--"]:
            raise PitstopError("--resume takes the job from --run-dir/launch.json: give no script")
        return supervise(load_spec(Path(args.run_dir)), resume=True)
    spec, node_rank, endpoint = launch_spec(args)
    script, cfg = spec.argv, spec.config
    if not Path(script[0]).exists():
        raise PitstopError(f"training script {script[0]!r} does not exist")
    _check_layout(script[1:], spec.world_size)
    if spec.multi_node and not endpoint:
        raise PitstopError(f"--nnodes {spec.nnodes}: give --rdzv-endpoint HOST:PORT, the head machine's address "
                           "(every machine's launch uses the same one)")
    if node_rank > 0:  # not the head: this machine's agent only
        from pitstop.launch.node_agent import NodeAgent, setup_logging
        from pitstop.protocol import take_token_from_env
        from pitstop.store import etcd_spec

        token = take_token_from_env()
        where = endpoint if spec.rdzv_backend != "etcd" else etcd_spec(endpoint, _job_id(token))
        setup_logging()
        return NodeAgent(node_rank, args.local_addr or "127.0.0.1", args.nproc_per_node, script, Path(args.run_dir),
                         where, token, cfg.heartbeat_interval_s, heartbeat_timeout_s=cfg.heartbeat_timeout_s).run()
    if spec.rdzv_backend == "etcd":
        from pitstop.launch.supervisor import supervise

        return supervise(spec)
    return Controller(spec).run()


def _job_id(token: str) -> str:
    from pitstop.protocol import job_id

    if len(token) < 32:
        raise PitstopError("--rdzv-backend etcd on several machines: set PITSTOP_JOB_TOKEN to the same secret of at "
                           "least 32 characters on every machine")
    return job_id(token)


def launch_spec(args):
    """``(LaunchSpec, node rank, rendezvous endpoint)`` of parsed ``pitstop launch`` arguments.

    Settings come, strongest first, from ``pitstop launch``'s flags, the training script's
    own ``--pitstop-*`` flags (:func:`_script_flags`: the controller must use what the
    workers use), and the DeepSpeed config's ``"pitstop"`` section. A setting given both
    to ``pitstop launch`` and to the script with different values is refused."""
    import os
    from pathlib import Path

    from pitstop.launch.controller import LaunchSpec
    from pitstop.runtime.config import RuntimeConfig
    from pitstop.settings import BY_KEY, SETTINGS, given_flags, runtime_fields

    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    if not script:
        raise PitstopError("no training script given: pitstop launch [options] -- SCRIPT ARGS...")
    if args.nproc_per_node is None:
        raise PitstopError("pitstop launch: --nproc-per-node N is required (workers on this machine)")
    given = given_flags(args)
    from_script = _script_flags(script[1:])
    for k, val in from_script.items():
        if k in given and given[k] != val:
            s = BY_KEY[k]
            raise PitstopError(
                f"the training script's {s.flag(script=True)} {_show(val)} and pitstop launch's {s.flag()} "
                f"{_show(given[k])} disagree: the controller and the workers must use one value; give it once, "
                "to pitstop launch")
    section = _deepspeed_section(script[1:])
    base = section.settings() if section is not None else {}  # the DeepSpeed config's "pitstop" section
    v = {**{s.key: s.default for s in SETTINGS}, **base, **from_script, **given}
    cfg = RuntimeConfig(**runtime_fields(v))

    from pitstop.launch.nodes import Nodes, from_slurm

    slurm = from_slurm(os.environ)
    nnodes = args.nnodes or (str(slurm.nnodes) if slurm else "1")
    node_rank = args.node_rank if args.node_rank is not None else (slurm.node_rank if slurm else 0)
    endpoint = args.rdzv_endpoint or (f"{slurm.head}:29400" if slurm and Nodes.parse(nnodes).max > 1 else None)
    env = {k: v for k, v in os.environ.items() if k == "PITSTOP_FAULT"}
    spec = LaunchSpec(script, args.nproc_per_node, v["standby"], nnodes, endpoint,
                      Path(args.run_dir), cfg, env, local_addr=args.local_addr, rdzv_backend=args.rdzv_backend,
                      max_restarts=args.max_restarts)
    spec.nodes.check_rank(node_rank)
    return spec, node_rank, endpoint


def _show(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _script_flags(script_args: List[str]) -> dict:
    """The ``--pitstop-*`` flags given explicitly in the training script's arguments, as
    settings by key (``{"heartbeat_timeout": 3.0, "buddy": False, ...}``). Parsed with the
    flags the script has (:func:`pitstop.settings.add_flags`, which ``add_pitstop_args``
    calls), so both read one value the same way; with no defaults, so only what was given."""
    from pitstop.settings import add_flags, given_flags

    p = argparse.ArgumentParser(prog="the training script's --pitstop-* flags", add_help=False, exit_on_error=False,
                                allow_abbrev=False)
    add_flags(p, script=True)
    try:
        ns, _ = p.parse_known_args(script_args)
    except argparse.ArgumentError as exc:
        raise PitstopError(f"the training script's {exc}") from None
    return given_flags(ns, script=True)


#: Where a training script takes its DeepSpeed config (DeepSpeed's own flag, and examples/train_deepspeed.py's).
_DS_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--deepscale_config")


def _deepspeed_section(script_args: List[str]):
    """The validated "pitstop" section of the DeepSpeed config named in the script's arguments, or None."""
    for i, a in enumerate(script_args):
        name, _, value = a.partition("=")
        if name in _DS_CONFIG_FLAGS:
            value = value or (script_args[i + 1] if i + 1 < len(script_args) else "")
            from pitstop.integrations.deepspeed_config import refuse_unsupported, strip_section

            data, section = strip_section(value)  # ConfigError names the key, before anything starts
            refuse_unsupported(data)
            return section
    return None


#: Parallel-degree flags of Megatron-LM and of examples/train_gpt.py, by layout field.
_DEGREE_FLAGS = {
    "tp": ("--tp", "--tensor-model-parallel-size"),
    "pp": ("--pp", "--pipeline-model-parallel-size"),
    "cp": ("--cp", "--context-parallel-size"),
    "ep": ("--ep", "--expert-model-parallel-size"),
}


def _check_layout(script_args: List[str], world_size: int) -> None:
    """Refuse, before any process starts, a layout in the script's flags that does not divide the world."""
    from pitstop.layout import ParallelLayout

    degrees = {}
    for i, a in enumerate(script_args):
        name, _, value = a.partition("=")
        for field, flags in _DEGREE_FLAGS.items():
            if name in flags:
                value = value or (script_args[i + 1] if i + 1 < len(script_args) else "")
                if not value.isdigit():
                    raise PitstopError(f"{name} {value!r}: expected a positive integer")
                degrees[field] = int(value)
    if degrees:
        ParallelLayout(world_size, **degrees)  # raises LayoutError naming every factor


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
