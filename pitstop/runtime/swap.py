"""Swap process-group references inside live framework objects.

Megatron (and DeepSpeed) capture group objects when a model, its DDP wrapper or
its optimizer is built: ``pg_collection``, bucket groups, ``data_parallel_group``
attributes. After a delta rebuild those references must point at the new groups,
or the next step talks over a retired communicator. :func:`swap_groups` walks the
object graph from the given roots and replaces every reference it finds, in
attributes, lists, dicts and (rebuilt) tuples; :func:`find_groups` is the same
walk, reporting instead of replacing, so a test can prove nothing old is left.
Tensors are walked too, for their Python attributes only (DeepSpeed keeps a group on
every parameter).
"""

from __future__ import annotations

import logging
import threading
import types
from typing import Any, Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist

_SKIP = (
    str, bytes, int, float, bool, type(None), type, types.ModuleType,
    types.FunctionType, types.BuiltinFunctionType, logging.Logger, logging.Manager,
    type(threading.Lock()), threading.Thread,
)


def _walk(roots: Iterable[Any], visit) -> None:
    seen = set()
    stack: List[Any] = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, _SKIP) or isinstance(obj, dist.ProcessGroup) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k in list(obj.keys()):
                new = visit(obj[k])
                if new is not None:
                    obj[k] = new
                stack.append(obj[k])
            continue
        if isinstance(obj, list):
            for i, v in enumerate(obj):
                new = visit(v)
                if new is not None:
                    obj[i] = new
                stack.append(obj[i])
            continue
        if isinstance(obj, (tuple, set, frozenset)):
            stack.extend(obj)  # immutable containers are rebuilt by their owner's visit
            continue
        if callable(obj) and not hasattr(obj, "__dict__"):
            continue
        # a tensor is walked for its Python attributes only: DeepSpeed hangs groups on
        # parameters (``_dp_group`` in ZeRO-1/2, ``ds_process_group`` in ZeRO-3)
        d = obj.__dict__ if isinstance(obj, torch.Tensor) else getattr(obj, "__dict__", None)
        if d is None:
            continue
        for k, v in list(d.items()):
            new = visit(v)
            if new is not None:
                try:
                    setattr(obj, k, new)
                except (AttributeError, TypeError):  # frozen dataclass
                    object.__setattr__(obj, k, new)
            stack.append(getattr(obj, k))


def swap_groups(roots: Iterable[Any], mapping: Dict[int, dist.ProcessGroup]) -> int:
    """Replace every group ``g`` with ``id(g) in mapping`` reachable from ``roots``; returns how many."""
    count = 0

    def visit(v: Any):
        nonlocal count
        if isinstance(v, dist.ProcessGroup) and id(v) in mapping:
            count += 1
            return mapping[id(v)]
        if isinstance(v, tuple) and any(isinstance(x, dist.ProcessGroup) and id(x) in mapping for x in v):
            count += sum(1 for x in v if isinstance(x, dist.ProcessGroup) and id(x) in mapping)
            items = [mapping.get(id(x), x) if isinstance(x, dist.ProcessGroup) else x for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
        return None

    _walk(roots, visit)
    return count


def find_groups(roots: Iterable[Any], wanted: Dict[int, Any]) -> List[Tuple[str, str]]:
    """(holder type, group name) of every reference to a group with ``id`` in ``wanted``."""
    found: List[Tuple[str, str]] = []

    def visit(v: Any):
        vals = v if isinstance(v, tuple) else (v,)
        for x in vals:
            if isinstance(x, dist.ProcessGroup) and id(x) in wanted:
                found.append((type(v).__name__, getattr(x, "group_name", "?")))
        return None

    _walk(roots, visit)
    return found
