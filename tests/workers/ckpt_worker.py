"""Worker: train the world-8 GPT of examples/train_gpt.py, optionally saving or resuming a checkpoint.

    ckpt_worker.py --ckpt-dir D --out O [--stop-after N] [--save-at S] [--resume] <train_gpt args>

``--steps`` (a train_gpt argument) is the whole schedule; the data is always built for it, so a run
that resumes at step S sees exactly the batches an uninterrupted run sees from step S+1. Each rank
writes ``O/rank_<r>.json``: per-step loss (as float.hex, last stage only), final parameter checksum,
and save/load seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack to stderr
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop-after", type=int, default=None, help="last step to run (default: --steps)")
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="load the latest checkpoint first")
    p.add_argument("--sharding-type", default=None)
    p.add_argument("--fork-writers", action="store_true", help="Megatron's stock multi-process file writer")
    own, rest = p.parse_known_args()
    if os.environ.get("PITSTOP_CKPT_DEBUG"):
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("megatron.core.dist_checkpointing").setLevel(logging.DEBUG)

    tg = _import_train_gpt()
    args = tg.parse_args(rest)
    stop = own.stop_after or args.steps

    from pitstop.patches import megatron_cpu

    megatron_cpu.apply()

    import torch.distributed as dist

    from pitstop.runtime import checkpoint

    tg.init_distributed(args)
    tg.init_model_parallel(args)
    tg.set_seed(args.seed)
    model = tg.build_model(args)
    optimizer = tg.build_optimizer(args, model)
    tg.setup_model_config(model, optimizer)

    rank = dist.get_rank()
    rec: dict = {"rank": rank, "steps": {}}
    start = 0
    if own.resume:
        start = checkpoint.latest_step(own.ckpt_dir)
        if start is None:
            raise SystemExit(f"--resume: no checkpoint in {own.ckpt_dir}")

    # The data of the whole schedule (as an uninterrupted run builds it), entered at the
    # sample this run starts from. Built before the load, as in the uninterrupted run it is
    # built before step 1: making the loader's iterator draws from torch's default
    # generator, which on CPU is also the generator of dropout (Megatron's "CUDA" RNG).
    global_batch = tg.global_batch_size(args)
    dataset = tg.build_dataset(args, global_batch * args.steps)
    data = tg.build_data_iterator(args, start * global_batch, dataset)

    if own.resume:
        dist.barrier()
        t = time.perf_counter()
        checkpoint.load(own.ckpt_dir, model, optimizer, start)
        rec["load_s"] = time.perf_counter() - t
        rec["extra"] = checkpoint.read_meta(own.ckpt_dir, start)["extra"]

    for step in range(start + 1, stop + 1):
        out = tg.train_step(args, model, optimizer, data)
        if out["loss"] is not None:
            rec["steps"][step] = float.hex(out["loss"])
        if own.save_at == step:
            kw = {"sharding_type": own.sharding_type} if own.sharding_type else {}
            kw["fork_writers"] = own.fork_writers
            dist.barrier()
            t = time.perf_counter()
            checkpoint.save(own.ckpt_dir, step, model, optimizer,
                            extra={"consumed_samples": step * global_batch}, **kw)
            rec["save_s"] = time.perf_counter() - t

    rec["param_sha256"] = tg.param_checksum(model, optimizer)
    rec["last_step"] = stop
    Path(own.out).mkdir(parents=True, exist_ok=True)
    (Path(own.out) / f"rank_{rank}.json").write_text(json.dumps(rec))

    dist.barrier()
    tg.destroy_model_parallel(args)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
