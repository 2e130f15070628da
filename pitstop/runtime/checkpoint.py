"""Checkpoint save and load with Megatron-Core's own ``dist_checkpointing``.

pitstop falls back to this when no standby is left, and the benchmark uses it as the
"checkpoint-restart as users do it today" baseline. It does what Megatron-LM's
``save_checkpoint``/``load_checkpoint`` do for the ``torch_dist`` format, and nothing
more: the ``sharded_state_dict()`` of each model chunk and
``optimizer.sharded_state_dict(model_sharded_state_dict)`` of the distributed
optimizer go through ``megatron.core.dist_checkpointing.save``/``load`` (torch DCP
underneath), on whatever groups are installed in ``parallel_state`` (pitstop's).

On disk::

    ckpt_dir/
      latest                  "3\\n": written last, by rank 0, by atomic rename
      iter_0000003/           renamed from iter_0000003.tmp once every rank has written
        metadata.json, common.pt, .metadata, __*.distcp    (dist_checkpointing / DCP)
        pitstop.json          step, layout, sharding type, ``extra`` (rank 0)
        rng/rank_00005.json   python, numpy, torch, CUDA and Megatron RNG-tracker states (as a snapshot's)

A checkpoint counts only once ``latest`` names it, so a save that dies half way never
shadows the previous one. ``save`` and ``load`` are collective over the world group;
dist_checkpointing's planning uses world ``gather_object`` and ``scatter_object_list``,
so the world group must implement ``gather`` and ``scatter``.

Gaps of megatron-core 0.16 bridged here (each where it is used):

* CUDA-only calls on the save/load path, and psutil, which the torch_dist writer needs
  but megatron-core does not declare (:func:`_compat_patches`, applied only around a call);
* with torch's Adam (no Apex/TE): a distributed optimizer that never stepped cannot build
  its loading state dict (:func:`_init_optimizer_state`), and ``dp_reshardable`` loads
  Adam's ``step`` as the loading process's own (:func:`_restore_torch_adam_step`);
* with fp32 params its ``dp_reshardable`` loader copies into leaf views outside
  ``no_grad`` (wrapped in :func:`load`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import queue
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from pitstop.errors import (  # noqa: F401 - re-exported: pitstop.runtime.checkpoint.CheckpointError
    CheckpointError, CheckpointMismatchError, CheckpointNotFoundError, PitstopError)
from pitstop.runtime.state import decode_rng, encode_value, rng_state, set_rng_state

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "save",
    "load",
    "latest_step",
    "read_meta",
    "iter_dir",
    "DEFAULT_SHARDING_TYPE",
]

log = logging.getLogger(__name__)

#: What Megatron-LM writes by default for the distributed optimizer with ``torch_dist``:
#: each rank saves its own DP shard of the optimizer buckets, no gather; reshardable in DP
#: only. ``"fully_reshardable"`` (gathered on DP rank 0, reshardable in TP/PP too) needs
#: CUDA in 0.16 (``.cuda()`` in ``get_parameter_state_dp_zero``); 0.16 itself refuses
#: ``"fully_sharded_model_space"`` ("ShardedTensor.flattened_range is not supported").
DEFAULT_SHARDING_TYPE = "dp_reshardable"
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable")

LATEST = "latest"
META = "pitstop.json"
FORMAT_VERSION = 1


# ------------------------------------------------------------------------ paths
def iter_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    """Where step ``step`` lives, as Megatron-LM names it."""
    return Path(ckpt_dir) / f"iter_{step:07d}"


def latest_step(ckpt_dir: str | os.PathLike, marker_name: str = LATEST) -> Optional[int]:
    """The step of the last completed save, or None if ``ckpt_dir`` has none. ``marker_name``:
    the file holding it (pitstop's ``latest``; Megatron-LM's ``latest_checkpointed_iteration.txt``)."""
    marker = Path(ckpt_dir) / marker_name
    try:
        text = marker.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint marker {marker}: {exc}") from exc
    try:
        return int(text.strip())
    except ValueError:
        raise CheckpointError(
            f"checkpoint marker {marker} holds {text.strip()[:40]!r}, expected a step number"
        ) from None


def read_meta(ckpt_dir: str | os.PathLike, step: Optional[int] = None) -> dict:
    """pitstop's record of a checkpoint: step, layout, sharding type and the caller's ``extra``."""
    step = _resolve_step(ckpt_dir, step)
    path = iter_dir(ckpt_dir, step) / META
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"checkpoint {iter_dir(ckpt_dir, step)} has no {META}: not written by "
            "pitstop.runtime.checkpoint.save, or incomplete"
        ) from None


def _resolve_step(ckpt_dir: str | os.PathLike, step: Optional[int]) -> int:
    if step is not None:
        return int(step)
    found = latest_step(ckpt_dir)
    if found is None:
        raise CheckpointNotFoundError(
            f"no checkpoint in {ckpt_dir}: expected the marker {Path(ckpt_dir) / LATEST} that a "
            "completed save writes last"
        )
    return found


# ---------------------------------------------------- compatibility shim (CPU, psutil)
def _rss_bytes() -> int:
    """Resident set size from /proc, for dist_checkpointing's write-process memory log line."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` without the processes.

    Same arguments, same per-file writer (``write_preloaded_data``, with fsync), same
    result format; the files are written one after the other by this process.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: dict = {}
    local: "queue.Queue" = queue.Queue()
    for i, bucket in enumerate(write_buckets):
        local.put(i)  # the count token write_preloaded_data takes back when done
        kwargs = {"use_msc": use_msc} if use_msc else {}
        FileSystemWriterAsync.write_preloaded_data(
            transform_list, i, bucket, local, local, use_fsync=True, **kwargs
        )
        idx, out = local.get_nowait()
        if isinstance(out, Exception):
            global_results_queue.put(out)
            return
        results[idx] = out
    global_results_queue.put(results)


def _compat_patches(in_process_writes: bool):
    """What dist_checkpointing needs that this machine lacks, redirected like pitstop.patches.megatron_cpu.

    * Without CUDA: three ``torch.cuda`` calls on the save/load path.
    * Without psutil: the torch_dist file writer calls ``_process_memory()`` (psutil) for a
      debug log line; in a forked writer that raises there, the parent waits forever.
      It gets the RSS from /proc instead.
    * ``in_process_writes``: the torch_dist writer forks one process per file and
      collects their results through a spawn-started ``multiprocessing`` Manager, one
      per rank, which imports torch the first time it unpickles a result (about 25 s of
      the first save at world 8 on a 2-core host). These write the same files from this
      process instead.

    Kept here until they join ``megatron_cpu.PATCHES``; applied only around a save/load.
    """
    from pitstop.patches._base import Patch, PatchSet
    from pitstop.patches.megatron_cpu import REQUIRES, _torch_patch

    mc = "megatron.core"
    fs_async = f"{mc}.dist_checkpointing.strategies.filesystem_async"
    patches = []
    if not torch.cuda.is_available():
        patches += [
            # save_state_dict_async_finalize: failure flag on torch.cuda.current_device().
            _torch_patch(
                f"{mc}.dist_checkpointing.strategies.state_dict_saver", "state_dict_saver",
                cuda=("current_device",), factories=("tensor",),
                source_contains=("device=torch.cuda.current_device()",),
            ),
            # FileSystemWriterAsync.preload_tensors(non_blocking=True) ends in torch.cuda.synchronize().
            _torch_patch(
                fs_async, "filesystem_async", cuda=("synchronize",),
                source_contains=("torch.cuda.synchronize()",),
            ),
            # DistributedOptimizer.state_dict() allocates dummy Adam state on current_device()
            # when there is none yet (loading before the first step).
            _torch_patch(
                f"{mc}.optimizer.distrib_optimizer", "distrib_optimizer",
                cuda=("current_device",),
                source_contains=("device=torch.cuda.current_device()",),
            ),
        ]
    if not importlib.import_module(fs_async).HAVE_PSUTIL:
        patches.append(Patch(
            name="checkpoint_compat.filesystem_async._process_memory",
            module=fs_async,
            attr="_process_memory",
            replacement=lambda original: _rss_bytes,
            params=(),
            requires=REQUIRES,
            source_contains=("psutil.Process(os.getpid())",),
        ))
    if in_process_writes:
        patches += [
            Patch(
                name="checkpoint_compat.filesystem_async._get_write_results_queue",
                module=fs_async,
                attr="_get_write_results_queue",
                replacement=lambda original: queue.Queue,
                params=(),
                requires=REQUIRES,
                source_contains=('ctx = mp.get_context("spawn")',),
            ),
            Patch(
                name="checkpoint_compat.FileSystemWriterAsync.write_preloaded_data_multiproc",
                module=fs_async,
                attr="FileSystemWriterAsync.write_preloaded_data_multiproc",
                replacement=lambda original: _write_in_process,
                params=("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue"),
                requires=REQUIRES,
                source_contains=("count_queue.put(i)", '"use_fsync": True'),
            ),
        ]
    return PatchSet(f"checkpoint_compat{'_inproc' if in_process_writes else ''}", patches)


_COMPAT: dict = {}


@contextlib.contextmanager
def _compat(in_process_writes: bool = True) -> Iterator[None]:
    """Apply :func:`_compat_patches` for the duration of one save or load."""
    if in_process_writes not in _COMPAT:
        _COMPAT[in_process_writes] = _compat_patches(in_process_writes)
    patches = _COMPAT[in_process_writes]
    if any(p.applied for p in _COMPAT.values()) or not patches.patches:  # re-entered / nothing to do
        yield
        return
    patches.apply()
    try:
        yield
    finally:
        patches.revert()


# ------------------------------------------------------------------ state dicts
def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
    }


def _sharded_state_dict(model: list, optimizer, metadata: dict, is_loading: bool) -> dict:
    """{"model"[i]: chunk sharded state dict, "optimizer": ...} as Megatron-LM builds it."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    # Unwrapped (no DDP "module." prefix): the keys Megatron-LM checkpoints use.
    model = unwrap_model(list(model))
    sd: dict[str, Any] = {}
    if len(model) == 1:
        sd["model"] = model[0].sharded_state_dict(metadata=metadata)
    else:  # virtual pipeline: each chunk's offsets depend on the vpp rank set while building
        for i, chunk in enumerate(model):
            ps.set_virtual_pipeline_model_parallel_rank(i)
            sd[f"model{i}"] = chunk.sharded_state_dict(metadata=metadata)
        ps.set_virtual_pipeline_model_parallel_rank(0)
    if optimizer is not None:
        if is_loading:
            _init_optimizer_state(optimizer)
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
    return sd


def _init_optimizer_state(optimizer) -> None:
    """Give an optimizer that never stepped the state its first step would create.

    Megatron 0.16's ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` reads the
    inner optimizer's state, and with torch's Adam (no Apex/TE) asserts one ``step`` in
    it, which torch only creates on the first step: loading into a fresh process fails
    with a bare ``AssertionError``. This runs Megatron's own ``init_state_fn`` (zeroed
    moments) and adds torch's ``step`` (0); the load then overwrites all of it.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        init = getattr(opt, "init_state_fn", None)
        if inner is None or init is None or len(inner.state) > 0:
            continue
        init(inner, opt.config)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _restore_torch_adam_step(optimizer) -> None:
    """Put the checkpoint's step back into torch Adam's per-parameter ``step``, one tensor each.

    With torch's Adam (no Apex/TE) Megatron 0.16 keeps the step in each parameter's
    state and in the saved ``param_groups``. Its ``dp_reshardable`` loader first sets
    one shared ``step`` tensor from ``param_groups`` for every parameter, then copies
    the *pre-load* step (a ``LocalNonpersistentObject``) over it: a resumed run
    would restart Adam's bias correction at the loading process's step (0 in a fresh
    one), and a shared tensor would be incremented once per parameter per step.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                st = inner.state.get(p)
                if st and "step" in st:
                    old = st["step"]
                    st["step"] = torch.tensor(float(group["step"]), dtype=old.dtype, device=old.device)


def _write_rng(path: Path) -> None:
    """This rank's RNG streams, captured as a snapshot captures them (:func:`state.rng_state`,
    Megatron's tracker included) and written in the same JSON form, never a pickle."""
    path.write_text(json.dumps(encode_value(rng_state())))


def _read_rng(ckpt: Path, rank: int) -> None:
    """Restore what :func:`_write_rng` wrote; a checkpoint from before that format (a pickled
    ``rank_NNNNN.pt`` that pitstop itself wrote) is still read, so no old run is stranded."""
    new = _rng_file(ckpt, rank)
    if new.exists():
        set_rng_state(decode_rng(new.read_bytes()))
        return
    legacy = new.with_suffix(".pt")
    if not legacy.exists():
        raise CheckpointError(f"checkpoint {ckpt}: no RNG state for rank {rank} ({new.name} or {legacy.name})")
    log.warning("checkpoint %s: RNG state in the old pickled form (%s), read once more", ckpt, legacy.name)
    old = torch.load(legacy, weights_only=False)
    set_rng_state({"python": old["random"], "numpy": old["numpy"], "torch": old["torch"], "tracker": old["tracker"],
                   **({"cuda": old["cuda"]} if old.get("cuda") is not None else {})})


def _rng_file(path: Path, rank: int) -> Path:
    return path / "rng" / f"rank_{rank:05d}.json"


def _fsync_write(path: Path, data: str) -> None:
    with open(path, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_world_group(where: Path) -> None:
    """Refuse, on every rank alike, a world group that cannot run dist_checkpointing's planning.

    torch DCP plans a save or load with ``gather_object`` and ``scatter_object_list`` on
    the default group (Megatron passes no group), i.e. with ``gather`` and ``scatter``;
    a Python world group without them fails deep inside with "No backend type
    associated with device type cpu".
    """
    world = c10d._get_default_group()
    cls = type(world)
    missing = [m for m in ("gather", "scatter") if getattr(cls, m) is getattr(dist.ProcessGroup, m)]
    if cls is not dist.ProcessGroup and missing:
        raise CheckpointError(
            f"{where}: the world group {cls.__module__}.{cls.__qualname__} lacks "
            f"{' and '.join(missing)}, which dist_checkpointing's planning needs "
            "(torch DCP gather_object / scatter_object_list on the default group)"
        )


def _agree(ok: bool, what: str) -> None:
    """Raise on every rank if any rank failed ``what`` (so nobody hangs in the next collective)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag)
    if flag.item() and ok:
        raise CheckpointError(f"{what} failed on {flag.item()} other rank(s); see their logs")


# ------------------------------------------------------------------------- save
def save(
    ckpt_dir: str | os.PathLike,
    step: int,
    model: list,
    optimizer,
    *,
    extra: Optional[dict] = None,
    sharding_type: str = DEFAULT_SHARDING_TYPE,
    fork_writers: bool = False,
) -> Path:
    """Save model chunks, distributed optimizer and RNG states as step ``step``; collective.

    Writes ``iter_{step:07d}.tmp``, renames it to ``iter_{step:07d}`` and then points
    ``latest`` at it, each only after every rank has finished the previous part, so an
    interrupted save leaves the last good checkpoint in place. ``extra`` (JSON-serialisable,
    the same on every rank) is kept in ``pitstop.json``; read it back with :func:`read_meta`.
    ``fork_writers=True`` keeps Megatron's stock file writer (a forked process per file,
    results through a spawn-started Manager process per rank), exactly as Megatron-LM
    saves; the default writes the same files from this process (see :func:`_compat_patches`).
    Returns the checkpoint's directory.
    """
    from megatron.core import dist_checkpointing

    if sharding_type not in SHARDING_TYPES:
        raise CheckpointError(f"save to {ckpt_dir}: sharding_type {sharding_type!r} is not one of {SHARDING_TYPES}")
    if sharding_type == "fully_reshardable" and not torch.cuda.is_available():
        raise CheckpointError(f"save to {ckpt_dir}: sharding_type 'fully_reshardable' needs CUDA in "
                              "megatron-core 0.16; use 'dp_reshardable' on CPU")
    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank()
    final = iter_dir(ckpt_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    _check_world_group(final)
    meta = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "layout": _layout(),
        "sharding_type": sharding_type,
        "megatron_core": _megatron_version(),
        "extra": extra or {},
    }
    try:
        json.dumps(meta)
    except TypeError as exc:
        raise CheckpointError(f"save to {final}: extra must be JSON-serialisable ({exc})") from None

    err: Optional[BaseException] = None
    if rank == 0:
        try:
            if tmp.exists():  # left by a save that died
                shutil.rmtree(tmp)
            (tmp / "rng").mkdir(parents=True)
        except OSError as exc:
            err = exc
    _agree(err is None, f"creating {tmp}")
    if err is not None:
        raise CheckpointError(f"cannot create checkpoint directory {tmp}: {err}") from err
    dist.barrier()  # the directory exists before anyone writes into it

    metadata = {"distrib_optim_sharding_type": sharding_type, "chained_optim_avoid_prefix": True}
    _write_rng(_rng_file(tmp, rank))
    t1 = time.perf_counter()
    with _compat(in_process_writes=not fork_writers):
        sd = _sharded_state_dict(model, optimizer, metadata, is_loading=False)
        t2 = time.perf_counter()
        # Ends with a world barrier after rank 0 wrote metadata.json: every rank is done.
        dist_checkpointing.save(sd, str(tmp), content_metadata=metadata)
    t3 = time.perf_counter()

    if rank == 0:
        try:
            _fsync_write(tmp / META, json.dumps(meta, indent=1) + "\n")
            if final.exists():  # re-saving a step: keep the old one until the new one is in place
                old = final.with_name(final.name + ".old")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
            marker_tmp = ckpt_dir / f".{LATEST}.tmp"
            _fsync_write(marker_tmp, f"{step}\n")
            os.replace(marker_tmp, ckpt_dir / LATEST)
            _fsync_dir(ckpt_dir)
        except OSError as exc:
            err = exc
    _agree(err is None, f"committing {final}")
    if err is not None:
        raise CheckpointError(f"cannot commit checkpoint {final}: {err}") from err
    log.info("saved %s in %.2fs (prepare %.2fs, state dicts %.2fs, dist_checkpointing.save %.2fs, "
             "commit %.2fs)", final, time.perf_counter() - t0, t1 - t0, t2 - t1, t3 - t2,
             time.perf_counter() - t3)
    return final


# ------------------------------------------------------------------------- load
def load(
    ckpt_dir: str | os.PathLike,
    model: list,
    optimizer,
    step: Optional[int] = None,
    *,
    rng: bool = True,
) -> int:
    """Load step ``step`` (default: the latest) into the existing model and optimizer; collective.

    The model and optimizer must be built as for the run that saved (same layout; the
    ``dp_reshardable`` format reshards DP only). RNG states are restored when the
    saving job had the same layout (one file per rank), which makes the resumed run
    bitwise identical to one that never stopped. Returns the step loaded.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    t0 = time.perf_counter()
    step = _resolve_step(ckpt_dir, step)
    path = iter_dir(ckpt_dir, step)
    if not (path / "metadata.json").is_file():
        raise CheckpointNotFoundError(
            f"checkpoint {path} is missing or incomplete: expected {path / 'metadata.json'} "
            "(dist_checkpointing writes it last)"
        )
    meta = read_meta(ckpt_dir, step)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"checkpoint {path} has pitstop format {meta.get('format')!r}, expected {FORMAT_VERSION}"
        )
    _check_world_group(path)
    saved, now = meta["layout"], _layout()
    sharding_type = meta["sharding_type"]
    same_layout = saved == now
    if sharding_type == "dp_reshardable" and any(saved[k] != now[k] for k in ("tp", "pp", "cp", "vpp")):
        raise CheckpointMismatchError(
            f"checkpoint {path} was saved with layout {saved} in the {sharding_type!r} format, "
            f"which reshards data-parallel only; this job is {now}"
        )

    metadata = {"distrib_optim_sharding_type": sharding_type, "chained_optim_avoid_prefix": True}
    with _compat():
        sd = _sharded_state_dict(model, optimizer, metadata, is_loading=True)
        try:
            state = dist_checkpointing.load(sd, str(path))
        except Exception as exc:  # noqa: BLE001 - DCP wraps per-rank failures in its own type
            raise CheckpointError(f"loading {path} failed on rank {dist.get_rank()}: {exc}") from exc
        chunks = unwrap_model(list(model))
        if len(chunks) == 1:
            chunks[0].load_state_dict(state["model"], strict=True)
        else:
            for i, chunk in enumerate(chunks):
                chunk.load_state_dict(state[f"model{i}"], strict=True)
        if optimizer is not None:
            # no_grad: with fp32 params the main params are views of the model's leaf params,
            # and Megatron's dp_reshardable loader (unlike the model-space one) copies into
            # them without it ("a view of a leaf Variable ... in-place operation").
            with torch.no_grad():
                optimizer.load_state_dict(state["optimizer"])
            _restore_torch_adam_step(optimizer)

    if rng:
        if same_layout:
            _read_rng(path, dist.get_rank())
        else:
            log.warning("checkpoint %s: layout %s differs from %s, RNG states not restored", path, saved, now)
    dist.barrier()  # nobody trains on while a peer is still reading
    log.info("loaded %s in %.2fs", path, time.perf_counter() - t0)
    return step


def _megatron_version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("megatron-core")
    except Exception:  # noqa: BLE001
        return "unknown"
