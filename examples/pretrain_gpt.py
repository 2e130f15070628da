"""A Megatron-LM ``pretrain_gpt.py``, as its users have it, with pitstop's one line.

Megatron-LM's own loop (``megatron.training.pretrain``, megatron-core 0.19) trains a GPT on
Megatron's mock data; every flag is Megatron-LM's. The only pitstop line is the import below:
it adds the ``--pitstop-*`` flags to Megatron-LM's parser and hooks pitstop's standby
replacement and drains into the loop (:mod:`pitstop.integrations.megatron_lm`). Without a
pitstop launcher (plain ``torchrun``) the script is plain Megatron-LM.

    pitstop launch --nproc-per-node 8 --standbys 1 -- examples/pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --use-distributed-optimizer --num-layers 2 --hidden-size 64 ... --mock-data

``--checksum`` (this script's own flag) prints each rank's parameter checksum at the end, for
the tests that compare a replacement with an uninterrupted run.
"""

from __future__ import annotations

import time

_PROGRAM_START = time.time()

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import weakref  # noqa: E402
from functools import partial  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import pitstop.integrations.megatron_lm  # noqa: E402,F401  (the one line: pitstop's flags and hooks)

import torch  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.utils import get_batch_on_this_tp_rank  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0, set_startup_timestamps  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import is_first_or_last_pipeline_stage  # noqa: E402

_BUILT: list = []
"""Weak references to the model chunks this process built (their parameters are DDP's buffers
once wrapped). Weak, because ``pretrain`` may build a model more than once in a process: a
pitstop standby runs the script's own ``pretrain`` in its warmup sandbox before it takes a role,
and that model must be freed, not hashed, afterwards."""


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    model = GPTModel(
        config=config if config is not None else core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    _BUILT.append(weakref.ref(model))
    return model


def get_batch(data_iterator, vp_stage=None):
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = get_batch_on_this_tp_rank(
        next(data_iterator) if tp_rank == 0 else {},
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"), batch["position_ids"]


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, getattr(model, "vp_stage", None))
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    print_rank_0("> building mock GPT datasets ...")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config
    ).build()


train_valid_test_datasets_provider.is_distributed = True


def add_example_args(parser):
    g = parser.add_argument_group("example")
    g.add_argument("--checksum", action="store_true",
                   help="print this rank's parameter checksum (sha256 of every parameter's bytes) at the end")
    return parser


def param_checksum() -> str:
    h = hashlib.sha256()
    for chunk in filter(None, (ref() for ref in _BUILT)):
        for name, p in sorted(chunk.named_parameters(), key=lambda kv: kv[0]):
            h.update(name.encode())
            h.update(p.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    args = parse_and_validate_args(extra_args_provider=add_example_args,
                                   args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    if args.checksum:
        print(json.dumps({"rank": torch.distributed.get_rank(), "param_sha256": param_checksum(),
                          "pid": os.getpid()}), flush=True)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as examples/train_gpt.py: no interpreter teardown of retired communicators
