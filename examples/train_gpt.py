"""A small but real Megatron-Core GPT pretraining run, on CPU with gloo (or on GPUs).

Launch it torchrun-style, e.g.::

    python -m torch.distributed.run --standalone --nproc-per-node 8 \
        examples/train_gpt.py --tp 2 --pp 2 --steps 5

It uses Megatron-Core's own pieces end to end: ``GPTModel`` built from the local layer spec,
``MockGPTDataset`` through ``BlendedMegatronDatasetBuilder``, Megatron
``DistributedDataParallel`` with the distributed optimizer, and the pipeline schedule from
``get_forward_backward_func()``. On a machine without CUDA the pitstop CPU shim
(:mod:`pitstop.patches.megatron_cpu`) is applied first.

Every step, the rank that is on the last pipeline stage with tensor- and data-parallel rank 0
prints one JSON line ``{"step", "loss", "loss_hex", "grad_norm", ...}``; ``--loss-file`` also
appends those lines to a file. The loss is averaged over the data-parallel group the way
Megatron-LM does it (sum of per-token losses over sum of tokens).

The functions are importable (``build_model``, ``build_optimizer``, ``build_data_iterator``,
``train_step``, ``main``) so other code can drive the same training loop.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import sys
import time
from functools import partial
from typing import Any, Iterator, Sequence

# Set thread counts before torch spins up its pools (each worker gets one core's worth).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import torch.distributed as dist

# Run from a checkout without installing pitstop.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


# --------------------------------------------------------------------------- arguments
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=2, help="per step and DP rank")
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=128, help="including the EOD token")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout (Megatron's default is 0.1; with dropout the "
                        "RNG tracker state becomes part of what a bitwise-identical run needs)")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations with fp32 main weights in the optimizer (Megatron-LM's "
                        "--bf16: Float16Module, gradients reduced in fp32)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-cache-path", default=None, metavar="DIR",
                   help="where the dataset's index files are saved and looked up (Megatron-LM's flag): the first "
                        "process builds them, every later one (a restart, a standby taking a role) loads them")
    p.add_argument("--loss-file", default=None, help="append the per-step JSON lines here")
    p.add_argument("--checksum", action="store_true", help="print a parameter checksum per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--track-memory", action="store_true",
                   help="count tensor memory from the start (pitstop.memory) and print its peak "
                        "with --checksum: what `pitstop emulate` reports for a real rank (the tracker collects garbage at boundaries)")
    p.add_argument("--manual-gc", action="store_true",
                   help="no automatic Python GC; collect at every iteration boundary (Megatron's --manual-gc): "
                        "when a reference cycle holding tensors is freed then depends on the program, not on "
                        "how many Python objects the surrounding code allocated, so peak memory is reproducible")
    p.add_argument("--pin-core", action="store_true",
                   help="pin this process to core LOCAL_RANK (mod the cores it may use): the ground truth "
                        "of `pitstop bench emulation` runs each rank on its own core with one thread")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (parameter names unchanged; see compile_model)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--pitstop", dest="groups", action="store_const", const="pitstop", default="pitstop",
                   help="pitstop owns every process group (default)")
    g.add_argument("--megatron-groups", dest="groups", action="store_const", const="megatron",
                   help="Megatron's own initialize_model_parallel on a gloo/NCCL world group, for comparison")
    from pitstop.integrations.megatron import add_pitstop_args

    add_pitstop_args(p)
    args = p.parse_args(argv)
    if args.num_layers % args.pp:
        p.error(f"--num-layers ({args.num_layers}) must be divisible by --pp ({args.pp})")
    if args.vocab_size % args.tp:
        p.error(f"--vocab-size ({args.vocab_size}) must be divisible by --tp ({args.tp})")
    return args


# ------------------------------------------------------------------ process groups
def init_distributed(args: argparse.Namespace) -> None:
    """Join the default (world) process group from torchrun's environment.

    With pitstop (the default) the world group is pitstop's store-backed one: rank
    and size without a mesh of connections, so a role can change hands later
    without a world-wide rebuild.
    """
    torch.set_num_threads(args.threads)
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.groups == "pitstop":
        from pitstop.integrations.megatron import init_distributed as join, runtime_config

        # a standby returns from here once it has a role; while it waits, pitstop runs
        # sandbox_iteration for each pipeline stage kind, so its first real step is warm
        join(runtime_config(args), warmup=partial(sandbox_iteration, args))
    else:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def init_model_parallel(args: argparse.Namespace) -> None:
    """The single place where the model-parallel groups are created."""
    if args.groups == "pitstop":
        from pitstop.integrations.megatron import initialize_model_parallel
        from pitstop.store import connect_from_env

        initialize_model_parallel(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            store=connect_from_env(),
        )
    else:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
        )


def destroy_model_parallel(args: argparse.Namespace) -> None:
    if args.groups == "pitstop":
        from pitstop.integrations.megatron import destroy_model_parallel as destroy
    else:
        from megatron.core.parallel_state import destroy_model_parallel as destroy
    destroy()


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and Megatron's model-parallel RNG tracker."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ---------------------------------------------------------------------------- model
def model_config(args: argparse.Namespace):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        bf16=args.bf16,
        use_cpu_initialization=True,
        hidden_dropout=args.dropout,
        attention_dropout=args.dropout,
        # The fused kernels (apex / TE) are absent on CPU.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )


def build_model(args: argparse.Namespace) -> list:
    """One GPT model chunk for this pipeline stage, wrapped in Megatron DDP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = model_config(args)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    if torch.cuda.is_available():  # built on CPU (use_cpu_initialization), as Megatron-LM does
        gpt.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=True,
    )
    if args.bf16:  # as Megatron-LM's get_model: the bf16 wrapper inside DDP
        from megatron.core.transformer.module import Float16Module

        gpt = Float16Module(config, gpt)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    if args.compile:
        n = compile_model([model])
        print(f"train_gpt: compiled {n} transformer layers (torch.compile, inductor)", file=sys.stderr, flush=True)
    return [model]


def compile_model(model: list) -> int:
    """``torch.compile`` every transformer layer, in place; returns how many.

    ``nn.Module.compile()`` keeps the module objects, parameter names and state-dict keys
    (checkpoints and pitstop's state hand-off depend on them), which wrapping in
    ``torch.compile(module)`` would not. Per layer rather than the whole GPT model: the
    layers are where the time goes, and compiling the whole model on CPU took 2-4x longer
    for no faster steady step (its resumed frame inside the layer loop also recompiles per
    layer and hits dynamo's recompile limit at 12 layers).

    Two dynamo settings remove the graph breaks Megatron's layer would otherwise cause:
    ``nested_graph_breaks`` makes the one break that stays resumable (attention forks the
    model-parallel RNG tracker, which calls ``torch.get_rng_state``, even at dropout 0), and
    ``warnings.warn`` (Megatron's deprecation warning for an implicit tp group) is ignored
    instead of breaking the graph. Without them a layer falls apart into 11 graphs and the
    steady step is twice as slow as eager. (Inductor's numerics are not eager's bit for bit.)
    A second model built in the same process reuses the compiled code (dynamo's in-memory
    cache with ``inline_inbuilt_nn_modules``), which is what a standby's sandboxed warmup
    relies on.

    Unless ``TORCHINDUCTOR_CACHE_DIR`` is set, each process compiles into a directory of its
    own (under the run directory), as it would on a machine of its own: one worker's on-disk
    cache must not make another process look warm.
    """
    import tempfile

    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        base = os.path.join(os.environ["PITSTOP_RUN_DIR"], "inductor") if "PITSTOP_RUN_DIR" in os.environ else None
        if base:
            os.makedirs(base, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"p{os.getpid()}-", dir=base)
    import warnings

    torch._dynamo.config.nested_graph_breaks = True
    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    n = 0
    for chunk in model:
        gpt = chunk.module
        gpt = getattr(gpt, "module", gpt)  # inside --bf16's Float16Module
        for layer in gpt.decoder.layers:
            layer.compile()
            n += 1
    return n


def build_optimizer(args: argparse.Namespace, model: list):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        weight_decay=args.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=args.clip_grad,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        bf16=args.bf16,
        use_distributed_optimizer=True,
    )
    return get_megatron_optimizer(config, model)


# ----------------------------------------------------------------------------- data
class DeterministicBatchSampler:
    """Megatron-LM's pretraining sampler, reduced: consecutive global batches, split by DP rank.

    Each "round" takes ``micro_batch_size * dp_size`` consecutive sample indices; DP rank ``r``
    gets the ``r``-th slice of ``micro_batch_size``. Starting at ``consumed_samples`` lets a
    restarted run continue where it stopped.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        round_size = self.micro_batch_size * self.dp_size
        start = self.dp_rank * self.micro_batch_size
        for base in range(self.consumed_samples, self.total_samples - round_size + 1, round_size):
            yield list(range(base + start, base + start + self.micro_batch_size))


def build_dataset(args: argparse.Namespace, num_samples: int):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    # NullTokenizer(n) has vocab n + 1: ids 0..n-1 plus EOD = n. Offline, no files.
    tokenizer = NullTokenizer(vocab_size=args.vocab_size - 1)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=tokenizer,
        mid_level_dataset_surplus=0.005,
        path_to_cache=args.data_cache_path,
    )  # no blend => mock=True
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    return train


def global_batch_size(args: argparse.Namespace) -> int:
    from megatron.core import parallel_state

    return args.micro_batch_size * args.num_microbatches * parallel_state.get_data_parallel_world_size()


def build_data_iterator(args: argparse.Namespace, consumed_samples: int = 0, dataset=None) -> Iterator[dict]:
    """Micro-batches for this rank's data-parallel slice, deterministic across runs.

    Pass ``dataset`` (from :func:`build_dataset`) to start over at another position
    without building the dataset again (no world barrier: what a rollback needs).
    """
    from megatron.core import parallel_state

    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    if dataset is None:
        dataset = build_dataset(args, global_batch_size(args) * args.steps + consumed_samples)
    sampler = DeterministicBatchSampler(
        len(dataset), consumed_samples, args.micro_batch_size, dp_rank, dp_size
    )
    # a private generator: making an iterator draws a seed, which must not move the global
    # RNG (dropout's) when a rollback or a restart makes a new one
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0,
                                         generator=torch.Generator().manual_seed(args.seed))
    return iter(loader)


# --------------------------------------------------------------------------- training
def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's GPT loss: (sum of masked token losses, #tokens, reporting)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": reporting}


def forward_step(data_iterator: Iterator[dict], model):
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output, partial(loss_func, batch["loss_mask"])


def setup_model_config(model: list, optimizer) -> None:
    """The schedule reads these hooks from the model's config, as in Megatron-LM."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads


def train_step(args: argparse.Namespace, model: list, optimizer, data_iterator) -> dict[str, Any]:
    """One optimizer step over ``args.num_microbatches`` micro-batches.

    Returns ``{"loss": float|None, "grad_norm": float, "update_successful": bool}``; the loss
    is only known on the last pipeline stage (None elsewhere).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()

    loss = None
    if parallel_state.is_pipeline_last_stage():
        # Sum (loss, tokens) over micro-batches, then over DP: one token-weighted mean.
        summed = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0)
        dist.all_reduce(
            summed, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        loss = (summed[0] / summed[1]).item()
    return {
        "loss": loss,
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "update_successful": bool(update_successful),
    }


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # bf16 too


def param_checksum(model: list, optimizer=None) -> str:
    """sha256 over this rank's parameters (names and exact bytes), in a fixed order, and with
    ``optimizer`` its shard too: the fp32 main weights and every Adam moment. With --bf16 the
    model's parameters are rounded copies of the main weights, so they alone could hide a
    difference below bf16's resolution."""
    h = hashlib.sha256()
    for chunk in model:
        for name, p in sorted(chunk.named_parameters(), key=lambda kv: kv[0]):
            h.update(name.encode())
            h.update(_bytes(p))
    for i, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else [])):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                h.update(f"o{i}.g{g}.p{j}".encode())
                h.update(_bytes(p))
                for key in sorted(inner.state.get(p, {})):
                    v = inner.state[p][key]
                    if torch.is_tensor(v):
                        h.update(key.encode())
                        h.update(_bytes(v))
    return h.hexdigest()


def dtypes(model: list, optimizer) -> dict:
    """The parameters' dtypes and the optimizer's main weights' (what --bf16 changes)."""
    main = {str(p.dtype) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for group in opt.optimizer.param_groups for p in group["params"]}
    return {"params": sorted({str(p.dtype) for chunk in model for p in chunk.parameters()}), "main": sorted(main)}


def _peak_tensor_bytes():
    from pitstop import memory

    return memory.peak_bytes()


def _rss_bytes() -> int:
    """Resident memory now (Linux), to compare a worker with a warmed standby."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def is_logging_rank() -> bool:
    from megatron.core import parallel_state

    return (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def main(argv: Sequence[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = parse_args(argv)

    from pitstop.patches import megatron_cpu

    we_applied = not megatron_cpu.is_applied() and megatron_cpu.apply()  # no-op with CUDA
    try:
        return _run(args, t0)
    finally:
        if we_applied:
            megatron_cpu.revert()


def setup(args: argparse.Namespace):
    """The start of a run: groups, seed, model, optimizer, data. Returns (model, optimizer, make_data)."""
    init_model_parallel(args)
    set_seed(args.seed)
    model = build_model(args)
    optimizer = build_optimizer(args, model)
    setup_model_config(model, optimizer)
    gbs = global_batch_size(args)
    dataset = build_dataset(args, gbs * args.steps)

    def make_data(step: int):  # the data position of a step: resume and rollback start here
        return build_data_iterator(args, gbs * (step - 1), dataset)

    return model, optimizer, make_data


def sandbox_iteration(args: argparse.Namespace) -> dict[str, Any]:
    """pitstop's warmup of a standby: this script's start and step 1, for the role the sandbox
    plays (its collectives are answered from a record of a real rank; nothing leaves the process)."""
    model, optimizer, make_data = setup(args)
    t = time.perf_counter()
    out = train_step(args, model, optimizer, make_data(1))
    out["iter_s"] = round(time.perf_counter() - t, 4)
    destroy_model_parallel(args)
    return out


def _run(args: argparse.Namespace, t0: float) -> int:
    if args.pin_core:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]})
    manual_gc = args.manual_gc
    if manual_gc:
        gc.disable()
    if args.track_memory:
        from pitstop import memory

        memory.start()
    init_distributed(args)
    model, optimizer, make_data = setup(args)

    if args.groups == "pitstop":
        from pitstop.integrations.megatron import session as pitstop_session

        session = pitstop_session(model, optimizer, make_data)
        steps, commit = session.steps(args.steps), session.commit
    else:
        session, data = None, make_data(1)
        steps, commit = range(1, args.steps + 1), (lambda step, out: [(step, out)])

    plain_iter_s: list[float] = []  # without pitstop: the loop body's time, as pitstop's session measures it
    for step in steps:
        ts = time.perf_counter()
        out = train_step(args, model, optimizer, session.data if session else data)
        out["generation"] = session.gen if session else 0
        if session is None:
            plain_iter_s.append(time.perf_counter() - ts)
        # pitstop's iteration boundary: the steps it made final, with their outputs (none when the
        # step was discarded, or is held until the next vote with --commit-interval > 1)
        final = commit(step, out)
        out["step_time_s"] = round(time.perf_counter() - ts, 4)
        if manual_gc:
            gc.collect()
        for done, o in final if is_logging_rank() else ():
            line = json.dumps({
                "step": done,
                "loss": o["loss"],
                "loss_hex": float.hex(o["loss"]),
                "grad_norm": o["grad_norm"],
                "step_time_s": o.get("step_time_s"),
                "generation": o["generation"],
                "pid": os.getpid(),
            })
            print(line, flush=True)
            if args.loss_file:  # appended per line: after a replacement another process logs
                with open(args.loss_file, "a") as f:
                    f.write(line + "\n")

    if args.checksum:
        import resource

        print(json.dumps({
            "rank": dist.get_rank(),
            "param_sha256": param_checksum(model, optimizer),
            "dtypes": dtypes(model, optimizer),
            "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_bytes": _rss_bytes(),
            "peak_tensor_bytes": _peak_tensor_bytes(),
            "hook_s": round(session.hook_s, 4) if session else 0.0,
            "buddy_s": round(session.buddy_s, 4) if session else 0.0,
            "background_cpu_s": round(session.background_cpu_s, 4) if session else 0.0,
            "buddy_bytes": session.buddy.nbytes if session and session.buddy else 0,
            "steps_committed": session.steps_committed if session else args.steps,
            # this process's first iteration against its median one: a joiner's warm-up cost
            "first_iter_s": round(session.iter_s[0], 4) if session and session.iter_s else None,
            "median_iter_s": round(sorted(session.iter_s[1:])[len(session.iter_s[1:]) // 2], 4)
            if session and len(session.iter_s) > 1 else None,
            "iter_s": [round(x, 6) for x in (session.iter_s if session else plain_iter_s)],
            "boundary_s": [[st, round(x, 6)] for st, x in session.boundary_s] if session else [],
        }), flush=True)
    if is_logging_rank():
        print(json.dumps({"done": True, "wall_s": round(time.perf_counter() - t0, 2)}), flush=True)

    dist.barrier()  # nobody tears down its communicators while a peer still uses them
    destroy_model_parallel(args)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: communicators retired after a failure may still hold an
    # operation on a dead peer in a worker thread, and joining those threads at exit aborts.
    os._exit(code)
