"""A role's state as bytes: the distributed-optimizer shard, the RNG streams, the parameters.

What a role owns that nobody else has is its distributed-optimizer shard (main
parameters and optimizer moments of its 1/dp slice) and its RNG streams. That is
what the buddy copy holds and what a leaver hands over. The full parameters are
shared by the data-parallel peers: after the shard is in place one parameter
all-gather (Megatron's own ``start_param_sync``) rebuilds them on every rank.

A :class:`Snapshot` is taken at every committed iteration boundary. It is at once
the rollback point of this rank and the payload sent to the buddy, so the buddy
copy costs one pack, not two.
"""

from __future__ import annotations

import base64
import json
import math
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from pitstop.errors import RecoveryError


def sub_optimizers(optimizer) -> List[Any]:
    """Megatron's optimizers in a fixed order (a ChainedOptimizer's parts, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _shard_items(optimizer) -> List[Tuple[str, torch.Tensor, Any, Optional[str]]]:
    """(name, tensor, torch-optimizer, state key) for every tensor of this rank's shard.

    The order is the optimizers' own param-group order, identical on every process
    that built the same role. ``state key`` None is the main parameter itself.
    """
    out = []
    for i, opt in enumerate(sub_optimizers(optimizer)):
        # a wrapper (Megatron's, DeepSpeed's ZeRO) holds the torch optimizer; DeepSpeed at
        # ZeRO 0 in fp32 hands back the torch optimizer itself
        inner = getattr(opt, "optimizer", opt)
        flats = getattr(opt, "fp32_partitioned_groups_flat", None)
        if flats is not None:
            # DeepSpeed ZeRO-3: the torch optimizer's param groups hold a sub-group's fp32
            # partition only while that sub-group steps (stage3.py ``_optimizer_step``); the
            # partitions themselves, and the moments keyed by them, are the shard
            for s, flat in enumerate(flats):
                out.append((f"o{i}.z{s}", flat.data, (inner, flat), None))
                for key in sorted(inner.state.get(flat, {})):
                    v = inner.state[flat][key]
                    if torch.is_tensor(v):
                        out.append((f"o{i}.z{s}.{key}", v, (inner, flat), key))
            continue
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                out.append((f"o{i}.g{g}.p{j}", p.data, inner, None))
                for key in sorted(inner.state.get(p, {})):
                    v = inner.state[p][key]
                    if torch.is_tensor(v):
                        out.append((f"o{i}.g{g}.p{j}.{key}", v, (inner, p), key))
    return out


def snapshot_nbytes(optimizer) -> int:
    """Bytes of this rank's :class:`Snapshot` as :func:`take` packs it now: its shard and its RNG
    header (less the framework's extra state and the reports, a few bytes): what a replacement
    copies to the role's joiner. ``pitstop emulate --fault`` costs the copy with it."""
    shard = sum(t.numel() * t.element_size() for _, t, _, _ in _shard_items(optimizer))
    return shard + len(json.dumps(encode_value(rng_state())).encode())


def _megatron_tracker():
    """Megatron's model-parallel RNG tracker, when the program uses Megatron (else None)."""
    import sys

    if "megatron.core" not in sys.modules:
        return None
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def rng_state() -> Dict[str, Any]:
    """Every RNG stream a training step may draw from (Megatron's tracker included when in use)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    tracker = _megatron_tracker()
    if tracker is not None:
        state["tracker"] = tracker.get_states()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "tracker" in state:
        _megatron_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class Snapshot:
    """This rank's own state after a committed step, in CPU memory."""

    step: int
    """The last step whose update this state includes."""
    layout: List[Tuple[str, Tuple[int, ...], str, Optional[str]]]
    """(name, shape, dtype, state key) per tensor, in pack order."""
    data: torch.Tensor
    """All shard tensors' bytes, concatenated (uint8, CPU)."""
    rng: bytes
    """:func:`rng_state` in the JSON wire form of :func:`encode_value` (never a pickle)."""
    world_seq: int = 0
    """The world group's operation counter, so a joiner stays in step with it."""

    @property
    def nbytes(self) -> int:
        return int(self.data.numel()) + len(self.rng)

    # ------------------------------------------------------------------ wire form
    def meta_bytes(self) -> bytes:
        return json.dumps({"step": self.step, "layout": [list(e) for e in self.layout],
                           "rng": self.rng.decode(), "world_seq": self.world_seq}).encode()

    @classmethod
    def from_wire(cls, meta: bytes, data: torch.Tensor) -> "Snapshot":
        """Parse and validate a peer's snapshot header: JSON of a fixed shape, whose layout
        must describe exactly ``data``'s bytes. Anything else is a :class:`RecoveryError`."""
        try:
            d = json.loads(bytes(meta).decode("utf-8"), parse_constant=_no_constant)
            step, layout, rng, seq = d["step"], d["layout"], d["rng"], d["world_seq"]
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise RecoveryError(f"snapshot header from a peer does not parse ({len(meta)} bytes): {exc}") from None
        if not (_is_nat(step) and _is_nat(seq) and isinstance(rng, str) and isinstance(layout, list)):
            raise RecoveryError(f"snapshot header: step={step!r}, world_seq={seq!r}: expected integers >= 0")
        entries, total = [], 0
        for e in layout:
            if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and isinstance(e[1], list)
                    and all(_is_nat(x) for x in e[1]) and e[2] in _DTYPES and (e[3] is None or isinstance(e[3], str))):
                raise RecoveryError(f"snapshot layout entry {str(e)[:120]}: expected [name, shape, dtype, key]")
            total += math.prod(e[1]) * _DTYPES[e[2]].itemsize
            entries.append((e[0], tuple(e[1]), e[2], e[3]))
        if total != data.numel():
            raise RecoveryError(f"snapshot layout describes {total} bytes, the peer sent {data.numel()}")
        return cls(step, entries, data, rng.encode(), seq)


def take(optimizer, step: int, world_seq: int = 0, out: Optional[torch.Tensor] = None,
         extra: Optional[Dict[str, Any]] = None, reports: Optional[list] = None) -> Snapshot:
    """Pack this rank's shard and RNG streams (into ``out`` when its size fits, to avoid allocating).

    ``extra``: small state of the training library (e.g. DeepSpeed's step counters), carried
    with the RNG streams in JSON form; :func:`restore` returns it.

    ``reports``: :func:`pitstop.runtime.reports.encode` of the steps this boundary makes final,
    with what the script gave for each. A joiner that takes this state over hands them back
    (:func:`pitstop.runtime.reports.of_snapshot`): the process it replaces may have died
    before it logged them."""
    return pack(optimizer, capture(step, world_seq, extra, reports), out)


@dataclass
class Capture:
    """What a boundary must read at once, before the next step draws random numbers: the RNG
    streams, the library's extra state, the reports. The shard itself is read by :func:`pack`,
    which may run later, in another thread, as long as the optimizer has not stepped since
    (:mod:`pitstop.runtime.pipeline` holds the next ``optimizer.step`` until it has)."""

    step: int
    world_seq: int
    rng: Dict[str, Any]
    reports: Optional[list] = None


def capture(step: int, world_seq: int = 0, extra: Optional[Dict[str, Any]] = None,
            reports: Optional[list] = None) -> Capture:
    rng = rng_state()
    if "tracker" in rng:  # the tracker's dict holds its live state tensors: keep this boundary's
        rng["tracker"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in rng["tracker"].items()}
    if extra:
        rng["extra"] = extra
    return Capture(step, world_seq, rng, reports)


def pack(optimizer, cap: Capture, out: Optional[torch.Tensor] = None) -> Snapshot:
    """The snapshot of :func:`capture`'s boundary: the shard's bytes (into ``out`` when its size
    fits) and the captured streams in their JSON wire form."""
    items = _shard_items(optimizer)
    layout = [(n, tuple(t.shape), str(t.dtype).replace("torch.", ""), key) for n, t, _, key in items]
    flats = [t.detach().reshape(-1).view(torch.uint8) for _, t, _, _ in items]
    total = sum(f.numel() for f in flats)
    if out is None or out.numel() != total:
        out = torch.empty(total, dtype=torch.uint8)
    if flats:
        torch.cat([f.cpu() for f in flats], out=out)
    enc = encode_value(cap.rng)
    if cap.reports:
        enc["reports"] = cap.reports
    return Snapshot(cap.step, layout, out, json.dumps(enc).encode(), cap.world_seq)


def restore(optimizer, snap: Snapshot) -> Dict[str, Any]:
    """Write ``snap`` into this rank's shard and RNG streams; returns its ``extra`` state.

    A joiner's optimizer has not stepped yet, so its moments do not exist: they are
    created from the snapshot's layout. Refuses a snapshot of another shape.
    """
    items = _shard_items(optimizer)
    by_name = {n: (t, owner, key) for n, t, owner, key in items}
    offset = 0
    for name, shape, dtype, key in snap.layout:
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        src = snap.data[offset: offset + n].view(dt).view(shape)
        offset += n
        if name in by_name:
            t, _, _ = by_name[name]
            if tuple(t.shape) != tuple(shape) or t.dtype != dt:
                raise RecoveryError(
                    f"state {name}: snapshot has {tuple(shape)} {dtype}, this role has "
                    f"{tuple(t.shape)} {t.dtype}: the joiner built a different model"
                )
            t.copy_(src)
            continue
        # a moment the joiner's optimizer has not created yet: o{i}.g{g}.p{j}.{key}
        base = name.rsplit(".", 1)[0]
        if key is None or base not in by_name:
            raise RecoveryError(f"state {name} of the snapshot has no counterpart in this role's optimizer")
        param, owner, _ = by_name[base]
        owner_opt, p = owner if isinstance(owner, tuple) else (owner, _param_of(owner, base))
        owner_opt.state.setdefault(p, {})[key] = src.clone().to(param.device)
    if offset != snap.data.numel():
        raise RecoveryError(f"snapshot holds {snap.data.numel()} bytes but its layout describes {offset}")
    rng = decode_rng(snap.rng)
    rng.pop("reports", None)
    extra = rng.pop("extra", {})
    set_rng_state(rng)
    return extra


# --------------------------------------------------------------------------- wire form without pickle
_DTYPES = {n: getattr(torch, n) for n in ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                                          "float32", "float64", "bool")}


def _is_nat(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def encode_value(v: Any) -> Any:
    """RNG states and small library state as JSON: tensors and arrays as typed base64,
    tuples kept apart from lists (``random.setstate`` wants tuples)."""
    if torch.is_tensor(v):
        t = v.detach().cpu().contiguous()
        return {"$t": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                "b64": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes()).decode()}
    if isinstance(v, np.ndarray):
        return {"$a": v.dtype.str, "shape": list(v.shape), "b64": base64.b64encode(np.ascontiguousarray(v).tobytes()).decode()}
    if isinstance(v, (tuple, list)) and all(type(x) is int for x in v):  # random.getstate()'s 625 words
        return {"$tuple": list(v)} if isinstance(v, tuple) else list(v)
    if isinstance(v, tuple):
        return {"$tuple": [encode_value(x) for x in v]}
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise RecoveryError(f"state dict with non-string keys {list(v)[:5]}: cannot cross the wire as JSON")
        return {k: encode_value(x) for k, x in v.items()}
    if isinstance(v, np.generic):
        return encode_value(v.item())
    if isinstance(v, float) and not math.isfinite(v):  # JSON has no NaN or Infinity; a diverged loss does
        return {"$f": repr(v)}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise RecoveryError(f"state of type {type(v).__name__} cannot cross the wire (JSON, tensors and arrays only)")


def decode_value(v: Any, depth: int = 0) -> Any:
    """The inverse of :func:`encode_value`, validating every typed blob's dtype and size."""
    if depth > 32:
        raise RecoveryError("state nested deeper than 32 levels")
    if isinstance(v, list):
        return [decode_value(x, depth + 1) for x in v]
    if not isinstance(v, dict):
        return v
    if "$tuple" in v:
        return tuple(decode_value(x, depth + 1) for x in v["$tuple"])
    if "$f" in v:
        if v["$f"] not in ("nan", "inf", "-inf") or len(v) != 1:
            raise RecoveryError(f"non-finite float {str(v)[:40]}: expected nan, inf or -inf")
        return float(v["$f"])
    if "$t" in v or "$a" in v:
        shape = v.get("shape")
        if not (isinstance(shape, list) and all(_is_nat(x) for x in shape) and isinstance(v.get("b64"), str)):
            raise RecoveryError(f"typed blob with shape {shape!r}: expected a list of sizes and base64 data")
        raw = base64.b64decode(v["b64"], validate=True)
        if "$t" in v:
            if v["$t"] not in _DTYPES:
                raise RecoveryError(f"tensor dtype {v['$t']!r}: expected one of {sorted(_DTYPES)}")
            dt = _DTYPES[v["$t"]]
            if len(raw) != math.prod(shape) * dt.itemsize:
                raise RecoveryError(f"tensor of shape {shape} {v['$t']}: {len(raw)} bytes")
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape).clone()
        dt = np.dtype(v["$a"]) if v["$a"] in ("<u4", "<i4", "<i8", "<u8", "<f8", "<f4", "|u1") else None
        if dt is None or len(raw) != math.prod(shape) * dt.itemsize:
            raise RecoveryError(f"array {v['$a']!r} of shape {shape}: {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    return {k: decode_value(x, depth + 1) for k, x in v.items()}


def decode_rng(raw: bytes) -> Dict[str, Any]:
    """A peer's RNG streams (and library extra state), validated: a :class:`RecoveryError` if not."""
    try:
        d = decode_value(json.loads(bytes(raw).decode("utf-8"), parse_constant=_no_constant))
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise RecoveryError(f"RNG state from a peer does not parse: {exc}") from None
    if not isinstance(d, dict) or not {"python", "numpy", "torch"} <= set(d):
        raise RecoveryError(f"RNG state from a peer lacks python/numpy/torch streams: {sorted(d) if isinstance(d, dict) else type(d)}")
    return d


def _param_of(inner, base: str) -> torch.Tensor:
    _, g, j = base.split(".")
    return inner.param_groups[int(g[1:])]["params"][int(j[1:])]


def resync_params(model: Sequence[Any], optimizer) -> None:
    """Rebuild the full parameters from every rank's shard: Megatron's own copy + all-gather."""
    for opt in sub_optimizers(optimizer):
        opt._copy_main_params_to_model_params()
    for chunk in model:
        chunk.start_param_sync(force_sync=True)


def param_buffers(model: Sequence[Any]) -> List[torch.Tensor]:
    """The contiguous parameter buffers of Megatron DDP, in a fixed order."""
    out = []
    for chunk in model:
        for buf in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            out.append(buf.param_data)
    return out


# ------------------------------------------------------------------ point to point
def send_snapshot(snap: Snapshot, dst: int, group, tag: int = 0) -> None:
    """Send ``snap`` to global rank ``dst`` of ``group`` (a registered group)."""
    meta = torch.frombuffer(bytearray(snap.meta_bytes()), dtype=torch.uint8)
    sizes = torch.tensor([meta.numel(), snap.data.numel()], dtype=torch.int64)
    dist.send(sizes, dst, group=group, tag=tag)
    dist.send(meta, dst, group=group, tag=tag)
    if snap.data.numel():
        dist.send(snap.data, dst, group=group, tag=tag)


def recv_snapshot(src: int, group, tag: int = 0) -> Snapshot:
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, src, group=group, tag=tag)
    meta = torch.empty(int(sizes[0]), dtype=torch.uint8)
    dist.recv(meta, src, group=group, tag=tag)
    data = torch.empty(int(sizes[1]), dtype=torch.uint8)
    if data.numel():
        dist.recv(data, src, group=group, tag=tag)
    return Snapshot.from_wire(bytes(meta.numpy()), data)


def pg_send(pg, tensor: torch.Tensor, dst: int) -> None:
    """Send on a raw (unregistered) process group, e.g. the leaver-joiner pair."""
    pg.send([tensor], dst, 0).wait()


def pg_recv(pg, tensor: torch.Tensor, src: int) -> None:
    pg.recv([tensor], src, 0).wait()


def send_snapshot_raw(pg, snap: Snapshot, dst: int) -> None:
    meta = torch.frombuffer(bytearray(snap.meta_bytes()), dtype=torch.uint8)
    pg_send(pg, torch.tensor([meta.numel(), snap.data.numel()], dtype=torch.int64), dst)
    pg_send(pg, meta, dst)
    if snap.data.numel():
        pg_send(pg, snap.data, dst)


def recv_snapshot_raw(pg, src: int) -> Snapshot:
    sizes = torch.empty(2, dtype=torch.int64)
    pg_recv(pg, sizes, src)
    meta = torch.empty(int(sizes[0]), dtype=torch.uint8)
    pg_recv(pg, meta, src)
    data = torch.empty(int(sizes[1]), dtype=torch.uint8)
    if data.numel():
        pg_recv(pg, data, src)
    return Snapshot.from_wire(bytes(meta.numpy()), data)
