"""Start and watch worker processes on this machine, with torchrun's environment.

Workers run under ``torch.distributed.elastic.multiprocessing``; the launcher hosts
the control store (a real ``TCPStore`` on port 0) and hands its address to every
worker as ``MASTER_ADDR``/``MASTER_PORT`` (with ``TORCHELASTIC_USE_AGENT_STORE``,
as torchrun's agent does) and as ``PITSTOP_STORE``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, Std, start_processes

from pitstop.runtime.worker import ENV_LOG
from pitstop.store import ENV_STORE, host_store


def worker_env(rank: int, world_size: int, local_rank: int, host: str, port: Optional[int],
               extra: Optional[Dict[str, str]] = None, store: Optional[str] = None) -> Dict[str, str]:
    """The environment torchrun gives a worker, plus pitstop's own variables. ``store``: the
    control store's address when it is not a ``TCPStore`` at ``host:port`` (etcd: then no
    ``MASTER_PORT``, as there is no ``TCPStore`` for ``env://`` to reach)."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": host,
        ENV_STORE: store if store is not None else f"{host}:{port}",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
        ENV_LOG: os.environ.get(ENV_LOG, "info"),  # pitstop's own lines on the worker's stderr (see worker._setup_logging)
    }
    if store is None:  # a TCPStore that torchrun's env:// could reach too
        env.update({"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    env.update(extra or {})
    return env


@dataclass
class LocalJob:
    """A set of worker processes on this machine sharing one hosted control store."""

    run_dir: Path
    host: str = "127.0.0.1"
    contexts: List[PContext] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store = host_store(self.host, 0)
        self.port = self.store.port

    def start(
        self,
        name: str,
        argv: Sequence[str],
        ranks: Sequence[int],
        world_size: int,
        extra_env: Optional[Dict[int, Dict[str, str]]] = None,
        per_rank_args: Optional[Dict[int, Sequence[str]]] = None,
    ) -> PContext:
        """Start one Python process per rank in ``ranks``, running ``argv`` (script + args)."""
        args = {i: tuple(argv) + tuple((per_rank_args or {}).get(r, ())) for i, r in enumerate(ranks)}
        envs = {i: worker_env(r, world_size, i, self.host, self.port, (extra_env or {}).get(r)) for i, r in enumerate(ranks)}
        ctx = start_processes(
            name=name,
            entrypoint=sys.executable,
            args=args,
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=str(self.run_dir / name), redirects=Std.ALL),
        )
        self.contexts.append(ctx)
        return ctx

    @staticmethod
    def log_tail(ctx: PContext, n: int = 40) -> str:
        """The last ``n`` lines of each process's stdout and stderr, rank-prefixed."""
        out = []
        for i in sorted(ctx.stdouts):
            for stream, path in (("stdout", ctx.stdouts[i]), ("stderr", ctx.stderrs[i])):
                try:
                    lines = Path(path).read_text(errors="replace").splitlines()[-n:]
                except OSError:
                    lines = ["<no log>"]
                out.append(f"----- [{ctx.name} {i}] {stream} ({path})")
                out.extend(lines)
        return "\n".join(out)

    def close(self) -> None:
        for ctx in self.contexts:
            ctx.close()
        self.contexts.clear()


def run_plain(run_dir, argv: Sequence[str], world_size: int, timeout: float = 400.0,
              extra_env: Optional[Dict[int, Dict[str, str]]] = None) -> Dict[int, dict]:
    """Run ``argv`` as a plain world (no controller) and return each rank's ``{"rank": ...}``
    JSON line (what the examples print with ``--checksum``). Raises with every process's log
    tail when a process fails or the run outlives ``timeout``."""
    import json

    from pitstop.errors import PitstopError

    job = LocalJob(Path(run_dir))
    try:
        ctx = job.start("plain", list(argv), range(world_size), world_size, extra_env=extra_env)
        res = ctx.wait(timeout=timeout, period=0.2)
        if res is None or res.is_failed():
            raise PitstopError(f"plain run {' '.join(argv)} {'timed out' if res is None else 'failed'}\n"
                               + job.log_tail(ctx))
        out: Dict[int, dict] = {}
        for path in ctx.stdouts.values():
            for line in Path(path).read_text().splitlines():
                if line.startswith('{"rank"'):
                    rec = json.loads(line)
                    out[rec["rank"]] = rec
        return out
    finally:
        job.close()
