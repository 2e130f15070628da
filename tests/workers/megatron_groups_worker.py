"""Worker: Megatron's own initialize_model_parallel vs pitstop's drop-in, same process.

For each layout given as JSON in ``--layouts``, record every ``parallel_state``
answer under Megatron's init, destroy it, record them again under pitstop's init,
destroy that, and check the globals came back as before. Writes ``result_<rank>.json``.
"""

import argparse
import inspect
import json
import os
import sys

import torch.distributed as dist

import megatron.core.parallel_state as ps
from pitstop.integrations import megatron as pm

FLAGS = ("with_context_parallel", "partial_data_parallel", "partial_expert_data_parallel", "ignore_virtual")
SKIP = {"get_nccl_options", "get_global_memory_buffer", "get_global_symmetric_memory_buffer"}


def describe(x):
    if isinstance(x, dist.ProcessGroup):
        return {"group": dist.get_process_group_ranks(x)}
    if isinstance(x, (list, tuple)):
        return [describe(v) for v in x]
    if isinstance(x, dict):
        return {str(k): describe(v) for k, v in x.items()}
    if x is None or isinstance(x, (int, float, str, bool)):
        return x
    return type(x).__name__


def identity(x):
    if isinstance(x, (list, tuple)):
        return [identity(v) for v in x]
    if isinstance(x, dict):
        return {str(k): identity(v) for k, v in x.items()}
    return x if x is None or isinstance(x, (int, str, bool)) else f"{type(x).__name__}@{id(x)}"


from importlib.metadata import version as _version

from packaging.version import Version

ORDER_FREE_GROUP_LIST = Version(_version("megatron-core")) >= Version("0.19")


def answers():
    out = {}
    for name in sorted(dir(ps)):
        fn = getattr(ps, name)
        if name in SKIP or not callable(fn) or not (name.startswith(("get_", "is_")) or name == "model_parallel_is_initialized"):
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        required = [p for p in sig.parameters.values() if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if required:
            continue
        variants = [{}] + [{f: v} for f in FLAGS if f in sig.parameters for v in (True, False)]
        for kw in variants:
            key = f"{name}({','.join(f'{k}={v}' for k, v in kw.items())})"
            try:
                out[key] = describe(fn(**kw))
            except Exception as exc:  # the same error under both inits is part of the answer
                out[key] = f"error:{type(exc).__name__}"
    for name in pm.discover_globals(ps):
        out[f"global:{name}"] = describe(getattr(ps, name))
    if ORDER_FREE_GROUP_LIST:
        # megatron-core 0.19 creates its GTP weight-remat singletons and a separate EGTP-merged
        # tp-ep-pp group (the same members as tp-ep-pp) at places of its own in this list, the
        # list update_pg_timeout walks; pitstop's holds its groups in its own creation order.
        # The members must still match: compared as the set of member lists.
        out["global:_global_process_group_list"] = sorted(
            {json.dumps(g, sort_keys=True) for g in out["global:_global_process_group_list"]}, key=str)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed import distributed_c10d as c10d

    results = []
    for i, lay in enumerate(json.loads(a.layouts)):
        kw = dict(
            tensor_model_parallel_size=lay.get("tp", 1),
            pipeline_model_parallel_size=lay.get("pp", 1),
            context_parallel_size=lay.get("cp", 1),
            expert_model_parallel_size=lay.get("ep", 1),
            expert_tensor_parallel_size=lay.get("etp"),
            virtual_pipeline_model_parallel_size=lay.get("vpp"),
            order=lay.get("order", "tp-cp-ep-dp-pp"),
        )
        ps.initialize_model_parallel(**kw)
        meg = answers()
        ps.destroy_model_parallel()
        # identity of every global right before pitstop's install (Megatron's destroy
        # leaves some stale objects behind; restore must bring back exactly these)
        before = {n: identity(getattr(ps, n)) for n in pm.discover_globals(ps)}
        reg = pm.initialize_model_parallel(**kw, store=dist.PrefixStore(f"case{i}", c10d._get_default_store()))
        mine = answers()
        pm.destroy_model_parallel()
        after = {n: identity(getattr(ps, n)) for n in pm.discover_globals(ps)}
        results.append({"layout": lay, "megatron": meg, "pitstop": mine, "before": before, "after": after})
    with open(os.path.join(a.out, f"result_{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
