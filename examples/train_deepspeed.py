"""A small GPT-like model trained with DeepSpeed ZeRO 0-3, on CPU with gloo (or on GPUs).

Launch it torchrun-style, e.g.::

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/train_deepspeed.py --zero-stage 2 --steps 5

It runs under any launcher that sets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` (``deepspeed.init_distributed`` reads them).

* **Model.** Token and position embeddings, ``--layers`` pre-norm transformer blocks written
  out by hand (``nn.Linear`` projections and ``scaled_dot_product_attention``, causal), a final
  LayerNorm and an untied LM head. Dropout is 0. Every parameter belongs to the module whose
  ``forward`` uses it, which ZeRO-3's gather hooks rely on (``nn.MultiheadAttention`` reads
  ``out_proj.weight`` without calling ``out_proj``).
* **Data.** Synthetic and deterministic: the batch of step ``s`` on data-parallel rank ``r`` is
  drawn from a generator seeded with ``(seed, s, r)`` only, so the data order is a pure function
  of ``(step, dp_rank)`` and a replacement rank, or a rerun, sees the same tokens. Each sequence is
  an arithmetic progression modulo the vocabulary (random start and stride), so the loss falls.
* **DeepSpeed.** ``deepspeed.initialize(model=, model_parameters=, config=dict)``, ZeRO stage
  from ``--zero-stage``, fp32 (``--bf16``: ``"bf16": {"enabled": true}``, bf16 parameters and
  activations, fp32 master weights and moments in the optimizer), ``Adam`` with
  ``"torch_adam": true`` (no fused CPU Adam build), gradient clipping 1.0. The config goes through
  :func:`pitstop.integrations.deepspeed_config.strip_section` (``--config FILE`` may carry a
  ``"pitstop"`` section; the validated section is left on ``engine.pitstop_section``).
* **Groups.** ``--mpu none`` (default) lets DeepSpeed clone the world for its data-parallel group;
  ``--mpu groups`` hands it a :class:`~pitstop.integrations.deepspeed_mpu.GroupsMpu` over groups
  built by a pitstop ``GroupRegistry``; ``--mpu pitstop`` / ``--mpu megatron`` fill Megatron's
  ``parallel_state`` (pitstop's drop-in or Megatron's own ``initialize_model_parallel``, ``--tp``)
  and hand it over as a :class:`~pitstop.integrations.deepspeed_mpu.MegatronMpu`. The model is
  replicated across tensor-parallel ranks, so every mode gives the same numbers.

Rank 0 prints one JSON line per step, ``{"step": s, "loss": ..., "loss_hex": ...}`` (the loss
averaged over the data-parallel group; ``json`` writes floats with ``repr``, which round-trips
exactly), and at the end ``{"checksum": ...}``: the SHA-256 of every full parameter's bytes in
``named_parameters`` order (ZeRO-3 gathers them with ``deepspeed.zero.GatheredParameters``).
With ``--checksum`` every rank also prints ``param_sha256``, the SHA-256 of its whole state
(:func:`state_checksum`: parameters, its optimizer partition's master weights and moments, the
loss scaler and step counters), and ``model_sha256``, the parameters' alone.

The pieces are importable so a runtime can drive the loop: :func:`setup` returns
``(engine, data_fn)``, ``data_fn(step)`` is this rank's batch of a step and
:func:`train_step` runs forward, backward and the optimizer step and returns the local loss.

On a machine without CUDA, DeepSpeed's CPU accelerator is selected (``DS_ACCELERATOR=cpu``)
and :mod:`pitstop.patches.deepspeed_cpu` keeps DeepSpeed from JIT-compiling its shared-memory
inference all-reduce (``deepspeed_shm_comm``, 40-100 s of g++ on two cores), which training
never uses; ``--shm-op build`` lets DeepSpeed build it (or load it from ``TORCH_EXTENSIONS_DIR``)
as upstream does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from functools import partial
from typing import Sequence, Tuple

# Set thread counts before torch spins up its pools (each worker gets one core's worth).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Must be set before deepspeed is imported: the accelerator is chosen at import.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Run from a checkout without installing pitstop.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


# --------------------------------------------------------------------------- arguments
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2,
                   help="ZeRO stage (3: partitioned parameters)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step and data-parallel rank")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--bf16", action="store_true",
                   help='bf16 parameters and activations ("bf16": {"enabled": true}); the ZeRO optimizer keeps '
                        "fp32 master weights and Adam moments of its partition")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--deepspeed_config", "--deepspeed-config", "--config", dest="config", default=None, metavar="JSON",
                   help="a DeepSpeed config file merged over the built-in one; its \"pitstop\" section "
                        "is validated and taken out before deepspeed.initialize (`pitstop launch` reads it too)")
    p.add_argument("--groups", choices=("pitstop", "deepspeed"), default="pitstop",
                   help="pitstop: pitstop.integrations.deepspeed.initialize owns the groups, and a session "
                        "drives the loop (standby replacement, drain); deepspeed: plain deepspeed.initialize")
    p.add_argument("--loss-file", default=None, help="append the per-step JSON lines here (any process that "
                                                         "plays rank 0 appends, a joiner included)")
    p.add_argument("--checksum", action="store_true",
                   help="print every rank's state checksum (parameters, optimizer partition, counters) at the end")
    p.add_argument("--track-memory", action="store_true",
                   help="count tensor memory from the start (pitstop.memory) and print its peak with "
                        "--checksum: what `pitstop emulate` reports for a real rank")
    p.add_argument("--step-delay", type=float, default=0.0, metavar="S",
                   help="sleep S seconds per step: a slower job, so a demo or test can drain it mid-run")
    p.add_argument("--shm-op", choices=("skip", "build"), default="skip",
                   help="CPU only: skip DeepSpeed's deepspeed_shm_comm JIT build (default) or let it build")
    p.add_argument("--mpu", choices=("none", "groups", "pitstop", "megatron"), default="none",
                   help="none: DeepSpeed clones the world for its data-parallel group; groups: a GroupsMpu over "
                        "pitstop-built groups; pitstop / megatron: a MegatronMpu over parallel_state, filled by "
                        "pitstop's drop-in or by Megatron's own initialize_model_parallel")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size of the mpu (the model is replicated across it, so the losses equal "
                        "the tp 1 run's)")
    args = p.parse_args(argv)
    if args.groups == "pitstop" and args.mpu != "none":
        p.error("--mpu is for --groups deepspeed (pitstop builds its own mpu)")
    if args.tp > 1 and args.mpu == "none" and args.groups == "deepspeed":
        p.error("--tp needs an --mpu")
    if args.hidden_size % args.heads:
        p.error(f"--hidden-size ({args.hidden_size}) must be divisible by --heads ({args.heads})")
    return args


# ---------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, no dropout."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def build_model(args: argparse.Namespace) -> TinyGPT:
    torch.manual_seed(args.seed)  # identical initial weights on every rank (DeepSpeed broadcasts anyway)
    return TinyGPT(args.vocab_size, args.seq_length, args.hidden_size, args.layers, args.heads)


# ----------------------------------------------------------------------------- data
def make_batch(args: argparse.Namespace, step: int, dp_rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) of ``step`` on data-parallel rank ``dp_rank``: a pure function of both."""
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 65_537 + dp_rank)
    start = torch.randint(0, args.vocab_size, (args.micro_batch, 1), generator=g)
    stride = torch.randint(1, 8, (args.micro_batch, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq_length + 1)) % args.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


# ------------------------------------------------------------------------ DeepSpeed
def ds_config(args: argparse.Namespace) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.config:
        with open(args.config) as f:
            _merge(config, json.load(f))
    return config


def _merge(base: dict, over: dict) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def build_mpu(args: argparse.Namespace):
    """The ``mpu`` handed to ``deepspeed.initialize`` (None: DeepSpeed makes its own groups)."""
    if args.mpu == "none":
        return None
    from pitstop.integrations.deepspeed_mpu import GroupsMpu, MegatronMpu

    if args.mpu == "groups":
        import torch.distributed as dist

        from pitstop.groups import GroupRegistry
        from pitstop.layout import ParallelLayout

        registry = GroupRegistry(ParallelLayout(dist.get_world_size(), tp=args.tp),
                                 dist.distributed_c10d._get_default_store())
        registry.build()
        return GroupsMpu(data_parallel=lambda: registry.group("dp"), tensor_parallel=lambda: registry.group("tp"))
    if args.mpu == "pitstop":
        from pitstop.integrations.megatron import initialize_model_parallel
    else:
        from megatron.core.parallel_state import initialize_model_parallel
    initialize_model_parallel(tensor_model_parallel_size=args.tp)
    return MegatronMpu()


def setup(args: argparse.Namespace):
    """Join the job, build model and engine. Returns ``(engine, data_fn)``; ``data_fn(step)`` is this
    rank's batch of ``step`` (1-based)."""
    torch.set_num_threads(args.threads)
    if args.groups == "pitstop":
        return _setup_pitstop(args)
    if not torch.cuda.is_available() and args.shm_op == "skip":
        from pitstop.patches import deepspeed_cpu

        deepspeed_cpu.apply()
    import deepspeed
    import deepspeed.comm as ds_dist

    from pitstop.integrations.deepspeed_config import strip_section

    config, section = strip_section(ds_config(args))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    mpu = build_mpu(args)
    model = build_model(args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    engine.pitstop_section = section
    dp_rank = ds_dist.get_rank(group=engine.data_parallel_group)
    device = engine.device

    def data_fn(step: int):
        return tuple(t.to(device) for t in make_batch(args, step, dp_rank))

    return engine, data_fn


def _setup_pitstop(args: argparse.Namespace):
    """pitstop's ``initialize``: the same call as ``deepspeed.initialize``, on pitstop's groups."""
    import torch.distributed as dist

    from pitstop.integrations import deepspeed as pitstop_ds

    model = build_model(args)
    # warmup=: what a standby runs in pitstop's sandbox while it waits for a role
    engine, _, _, _ = pitstop_ds.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args),
                                            tensor_parallel=args.tp, warmup=partial(sandbox_iteration, args))
    dp_rank = dist.get_rank(group=pitstop_ds.registry().group("dp"))
    device = engine.device

    def data_fn(step: int):
        return tuple(t.to(device) for t in make_batch(args, step, dp_rank))

    return engine, data_fn


def sandbox_iteration(args: argparse.Namespace) -> dict:
    """pitstop's warmup of a standby: this script's start and step 1 as rank 0 (the collectives are
    answered from rank 0's record of its first iteration; nothing leaves the process), then the
    engine is dropped. What stays warm is the process: DeepSpeed's lazy imports and op loaders,
    first-call code paths, the allocator."""
    engine, data_fn = _setup_pitstop(args)
    t = time.perf_counter()
    loss = dp_mean(engine, train_step(engine, data_fn(1)))
    out = {"loss": loss, "iter_s": round(time.perf_counter() - t, 4)}
    engine.destroy()
    return out


def train_step(engine, batch) -> torch.Tensor:
    """Forward, backward (gradient reduction inside), optimizer step. Returns the local loss."""
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()
    return loss.detach()


def dp_mean(engine, loss: torch.Tensor) -> float:
    """The loss averaged over the data-parallel group (one small all-reduce)."""
    import deepspeed.comm as ds_dist

    t = loss.detach().clone().float()
    ds_dist.all_reduce(t, group=engine.data_parallel_group)
    return float(t) / ds_dist.get_world_size(group=engine.data_parallel_group)


def checksum(engine) -> str:
    """SHA-256 over every full parameter, in ``named_parameters`` order (collective under ZeRO-3)."""
    import deepspeed

    named = list(engine.module.named_parameters())
    h = hashlib.sha256()
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None,
                                           enabled=engine.zero_optimization_stage() == 3):
        for name, p in named:
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_checksum(engine) -> str:
    """SHA-256 over this rank's whole training state: the full parameters (:func:`checksum`), then
    the optimizer's own tensors (the fp32 master weights of its ZeRO partition, or of the whole
    model at ZeRO 0, and every Adam moment and step), the loss scaler's and the engine's counters.
    Under ZeRO 1, 2 and 3 it differs between data-parallel ranks (each holds its own partition). With
    ``--bf16`` the parameters are rounded copies of the fp32 master weights, so they alone could
    hide a carry-over that is wrong below bf16's resolution."""
    h = hashlib.sha256(checksum(engine).encode())
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # ZeRO's or the fp16/bf16 wrapper's torch optimizer, or itself
    # ZeRO-3's torch optimizer holds a sub-group's fp32 partition in its param groups only while
    # that sub-group steps: its partitions are listed by the ZeRO optimizer itself
    flats = getattr(opt, "fp32_partitioned_groups_flat", None)
    masters = [(f"z{s}", p) for s, p in enumerate(flats)] if flats is not None else \
        [(f"g{g}.p{j}", p) for g, group in enumerate(inner.param_groups) for j, p in enumerate(group["params"])]
    for name, p in masters:
        h.update(name.encode())
        h.update(_bytes(p))
        for key in sorted(inner.state.get(p, {})):
            v = inner.state[p][key]
            if torch.is_tensor(v):
                h.update(key.encode())
                h.update(_bytes(v))
    for attr in ("loss_scaler", "loss_scale_config"):  # every plain field, not only those pitstop carries
        scaler = getattr(opt, attr, None)
        if scaler is not None:
            fields = {k: v for k, v in sorted(vars(scaler).items()) if v is None or isinstance(v, (bool, int, float))}
            h.update(f"{attr}={fields!r}".encode())
    # the counters DeepSpeed's own checkpoint keeps (micro_steps restarts at 0 after load_checkpoint)
    counters = {k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps")}
    h.update(repr(counters).encode())
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def dtypes(engine) -> dict:
    """The parameters' dtypes and the optimizer's master weights' (what ``--bf16`` changes)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3 (see state_checksum)
    masters = flats if flats is not None else [p for group in inner.param_groups for p in group["params"]]
    return {"params": sorted({str(p.dtype) for p in engine.module.parameters()}),
            "master": sorted({str(p.dtype) for p in masters})}


def _peak_tensor_bytes():
    from pitstop import memory

    return memory.peak_bytes()


def main(argv: Sequence[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = parse_args(argv)
    if args.track_memory:
        from pitstop import memory

        memory.start()
    engine, data_fn = setup(args)
    t_setup = time.perf_counter() - t0
    session = None
    if args.groups == "pitstop":
        from pitstop.integrations import deepspeed as pitstop_ds

        def make_data(step: int):  # the batches from ``step`` on: resume and rollback start here
            s = step
            while True:
                yield data_fn(s)
                s += 1

        session = pitstop_ds.session(engine, make_data)
        steps, commit, rank = session.steps(args.steps), session.commit, session.rank
    else:
        batches = (data_fn(s) for s in range(1, args.steps + 1))
        steps, commit, rank = (range(1, args.steps + 1), (lambda step, out: [(step, out)]),
                               int(os.environ.get("RANK", "0")))
    for step in steps:
        ts = time.perf_counter()
        loss = dp_mean(engine, train_step(engine, next(session.data) if session else next(batches)))
        if args.step_delay:
            time.sleep(args.step_delay)
        out = {"loss": loss, "generation": session.gen if session else 0}
        final = commit(step, out)  # pitstop's iteration boundary: the steps it made final ([] if discarded)
        out["step_time_s"] = round(time.perf_counter() - ts, 4)
        for done, o in final if rank == 0 else ():
            line = json.dumps({"step": done, "loss": o["loss"], "loss_hex": o["loss"].hex(),
                               "step_time_s": o.get("step_time_s"), "generation": o["generation"], "pid": os.getpid()})
            print(line, flush=True)
            if args.loss_file:
                with open(args.loss_file, "a") as f:
                    f.write(line + "\n")
    digest = checksum(engine)
    if args.checksum:
        from pitstop.runtime.sandbox import rss_bytes  # resident memory now, beside a warmed standby's

        print(json.dumps({"rank": rank, "param_sha256": state_checksum(engine), "model_sha256": digest,
                          "dtypes": dtypes(engine), "zero_stage": args.zero_stage,
                          "steps_committed": session.steps_committed if session else args.steps,
                          "stale_refs": len(session.stale_refs) if session else 0,
                          "hook_s": round(session.hook_s, 4) if session else 0.0,
                          "buddy_s": round(session.buddy_s, 4) if session else 0.0,
                          "buddy_bytes": session.buddy.nbytes if session and session.buddy else 0,
                          "peak_tensor_bytes": _peak_tensor_bytes(), "rss_bytes": rss_bytes()}), flush=True)
    if rank == 0:
        print(json.dumps({"checksum": digest, "zero_stage": args.zero_stage, "setup_s": round(t_setup, 2),
                          "total_s": round(time.perf_counter() - t0, 2)}), flush=True)
    import torch.distributed as dist

    dist.barrier()  # nobody tears down its communicators while a peer still uses them
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # as examples/train_gpt.py: communicators retired after a failure may still hold an
    # operation on a dead peer in a worker thread; the interpreter's teardown would join them
    os._exit(code)
