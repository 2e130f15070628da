"""The agent: starts and watches this machine's workers and standbys.

One agent per machine. Each process runs under
``torch.distributed.elastic.multiprocessing`` in a context of its own, so that one
process can die, be killed or be replaced while the others run on. Logs go to
``<run-dir>/logs/<name>/``.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, Std, start_processes


@dataclass
class Proc:
    """One process the agent started."""

    name: str
    ctx: PContext
    pid: int
    env: Dict[str, str]
    exit: Optional[str] = None
    """None while it runs; then ``"0"``, ``"exit 3"`` or ``"signal SIGKILL"``."""

    @property
    def running(self) -> bool:
        return self.exit is None


@dataclass
class Agent:
    """Starts processes on this machine and reports their exits."""

    run_dir: Path
    procs: Dict[str, Proc] = field(default_factory=dict)

    def start(self, name: str, argv: Sequence[str], env: Dict[str, str]) -> Proc:
        log_dir = Path(self.run_dir) / "logs" / name
        ctx = start_processes(
            name=name, entrypoint=sys.executable, args={0: tuple(argv)}, envs={0: env},
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
        )
        proc = Proc(name, ctx, ctx.pids()[0], env)
        self.procs[name] = proc
        return proc

    def poll(self) -> List[Proc]:
        """Processes that exited since the last poll."""
        out = []
        for p in self.procs.values():
            if p.exit is not None:
                continue
            res = p.ctx.wait(timeout=0, period=0)
            if res is None:
                continue
            if res.is_failed():
                f = next(iter(res.failures.values()))
                p.exit = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit {f.exitcode}"
            else:
                p.exit = "0"
            out.append(p)
        return out

    def kill(self, p: Proc, sig: int = signal.SIGKILL) -> None:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass

    def log_tail(self, p: Proc, n: int = 30) -> str:
        lines = []
        for stream, paths in (("stdout", p.ctx.stdouts), ("stderr", p.ctx.stderrs)):
            path = paths.get(0)
            try:
                tail = Path(path).read_text(errors="replace").splitlines()[-n:]
            except (OSError, TypeError):
                tail = ["<no log>"]
            lines.append(f"----- [{p.name}] {stream} ({path})")
            lines.extend(tail)
        return "\n".join(lines)

    def log_paths(self, p: Proc) -> Dict[str, str]:
        return {"stdout": str(p.ctx.stdouts.get(0)), "stderr": str(p.ctx.stderrs.get(0))}

    def close(self) -> None:
        for p in self.procs.values():
            try:
                p.ctx.close(death_sig=signal.SIGKILL)
            except Exception:  # noqa: BLE001 - already gone
                pass
