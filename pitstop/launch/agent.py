"""The agent: starts and watches this machine's workers and standbys.

One agent per machine. Each process runs under
``torch.distributed.elastic.multiprocessing`` in a context of its own, so that one
process can die, be killed or be replaced while the others run on. Logs go to
``<run-dir>/logs/<name>/``.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

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


#: ``PF_EXITING`` in ``/proc/<pid>/stat``'s flags (field 9): the task is in ``do_exit``.
PF_EXITING = 0x4
#: SIGKILL's bit in ``/proc/<pid>/status``'s pending-signal masks.
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def exiting(stat: Optional[str], status: Optional[str]) -> bool:
    """Whether a process is on its way out, from the text of its ``/proc/<pid>/stat`` and
    ``/proc/<pid>/status`` (None: the file is gone, so is the process).

    Dying means any of: reaped or a zombie (state ``Z``/``X``/``x``); in ``do_exit``
    (``PF_EXITING``); a SIGKILL pending for the process or its thread group. A SIGKILL of a
    machine's process group (``kill(-pgid)``) marks every member pending at once, so the
    first exit the agent sees finds the others in one of these states."""
    if stat is None or status is None:
        return True
    try:
        after = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and ')'
        state, flags = after[0], int(after[6])
    except (ValueError, IndexError):
        return False
    if state in ("Z", "X", "x") or flags & PF_EXITING:
        return True
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            try:
                if int(line.split()[1], 16) & SIGKILL_BIT:
                    return True
            except (ValueError, IndexError):
                continue
    return False


def _signal_group(pid: int, sig: int, or_alone: bool = True) -> None:
    """Send ``sig`` to the process group that ``pid`` leads (its session: see :meth:`Agent.kill`);
    with ``or_alone``, to ``pid`` itself if it leads no group. Never ``or_alone`` for a process
    already reaped: its pid may belong to someone else by now (a group id cannot be reused
    while a member of the group lives). A group or process already gone is not an error."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):  # no member left, or it leads no group
        if not or_alone:
            return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


@dataclass
class Agent:
    """Starts processes on this machine and reports their exits.

    Each process also has a pidfd (Linux >= 5.3; without one the agent falls back to
    polling): :meth:`wait_exit` sleeps until a process exits or the time is up, so a
    loop that polls every 10 ms sees a death at once rather than up to a loop later."""

    run_dir: Path
    procs: Dict[str, Proc] = field(default_factory=dict)
    pidfds: Dict[str, int] = field(default_factory=dict)

    def start(self, name: str, argv: Sequence[str], env: Dict[str, str]) -> Proc:
        log_dir = Path(self.run_dir) / "logs" / name
        ctx = start_processes(
            name=name, entrypoint=sys.executable, args={0: tuple(argv)}, envs={0: env},
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
        )
        proc = Proc(name, ctx, ctx.pids()[0], env)
        self.procs[name] = proc
        old = self.pidfds.pop(name, None)  # a name used again (a restart): its old process is gone
        if old is not None:
            os.close(old)
        try:
            self.pidfds[name] = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # an old kernel or Python: wait_exit just sleeps
            pass
        return proc

    def wait_exit(self, timeout: float, fds: Sequence[Any] = ()) -> None:
        """Sleep up to ``timeout`` seconds, less if one of the running processes exits (a
        process's pidfd is closed once :meth:`poll` reported it, so all those left run) or one
        of ``fds`` (sockets, descriptors) has something to read. ``poll``, not ``select``: a
        descriptor past 1,023 is fine."""
        p = select.poll()
        for fd in [*self.pidfds.values(), *fds]:
            p.register(fd, select.POLLIN)
        p.poll(max(0, int(timeout * 1000)))

    def dying(self) -> List[Proc]:
        """Running processes (not yet reported by :meth:`poll`) that are exiting: see :func:`exiting`."""
        return [p for p in self.procs.values() if p.exit is None
                and exiting(_read(f"/proc/{p.pid}/stat"), _read(f"/proc/{p.pid}/status"))]

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
            # what it started goes with it, as on a machine that fails: a process killed by a
            # signal (or by itself) leaves its helpers running otherwise
            _signal_group(p.pid, signal.SIGKILL, or_alone=False)
            fd = self.pidfds.pop(p.name, None)
            if fd is not None:
                os.close(fd)
            out.append(p)
        return out

    def kill(self, p: Proc, sig: int = signal.SIGKILL) -> None:
        """Signal ``p`` and every process it started: its process group. torch's elastic
        multiprocessing starts each process in a session of its own, so the group is the
        process and its helpers (Megatron-LM's ``spawn`` workers and their resource
        trackers). Signalling the pid alone left those running, reparented to init, after
        every kill (seen after one Megatron-LM test lane: 16 helpers of about 0.5 GB each,
        and their 16 trackers)."""
        _signal_group(p.pid, sig)

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
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()
        for p in self.procs.values():
            try:
                p.ctx.close(death_sig=signal.SIGKILL)
            except Exception:  # noqa: BLE001 - already gone
                pass
