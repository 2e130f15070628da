"""Measure alpha and beta of gloo over loopback, for the ``cpu-gloo-loopback`` topology.

Two processes (torch.multiprocessing, spawn) meet through a ``TCPStore(port=0)`` and
ping-pong messages of each size; half the *fastest* round trip is the one-way time
``alpha + bytes * beta`` (the host is shared: other load only ever adds time, so the
lower envelope is the reproducible part), and :func:`fit_alpha_beta` fits the line by least squares
on relative error (so the small messages, which carry alpha, are not drowned by the
big ones). Only this module of emulation uses torch.distributed.

Run it (and rewrite the shipped file)::

    python -m pitstop.emulation.calibrate --out pitstop/emulation/topologies/cpu-gloo-loopback.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from pitstop.emulation.topology import LinkClass
from pitstop.errors import EmulationError

DEFAULT_SIZES: Tuple[int, ...] = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
_KEY = "pitstop/calibration"


@dataclass(frozen=True)
class Calibration:
    """A fitted link: ``alpha_s`` seconds, ``bandwidth_bytes_per_s``, and the medians fitted."""

    alpha_s: float
    bandwidth_bytes_per_s: float
    samples: Dict[int, float]
    """Message size (bytes) -> fastest one-way time (seconds)."""


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], relative: bool = True) -> Tuple[float, float]:
    """Least-squares ``time = alpha + size * beta``; ``relative`` weights each point by
    ``1/time**2`` (minimises relative error). Returns ``(alpha, beta)``; alpha is
    clamped at 0."""
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise EmulationError(f"fit needs >= 2 distinct sizes with one time each, got {len(set(sizes))} sizes, "
                             f"{len(times)} times")
    if any(t <= 0 for t in times):
        raise EmulationError(f"fit needs positive times, got {list(times)}")
    w = [1.0 / (t * t) if relative else 1.0 for t in times]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, times)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, times))
    beta = sxy / sxx
    alpha = my - beta * mx
    if beta <= 0:
        raise EmulationError(f"fitted beta({beta}) <= 0: times do not grow with size ({dict(zip(sizes, times))})")
    return max(alpha, 0.0), beta


def fit_link(measured: Iterable[Sequence[Any]], name: str = "intra_node") -> LinkClass:
    """A link class from the collectives a fully real traced run measured.

    ``measured`` holds ``(op, group size, bytes, seconds)`` rows (the tracer's). Each
    collective's modelled cost is linear in alpha and beta, ``cost = a * alpha + b *
    beta`` (``a``, ``b`` from the cost model itself, so the fit and the replay agree on
    the algorithm). Per distinct ``(op, size, bytes)`` the *mean* time is kept: the
    replayed iteration adds these costs up, and a sum of operations is n times their
    mean, wait for a slightly late peer and the shared host's contention included
    (the fastest time, as the ping-pong calibration takes, made the replay 30 % short
    of a loaded real run). Then ``alpha`` and ``beta`` are fitted by least squares on
    relative error. Point-to-point rows are left out: a send is posted asynchronously
    and a recv's time is mostly the sender's compute.
    """
    from pitstop.emulation.topology import COLLECTIVES, collective_cost

    seen: Dict[Tuple[str, int, int], List[float]] = {}
    for op, n, nbytes, secs in measured:
        if op not in COLLECTIVES or op == "barrier" or n < 2 or secs <= 0:
            continue
        seen.setdefault((op, int(n), int(nbytes)), []).append(float(secs))
    best = {k: sum(v) / len(v) for k, v in seen.items()}
    if len(best) < 2:
        raise EmulationError(f"fitting a link needs >= 2 distinct collectives measured among real members, got {len(best)}")
    unit_a = LinkClass("a", 1.0, 1e300)
    unit_b = LinkClass("b", 0.0, 1.0)
    rows = [(collective_cost(op, n, b, unit_a), collective_cost(op, n, b, unit_b), t) for (op, n, b), t in best.items()]
    # minimise sum ((a*alpha + b*beta - t) / t)^2: 2x2 normal equations
    saa = sum((a / t) ** 2 for a, b, t in rows)
    sbb = sum((b / t) ** 2 for a, b, t in rows)
    sab = sum(a * b / t / t for a, b, t in rows)
    sat = sum(a / t for a, b, t in rows)
    sbt = sum(b / t for a, b, t in rows)
    det = saa * sbb - sab * sab
    if det <= 0:
        raise EmulationError(f"fitting a link: the {len(rows)} measured collectives do not separate latency from bandwidth")
    alpha = (sat * sbb - sbt * sab) / det
    beta = (saa * sbt - sab * sat) / det
    if alpha < 0:  # all latency-free: refit bandwidth alone
        alpha, beta = 0.0, sbt / sbb
    if beta <= 0:  # sizes too small to see bandwidth: refit latency alone
        alpha, beta = sat / saa, 1e-15
    return LinkClass(name, alpha, 1.0 / beta)


def _worker(rank: int, port: int, sizes: Sequence[int], repeats: int, warmup: int) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        out: Dict[int, float] = {}
        for size in sizes:
            buf = torch.zeros(size, dtype=torch.uint8)
            rtts: List[float] = []
            for k in range(warmup + repeats):
                if rank == 0:
                    t0 = time.perf_counter()
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                    if k >= warmup:
                        rtts.append(time.perf_counter() - t0)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
            if rank == 0:
                out[size] = min(rtts) / 2
        if rank == 0:
            store.set(_KEY, json.dumps(out))
    finally:
        dist.destroy_process_group()


def calibrate_gloo(sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 20, warmup: int = 3) -> Calibration:
    """Ping-pong two gloo processes over loopback and fit alpha/beta (see the module docstring)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    sizes = [int(s) for s in sizes]
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise EmulationError(f"sizes({sizes}) need >= 2 distinct values >= 1 byte")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    mp.spawn(_worker, args=(store.port, sizes, repeats, warmup), nprocs=2, join=True)
    samples = {int(k): v for k, v in json.loads(store.get(_KEY)).items()}
    alpha, beta = fit_alpha_beta(list(samples), list(samples.values()))
    return Calibration(alpha, 1.0 / beta, samples)


#: What ``pitstop calibrate`` measures per group size (``send``: one message, by ping-pong).
TABLE_OPS: Tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")
#: Its default message sizes: nccl-tests' doubling, coarser (every 4x), 4 KiB to 16 MiB.
TABLE_SIZES: Tuple[int, ...] = tuple(1 << k for k in range(12, 25, 2))
_TABLE_KEY = "pitstop/calibration/table"


def _table_worker(rank: int, n: int, port: int, ops: Sequence[str], sizes: Sequence[int], repeats: int,
                  warmup: int, pin: bool) -> None:
    """One rank of a calibration world of ``n``: every (op, size) ``warmup + repeats`` times.

    A collective's cost is what the replay adds once the last member has arrived: each
    repetition starts after a barrier, every rank stamps its own start and end with
    ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process of the host), and the
    cost is the last end minus the last start. ``send`` is half a ping-pong's round trip
    between ranks 0 and 1. Rank 0 keeps the *mean* over the repetitions: the replay adds
    these costs up, and a sum of n operations is n times their mean. The median is the
    wrong statistic for a sum here: on this shared host one operation takes either its
    transfer time or that plus a scheduler time slice (~3.5 ms, when the peer's thread waits
    for its core), and the median jumped between the two modes from one calibration to the
    next (4 KiB all_reduce, three calibrations in a row: 0.24, 3.67 and 3.35 ms), and the
    replayed TP2 step with it (0.091 s after one calibration, 0.194 s after another). The
    median, fastest and slowest are kept beside it (``stats``)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from pitstop.pg import destroy, new_comm

    if pin and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    # torch 2.13 renamed the tensor forms (the old names warn); the same gloo operations
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=120))
    try:
        out: Dict[str, Dict[int, float]] = {}
        stamp = torch.zeros(2, dtype=torch.float64)
        for op in ops:
            out[op] = {}
            for size in sizes:
                numel = max(1, size // 4)
                full = torch.zeros(numel, dtype=torch.float32)
                part = torch.zeros(max(1, numel // n), dtype=torch.float32)
                times: List[float] = []
                for k in range(warmup + repeats):
                    dist.barrier()
                    if op == "send":
                        t0 = time.perf_counter()
                        if rank == 0:
                            dist.send(full, 1)
                            dist.recv(full, 1)
                        elif rank == 1:
                            dist.recv(full, 0)
                            dist.send(full, 0)
                        t1 = time.perf_counter()
                        if rank == 0 and k >= warmup:
                            times.append((t1 - t0) / 2)
                        continue
                    t0 = time.perf_counter()
                    if op == "all_reduce":
                        dist.all_reduce(full)
                    elif op == "all_gather":  # ``size`` is the output buffer, as the cost model counts it
                        gather(full[: part.numel() * n], part)
                    elif op == "reduce_scatter":  # ``size`` is the input buffer
                        scatter(part, full[: part.numel() * n])
                    elif op == "broadcast":
                        dist.broadcast(full, 0)
                    t1 = time.perf_counter()
                    stamp[0], stamp[1] = t0, t1
                    dist.all_reduce(stamp, op=dist.ReduceOp.MAX)  # (last start, last end)
                    if k >= warmup:
                        times.append(float(stamp[1] - stamp[0]))
                if rank == 0:
                    out[op][size] = statistics.fmean(times)
                    out.setdefault("stats", {}).setdefault(op, {})[size] = {
                        "mean": statistics.fmean(times), "median": statistics.median(times),
                        "min": min(times), "max": max(times), "n": len(times)}
        # building one communicator, as a replacement's delta groups are built: pitstop's
        # new_comm (members only, a fresh store prefix each) over n ranks, and in every
        # world over 1 too (every rank its own, as a joiner's singleton groups)
        builds: Dict[int, List[float]] = {}
        for size in (1, n):
            for k in range(warmup + min(repeats, 10)):
                dist.barrier()
                t0 = time.perf_counter()
                ranks = [rank] if size == 1 else list(range(n))
                name = f"calibrate-build-{size}-{k}-{rank if size == 1 else 'all'}"
                g = new_comm(ranks, "gloo", dist.PrefixStore(f"pitstop/calibrate/{name}", store), name,
                             timedelta(seconds=120), "calibrate")
                t1 = time.perf_counter()
                stamp[0], stamp[1] = t0, t1
                dist.all_reduce(stamp, op=dist.ReduceOp.MAX)
                destroy(g)
                if k >= warmup:
                    builds.setdefault(size, []).append(float(stamp[1] - stamp[0]))
        if rank == 0:
            out["group_build"] = {size: statistics.median(ts) for size, ts in builds.items()}
            store.set(f"{_TABLE_KEY}/{n}", json.dumps(out))
    finally:
        dist.destroy_process_group()


def measure_tables(group_sizes: Sequence[int] = (2,), sizes: Sequence[int] = TABLE_SIZES,
                   ops: Sequence[str] = TABLE_OPS, repeats: int = 20, warmup: int = 3,
                   pin: bool = True, group_build: Optional[Dict[str, float]] = None,
                   send_fastest: Optional[Dict[int, float]] = None,
                   stats: Optional[Dict[str, Dict[str, Dict[int, Dict[str, float]]]]] = None
                   ) -> Dict[str, Dict[int, List[List[float]]]]:
    """Measure this machine's gloo costs per (operation, group size, bytes), nccl-tests style:
    real processes (torch.multiprocessing, spawn) meeting through a ``TCPStore(port=0)``, one
    world per group size. Returns the file form of a link's ``table``
    (:mod:`pitstop.emulation.topology`): ``{op: {group size: [[bytes, seconds], ...]}}``.
    ``group_build``, when given, is filled with the seconds one communicator took to build,
    per group size (the topology's ``group_build_s``: 1 and every size in ``group_sizes``);
    ``send_fastest`` with the fastest ``send`` per size (bytes -> seconds); ``stats`` with
    every entry's mean, median, fastest, slowest and count (``{op: {group size: {bytes: ...}}}``)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from pitstop.emulation.topology import TABLE_OPS as KNOWN

    sizes = sorted({int(x) for x in sizes})
    bad_ops = [o for o in ops if o not in KNOWN]
    if bad_ops:
        raise EmulationError(f"ops {bad_ops}: expected some of {', '.join(KNOWN)}")
    if len(sizes) < 2 or sizes[0] < 4:
        raise EmulationError(f"sizes({sizes}) need >= 2 distinct values >= 4 bytes")
    if not group_sizes or any(int(g) < 2 for g in group_sizes):
        raise EmulationError(f"group sizes({list(group_sizes)}) must each be >= 2")
    if repeats < 1 or warmup < 0:
        raise EmulationError(f"repeats({repeats}) must be >= 1 and warmup({warmup}) >= 0")
    table: Dict[str, Dict[int, List[List[float]]]] = {}
    builds: Dict[str, float] = {}
    for n in sorted({int(g) for g in group_sizes}):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
        mp.spawn(_table_worker, args=(n, store.port, list(ops), sizes, repeats, warmup, pin), nprocs=n, join=True)
        got = json.loads(store.get(f"{_TABLE_KEY}/{n}"))
        builds.update(got.pop("group_build", {}))
        for op, rows in got.pop("stats", {}).items():
            if stats is not None and not (op == "send" and n != 2):
                stats.setdefault(op, {})[str(n)] = {int(b): v for b, v in rows.items()}
            if op == "send" and n == 2 and send_fastest is not None:  # the fitted line's points
                send_fastest.update({int(b): v["min"] for b, v in rows.items()})
        for op, rows in got.items():
            if op == "send" and n != 2:
                continue  # one message is between two ranks whatever the world
            table.setdefault(op, {})[str(n)] = [[int(b), t] for b, t in sorted((int(b), t) for b, t in rows.items())]
    if group_build is not None:
        group_build.update({str(k): builds[k] for k in sorted(builds, key=int)})
    return table


def calibrate_topology(name: str = "cpu-gloo-calibrated", group_sizes: Sequence[int] = (2,),
                       sizes: Sequence[int] = TABLE_SIZES, repeats: int = 20, gpus_per_node: int = 8,
                       command: str = "pitstop calibrate",
                       stats: Optional[Dict[str, Dict[str, Dict[int, Dict[str, float]]]]] = None) -> Dict[str, Any]:
    """A topology file (its dict form) for this machine: the measured tables, and an alpha and
    a bandwidth fitted to the fastest ``send`` per size (used for what the tables lack). Every rank shares
    the host, so both link classes are the same loopback link and ``gpus_per_node`` is nominal.
    ``stats``, when given, is filled as :func:`measure_tables` fills it."""
    from pitstop.emulation.topology import from_dict

    builds: Dict[str, float] = {}
    fastest: Dict[int, float] = {}
    table = measure_tables(group_sizes, sizes, repeats=repeats, group_build=builds, send_fastest=fastest, stats=stats)
    # the line is fitted to the fastest send per size, not the mean the table keeps: other
    # load on the host only ever adds time, and a burst during the few repeats of one small
    # size made its median 15x the next size's (a clean clone's test, 3 repeats: 1.9 ms at
    # 4 KiB, 0.12 ms at 256 KiB), so the fit refused a line that falls with size
    points = sorted(fastest.items())
    alpha, beta = fit_alpha_beta([b for b, _ in points], [t for _, t in points])
    link = {"alpha_s": alpha, "bandwidth_bytes_per_s": 1.0 / beta, "table": table}
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data = {
        "name": name,
        "doc": ("gloo over 127.0.0.1, measured per (operation, group size, bytes) by pitstop calibrate: "
                f"mean of {repeats} repetitions after a barrier, from the last member's start to the last "
                "member's end; send is half a ping-pong. alpha_s and bandwidth_bytes_per_s are fitted to send's "
                "fastest repetition per size (other load only adds time). Every rank shares the host: intra_node and "
                "inter_node are the same link and gpus_per_node is nominal."),
        "calibrated": f"{when}; {_machine()}; {command}",
        "gpus_per_node": gpus_per_node,
        "intra_node": link,
        "inter_node": dict(link),
        "group_build_s": builds,
    }
    from_dict(json.loads(json.dumps(data)), source="pitstop calibrate")  # what it writes, it can read
    return data


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import torch

    load = ", load average %.1f" % os.getloadavg()[0] if hasattr(os, "getloadavg") else ""
    return f"{platform.node()}, {cpu}, {os.cpu_count()} CPUs{load}, torch {torch.__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write a topology JSON here (both link classes = loopback)")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    args = ap.parse_args(argv)
    cal = calibrate_gloo(args.sizes, args.repeats)
    print(json.dumps({"alpha_s": cal.alpha_s, "bandwidth_bytes_per_s": cal.bandwidth_bytes_per_s,
                      "one_way_s": cal.samples}, indent=1))
    if args.out:
        link = {"alpha_s": cal.alpha_s, "bandwidth_bytes_per_s": cal.bandwidth_bytes_per_s}
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        data = {
            "name": "cpu-gloo-loopback",
            "doc": ("gloo send/recv between two processes over 127.0.0.1; every rank shares the host, so "
                    "intra_node and inter_node are the same loopback link and gpus_per_node is nominal. "
                    "Fitted one-way time alpha + bytes/bandwidth (least squares on relative error, "
                    f"fastest of {args.repeats} ping-pongs per size, as the host is shared). "
                    "One-way times in seconds: "
                    + ", ".join(f"{s} B: {t:.3g}" for s, t in cal.samples.items())),
            "calibrated": f"{when}; {_machine()}; python -m pitstop.emulation.calibrate "
                          + " ".join(argv if argv is not None else sys.argv[1:]),
            "gpus_per_node": args.gpus_per_node,
            "intra_node": link,
            "inter_node": dict(link),
        }
        with open(args.out, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
