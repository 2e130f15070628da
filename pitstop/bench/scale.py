"""``pitstop bench scale``: the real control plane at thousands of simulated ranks, on one host.

One row per (backend, N). Each row is one job, run by the real controller, with every
machine's agent the real ``NodeAgent`` and every rank a simulated one
(:mod:`pitstop.bench.scale_sim`)::

    t0 launch ──> roster (every rank said hello) ──> steady window (steps run: counted)
       ──> kill one simulated rank (a process standby replaces it)
       ──> SIGKILL a real machine's process group (a standby machine replaces it)
       ──> SIGSTOP the other real machine (detected by silence; a standby machine replaces it)

Figures (all processes together; ``per_machine`` divides by the training machines):

- ``store_ops_per_step``: the step boundary's operations (the vote) per committed step;
  ``store_ops_per_s``: every other operation per second (heartbeats, reassertions, the
  per-beat look, the agents' loops, the controller's loop), in the steady window;
- ``vote_p50_ms`` / ``vote_p99_ms``: per step, from the last rank's arrival at the boundary
  to the last rank holding the verdict;
- ``detect_rank_s``: from the injector's stamp to the controller's detection (its
  ``failure`` event); ``detect_machine_s`` / ``detect_frozen_s``: from the signal to the
  controller's ``machine-lost`` event;
- ``control_path_s``: from the detection to the last simulated stayer told (its watch or
  per-beat look read the fault): plan, announcement, roster, wake-up;
- ``controller_loop_ms`` (one loop's work, p50/p99), ``controller_cpu_s_per_s``;
- ``rss_bytes`` / ``fds``: the controller's, and per simulated rank (its host processes' over
  the ranks they hold);
- ``ops_total_by_purpose`` / ``watch_waits_total``: the whole run's operations, start-up and
  changes included (the end of a generation: one wait per machine, not per rank);
- ``machines_lost_unasked``: machines lost that the bench did not kill or freeze (the harness
  starved its own agents: the row then says more about this host than the control plane);
- ``rank_heartbeat_interval_s``: a simulated rank's beat to its own agent (the machines' beats
  to the controller keep ``heartbeat_interval_s``), thinned past 2,048 ranks;
- ``harness_cpu_s_per_s``: the CPU of the processes that hold the simulated machines, beside
  ``cores``: every simulated rank's Python runs on this host, where a real job spreads it over
  its machines, so a row near the cores measures the harness as much as the control plane
  (``vote_p99_ms`` most of all: the last verdict waits for every rank's share of the CPU).

A row that cannot finish (a limit reached, a phase that does not complete in its time) is
reported with ``"error"`` naming the phase and what was seen, never dropped.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from pitstop import protocol
from pitstop.bench.scale_sim import PURPOSES, STEP_PURPOSES
from pitstop.launch.events import read_events

DEFAULT_RANKS = (64, 256, 1024, 4096, 8192)


class RowFailed(Exception):
    pass


def _wait(what: str, cond, timeout_s: float, poll_s: float = 0.1, gone=lambda: None):
    """``cond()`` once it is true; RowFailed at the timeout, or at once when ``gone()`` names why
    it never will be (the controller exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        why = gone()
        if why:
            raise RowFailed(f"{what}: {why}")
        if time.monotonic() > deadline:
            raise RowFailed(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(poll_s)


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Row:
    """One job of the bench (see the module docstring)."""

    def __init__(self, backend: str, ranks: int, work: Path, nproc: int = 8, hosts: Optional[int] = None,
                 step_s: Optional[float] = None,
                 heartbeat_interval: float = 0.5, heartbeat_timeout: float = 5.0, window_s: float = 10.0,
                 etcd_endpoint: Optional[str] = None) -> None:
        if ranks % nproc or ranks // nproc < 3:
            raise ValueError(f"ranks({ranks}) must be a multiple of nproc({nproc}) with at least 3 machines")
        self.backend, self.ranks, self.nproc = backend, ranks, nproc
        self.machines = ranks // nproc
        self.spares = 2
        # a process holds at most 64 simulated ranks up to 32 processes: 256 ranks' threads in one
        # interpreter wait on each other's GIL (at 1,024 ranks on 4 processes the last stayer heard
        # of a fault 4.4 s after its detection; on 16, 0.25 s), and each process costs ~250 MB
        self.hosts = hosts if hosts is not None else max(4, min(32, ranks // 64))
        # the sleep for a step's compute: 0.25 s to 256 ranks, then as many seconds per 1,024
        # ranks: every simulated rank costs Python time at each boundary, and all of them share
        # 2 cores (a harness saturated by its own ranks measures itself, not the control plane)
        self.step_s = step_s if step_s is not None else max(0.25, ranks / 1024)
        self.window_s = max(window_s, 8 * self.step_s)
        self.hb_interval, self.hb_timeout = heartbeat_interval, heartbeat_timeout
        # a rank's beat goes to its own machine's agent (never to the store or the controller):
        # past 512 ranks the harness sends it less often, as every simulated rank's beat costs
        # this host's 2 cores what a real job spreads over its machines (at 4,096 ranks beating
        # every second: 4,096 lines a second, each waking two threads); the machines' beats to
        # the controller (what a lost or frozen machine is detected by) keep the interval above
        self.rank_hb_interval = max(heartbeat_interval, ranks / 1024)
        self.rank_hb_timeout = max(heartbeat_timeout, 10 * self.rank_hb_interval)
        self.run_dir = work / f"{backend}-{ranks}"
        self.etcd_endpoint = etcd_endpoint
        self.token = secrets.token_hex(32)
        self.procs: Dict[str, subprocess.Popen] = {}
        self.real = [self.machines - 1, self.machines - 2]  # real machine processes: killed, frozen
        self.out: Dict[str, Any] = {"backend": backend, "ranks": ranks, "machines": self.machines,
                                    "spare_machines": self.spares, "step_s": self.step_s,
                                    "heartbeat_interval_s": heartbeat_interval, "heartbeat_timeout_s": heartbeat_timeout,
                                    "rank_heartbeat_interval_s": self.rank_hb_interval,
                                    "rank_heartbeat_timeout_s": self.rank_hb_timeout}

    # ------------------------------------------------------------------ processes
    def _env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env[protocol.ENV_TOKEN] = self.token
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # c10d's warning per connection about its own hostname
        env.pop("PITSTOP_FAULT", None)
        if self.backend == "etcd":
            env["PITSTOP_JOB_ID"] = protocol.job_id(self.token)
        return env

    def _spawn(self, name: str, argv: List[str], stdin=None) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "pitstop.bench.scale_sim", *argv], env=self._env(), stdout=log,
                             stderr=subprocess.STDOUT, stdin=stdin, start_new_session=True)
        self.procs[name] = p
        return p

    def _common(self) -> List[str]:
        return ["--heartbeat-interval", str(self.hb_interval), "--heartbeat-timeout", str(self.hb_timeout)]

    #: Threads per simulated rank (its training thread and heartbeat; one thread of the host
    #: process reads every rank's line to its agent) and per machine (the agent's loop, its
    #: hub's loop and end-of-generation wait, the vote's add and waits), as counted in a host
    #: process.
    THREADS_PER_RANK, THREADS_PER_MACHINE = 2, 8

    def threads_needed(self) -> int:
        return self.ranks * self.THREADS_PER_RANK + (self.machines + self.spares) * self.THREADS_PER_MACHINE

    #: The store server's connections per rank (its own: with its agent's line a rank keeps no
    #: spare, ``worker.spare_connections``) and per machine (its agent's, the vote's add and
    #: wait, the end-of-generation wait, the link), as measured: 5,433 descriptors at 2,048
    #: ranks on 258 machines when each rank kept a spare.
    FDS_PER_RANK, FDS_PER_MACHINE = 1, 5

    def fds_needed(self) -> int:
        return self.ranks * self.FDS_PER_RANK + (self.machines + self.spares) * self.FDS_PER_MACHINE + 200

    def refusal(self, pid_max: Optional[int], nofile_hard: Optional[int]) -> Optional[str]:
        """Why this row cannot run on a host with these limits (None: it can): every thread takes
        a pid, past ``kernel.pid_max`` thread creation fails half-way; the store's server holds a
        descriptor per connection in the controller's process."""
        if pid_max is not None and self.threads_needed() > 0.9 * pid_max:
            return (f"ranks({self.ranks}) need about {self.threads_needed()} threads on this host, over 90% of "
                    f"kernel.pid_max({pid_max}) (every thread takes a pid): not started")
        if nofile_hard is not None and self.fds_needed() > nofile_hard:
            return (f"ranks({self.ranks}) need about {self.fds_needed()} descriptors in the controller's process "
                    f"(the store's server), over its hard RLIMIT_NOFILE({nofile_hard}): not started")
        return None

    def start(self) -> None:
        import resource

        try:
            pid_max: Optional[int] = int(Path("/proc/sys/kernel/pid_max").read_text())
        except (OSError, ValueError):
            pid_max = None
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        why = self.refusal(pid_max, None if hard == resource.RLIM_INFINITY else hard)
        if why:
            raise RowFailed(why)
        if self.run_dir.exists():  # an earlier run's events would be read as this one's
            import shutil

            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True)
        argv = ["controller", "--run-dir", str(self.run_dir), "--nnodes", f"{self.machines}:{self.machines + self.spares}",
                "--nproc", str(self.nproc), "--standby", "1", *self._common()]
        if self.backend == "etcd":
            argv += ["--backend", "etcd", "--endpoint", self.etcd_endpoint]
        self.t_launch = time.time()
        self._spawn("controller", argv)
        info = self._wait("the controller's store", lambda: _read_json(self.run_dir / "controller.json"), 60)
        self.store = info["store"]
        nodes = [k for k in range(self.machines + self.spares) if k not in self.real]
        per = math.ceil(len(nodes) / self.hosts)
        host = ["host", "--run-dir", str(self.run_dir), "--store", self.store, "--nproc", str(self.nproc),
                "--step-s", str(self.step_s), *self._common(), "--rank-heartbeat-interval", str(self.rank_hb_interval),
                "--rank-heartbeat-timeout", str(self.rank_hb_timeout)]
        for i in range(0, len(nodes), per):
            part = nodes[i:i + per]
            self._spawn(f"host-{part[0]}", host + ["--nodes", ",".join(map(str, part))], stdin=subprocess.PIPE)
        for k in self.real:
            self._spawn(f"host-{k}", host + ["--nodes", str(k), "--addr", f"127.0.0.{k % 250 + 2}"], stdin=subprocess.PIPE)

    def stop(self) -> None:
        for p in self.procs.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def _gone(self) -> Optional[str]:
        p = self.procs.get("controller")
        if p is None or p.poll() is None:
            return None
        try:
            tail = (self.run_dir / "controller.log").read_text(errors="replace").strip().splitlines()[-2:]
        except OSError:
            tail = []
        return f"the controller exited ({p.returncode}): {' | '.join(t[-300:] for t in tail)}"

    def _wait(self, what: str, cond, timeout_s: float, poll_s: float = 0.1):
        return _wait(what, cond, timeout_s, poll_s, gone=self._gone)

    # ------------------------------------------------------------------ reading back
    def events(self, name: str, **match) -> List[Dict[str, Any]]:
        return [e for e in read_events(self.run_dir) if e["event"] == name
                and all(e.get(k) == v for k, v in match.items())]

    def reports(self) -> Dict[str, Dict[str, Any]]:
        out = {}
        for f in (self.run_dir / "scale").glob("*.json"):
            got = _read_json(f)
            if got is not None:
                out[f.stem] = got
        return out

    def ops(self, reps: Dict[str, Dict[str, Any]]) -> Dict[str, int]:
        tot: Dict[str, int] = {}
        for r in reps.values():
            for k, v in r.get("ops", {}).items():
                tot[k] = tot.get(k, 0) + v
        return tot

    def committed_steps(self, reps: Dict[str, Dict[str, Any]], gen: int = 0) -> Dict[int, List[float]]:
        """Per step of ``gen`` that every rank voted on: [last arrival, last verdict]."""
        merged: Dict[int, List[float]] = {}
        for r in reps.values():
            for k, (ta, tv, n) in r.get("timeline", {}).get("steps", {}).items():
                g, s = map(int, k.split("/"))
                if g != gen:
                    continue
                m = merged.setdefault(s, [0.0, 0.0, 0])
                m[0], m[1], m[2] = max(m[0], ta), max(m[1], tv), m[2] + n
        return {s: v[:2] for s, v in merged.items() if v[2] == self.ranks}

    def told(self, reps: Dict[str, Dict[str, Any]], gen: int) -> tuple:
        t, n = 0.0, 0
        for r in reps.values():
            got = r.get("timeline", {}).get("told", {}).get(str(gen))
            if got:
                t, n = max(t, got[0]), n + got[1]
        return t, n

    def errors(self, reps) -> List[str]:
        return [e for r in reps.values() for e in r.get("timeline", {}).get("errors", [])]

    # ------------------------------------------------------------------ the phases
    def run(self) -> Dict[str, Any]:
        try:
            self.start()
            self._phases()
        except RowFailed as exc:
            self.out["error"] = str(exc)
            reps = self.reports()
            self.out["errors_seen"] = self.errors(reps)[:5]
        finally:
            # machines lost that the bench did not kill or freeze: the harness starved its own agents
            self.out["machines_lost_unasked"] = len([e for e in self.events("machine-lost")
                                                     if e.get("node") not in self.real]) if self.run_dir.exists() else 0
            self.stop()
        return self.out

    def _phases(self) -> None:
        o = self.out
        scale_t = max(1.0, self.ranks / 256)
        roster = self._wait("roster (every rank admitted)", lambda: self.events("roster"), 120 * scale_t, 0.5)
        o["startup_s"] = round(roster[0]["time"] - self.t_launch, 2)
        # steady: a few steps, then the window
        self._wait("3 steps committed by every rank", lambda: len(self.committed_steps(self.reports())) >= 3,
              60 * scale_t, 0.5)
        reps0, t0 = self.reports(), time.time()
        time.sleep(self.window_s)
        reps1, t1 = self.reports(), time.time()
        self._steady(reps0, reps1, t0, t1)
        # a simulated rank killed: a process standby takes its role
        victim = 1 * self.nproc + 1  # on machine 1, a bulk machine
        host = next(n for n in self.procs if n.startswith("host-") and self._hosts(n, 1))
        self.procs[host].stdin.write(f"kill {victim}\n".encode())
        self.procs[host].stdin.flush()
        f = self._wait("the killed rank's failure", lambda: self.events("failure", role=victim), 60 * scale_t)[0]
        o["detect_rank_s"] = f.get("detect_s")
        self._control_path(f, "control_path_s")
        # a real machine killed whole
        self._machine("killed", self.real[0], signal.SIGKILL, "detect_machine_s")
        # a real machine frozen whole (no socket closes)
        self._machine("frozen", self.real[1], signal.SIGSTOP, "detect_frozen_s")
        reps = self.reports()
        o["errors_seen"] = self.errors(reps)[:5]
        # the whole run's operations (start-up, the three changes), by purpose: what the changes
        # cost beside the steady window's rates (the end of a generation: one wait per machine)
        tot = self.ops(reps)
        o["ops_total_by_purpose"] = {p: sum(v for k, v in tot.items() if k.startswith(p + "."))
                                     for p in PURPOSES}
        o["watch_waits_total"] = tot.get("watch.wait", 0)

    def _hosts(self, name: str, node: int) -> bool:
        rep = _read_json(self.run_dir / "scale" / f"{name}.json")
        return rep is not None and node in rep.get("nodes", [])

    def _machine(self, what: str, node: int, sig: int, key: str) -> None:
        p = self.procs[f"host-{node}"]
        t0 = time.time()
        os.killpg(p.pid, sig)
        lost = self._wait(f"machine {node} {what}: machine-lost", lambda: self.events("machine-lost", node=node),
                     60 * max(1.0, self.ranks / 256))[0]
        self.out[key] = round(lost["time"] - t0, 4)
        self.out["cause_" + key[len("detect_"):-len("_s")]] = lost.get("cause")
        roles = set(lost.get("roles") or [])
        f = self._wait(f"machine {node} {what}: failure", lambda: [e for e in self.events("failure")
                                                             if roles and set(e.get("roles", [])) == roles],
                  60 * max(1.0, self.ranks / 256))[0]
        self._control_path(f, f"control_path_{what}_s")
        if sig == signal.SIGSTOP:
            os.killpg(p.pid, signal.SIGKILL)
            os.killpg(p.pid, signal.SIGCONT)

    def _control_path(self, f: Dict[str, Any], key: str) -> None:
        gen = f["generation"]
        stayers = self.ranks - len(f.get("roles") or [f.get("role")])
        t_told, n = self._wait(f"every stayer of g{gen} told", lambda: (lambda tn: tn if tn[1] >= stayers else None)(
            self.told(self.reports(), gen)), 60 * max(1.0, self.ranks / 256), 0.25)
        # from the controller's detection (when it first saw the loss) to the later of every stayer
        # told (the end of the generation written) and the roster published (the failure event is
        # written after it). Before the event held detected_at, the detection was taken as the
        # event's time less the settle window, which left the controller's own work (the plan, the
        # fault, the roster: chunks of 600 KB at 8,192 ranks) out of the path, and could come out
        # negative.
        t_detect = f["detected_at"]
        self.out[key] = round(max(t_told, f["time"]) - t_detect, 4)
        self.out[key.replace("_s", "_roster_s")] = round(f["time"] - t_detect, 4)
        self.out[key.replace("_s", "_told")] = n
        # the change is over once the new generation committed a step: only then is the next fault
        # a new failure (one during a change is an overlap, which restarts the job)
        done = self._wait(f"g{gen + 1} replaced (its first step committed)",
                     lambda: self.events("replaced", generation=gen + 1), 60 * max(1.0, self.ranks / 256), 0.25)[0]
        self.out[key.replace("control_path", "downtime")] = done.get("downtime_s")

    def _steady(self, reps0, reps1, t0: float, t1: float) -> None:
        o = self.out
        ops0, ops1 = self.ops(reps0), self.ops(reps1)
        d = {k: ops1.get(k, 0) - ops0.get(k, 0) for k in ops1}
        steps0, steps1 = self.committed_steps(reps0), self.committed_steps(reps1)
        new = sorted(set(steps1) - set(steps0))
        step_ops = sum(v for k, v in d.items() if k.split(".", 1)[0] in STEP_PURPOSES)
        bg = sum(v for k, v in d.items() if k.split(".", 1)[0] not in STEP_PURPOSES)
        o["window_s"] = round(t1 - t0, 3)
        o["steps_in_window"] = len(new)
        o["store_ops_per_step"] = round(step_ops / len(new), 2) if new else None
        o["store_ops_per_s"] = round(bg / (t1 - t0), 1)
        o["per_machine"] = {"store_ops_per_step": None if not new else round(step_ops / len(new) / self.machines, 3),
                            "store_ops_per_s": round(bg / (t1 - t0) / self.machines, 3)}
        o["ops_by_purpose_per_s"] = {p: round(sum(v for k, v in d.items() if k.startswith(p + ".")) / (t1 - t0), 1)
                                     for p in PURPOSES}
        lat = [(v[1] - v[0]) * 1e3 for s, v in steps1.items()]
        o["vote_p50_ms"], o["vote_p99_ms"] = (round(x, 2) if x is not None else None
                                              for x in (_pct(lat, 0.5), _pct(lat, 0.99)))
        o["vote_steps"] = len(lat)
        c0, c1 = reps0.get("controller", {}), reps1.get("controller", {})
        if c0.get("cpu_s") is not None and c1.get("cpu_s") is not None:
            o["controller_cpu_s_per_s"] = round((c1["cpu_s"] - c0["cpu_s"]) / (c1["time"] - c0["time"]), 3)
        loops = [x for x in c1.get("loops", []) if t0 <= x.get("t", 0) <= t1 and x.get("n")]
        if loops:
            o["controller_loop_ms"] = {"p50": round(_pct([x["p50"] for x in loops], 0.5), 3),
                                       "p99": round(max(x["p99"] for x in loops), 3),
                                       "loops_per_s": round(sum(x["n"] for x in loops) / (t1 - t0), 1)}
        o["controller_rss_bytes"], o["controller_fds"] = c1.get("rss_bytes"), c1.get("fds")
        # where the window's loops that ran past 0.1 s were, sampled every 20 ms (the controller's
        # innermost pitstop frames)
        s0, s1 = c0.get("slow_loop_samples") or {}, c1.get("slow_loop_samples") or {}
        slow = sorted(((k, v - s0.get(k, 0)) for k, v in s1.items() if v > s0.get(k, 0)), key=lambda kv: -kv[1])
        o["controller_slow_loop_samples"] = [[k, v] for k, v in slow[:5]]
        hosts = [r for n, r in reps1.items() if n.startswith("host-")]
        # the simulated machines' own CPU, all on this host: near the cores, the harness measures
        # itself (a real job spreads this over its machines)
        busy = [(reps1[n]["cpu_s"] - reps0[n]["cpu_s"]) / (reps1[n]["time"] - reps0[n]["time"])
                for n in reps1 if n.startswith("host-") and n in reps0 and "cpu_s" in reps1[n] and "cpu_s" in reps0[n]
                and reps1[n]["time"] > reps0[n]["time"]]
        o["hosts"], o["cores"] = self.hosts, os.cpu_count()
        o["harness_cpu_s_per_s"] = round(sum(busy), 3) if busy else None
        ranks = sum(r.get("ranks", 0) for r in hosts) or 1
        o["rss_bytes_per_rank"] = int(sum(r.get("rss_bytes", 0) for r in hosts) / ranks)
        o["fds_per_rank"] = round(sum(r.get("fds", 0) for r in hosts) / ranks, 2)


def growth(rows: List[Dict[str, Any]], key: str, per_machine: bool = False) -> Optional[float]:
    """The fitted exponent b of ``value ~ N**b`` over the rows that have the figure (least squares
    in log-log); None with fewer than two."""
    pts = []
    for r in rows:
        v = (r.get("per_machine") or {}).get(key) if per_machine else r.get(key)
        if isinstance(v, dict):
            v = v.get("p99")
        if v is not None and v > 0 and "error" not in r:
            pts.append((math.log(r["ranks"]), math.log(v)))
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 3) if sxx else None


GROWTH = (("store_ops_per_step", True), ("store_ops_per_s", True), ("vote_p99_ms", False),
          ("detect_rank_s", False), ("detect_machine_s", False), ("detect_frozen_s", False),
          ("control_path_s", False), ("controller_loop_ms", False), ("controller_cpu_s_per_s", False))


def run(ranks=DEFAULT_RANKS, backends=("tcpstore",), work: Path = Path("runs/bench-scale"), real8: bool = False,
        **kw) -> Dict[str, Any]:
    """The rows, each backend's growth exponents and (``real8``) :func:`real_world8`."""
    rows: List[Dict[str, Any]] = []
    etcd = None
    for backend in backends:
        endpoint = None
        if backend == "etcd":
            from pitstop.launch.etcd_server import EtcdServer

            etcd = EtcdServer(Path(work) / "etcd").start()
            endpoint = etcd.endpoint
        try:
            for n in ranks:
                t = time.time()
                row = Row("etcd" if backend == "etcd" else "tcpstore", n, Path(work), etcd_endpoint=endpoint, **kw).run()
                row["row_wall_s"] = round(time.time() - t, 1)
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
        finally:
            if etcd is not None:
                etcd.stop()
                etcd = None
    out: Dict[str, Any] = {"rows": rows, "growth": {}}
    for b in sorted({r["backend"] for r in rows}):
        mine = [r for r in rows if r["backend"] == b]
        out["growth"][b] = {k + ("_per_machine" if pm else ""): growth(mine, k, pm) for k, pm in GROWTH}
    if real8:
        try:
            out["real_world8"] = real_world8(Path(work))
        except RowFailed as exc:
            out["real_world8"] = {"error": str(exc)}
        print(json.dumps(out["real_world8"]), file=sys.stderr, flush=True)
    return out


def _by_label(ops: Dict[str, int], scale: float) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for k, v in ops.items():
        lab = k.split(".", 1)[0]
        out[lab] = out.get(lab, 0.0) + v
    return {k: round(v * scale, 3) for k, v in sorted(out.items())}


def real_world8(work: Path = Path("runs/bench-scale"), steps: int = 90, window_steps: int = 40) -> Dict[str, Any]:
    """The store operations of a real world-8 job beside a simulated one of the same shape.

    Real: ``examples/train_gpt.py`` (tp2 pp2 dp2) on 4 machines of 2 processes plus 2 standby
    machines and 1 standby process, one ``pitstop launch`` per machine on its own loopback
    address; every ``TCPStore`` client of every process counted from outside pitstop's code
    (:mod:`pitstop.bench.opcount`), over ``window_steps`` steps once every standby is warm.
    Simulated: :class:`Row` with the same machines, standbys and the real job's step time,
    its steady window counted by the same labels (its ``step`` and ``join`` clients are a
    worker's training thread, ``main``). Both per step and per second, by label."""
    from pitstop.bench import opcount
    from pitstop.launch.runs import start_machines, wait_for_event

    run_dir = Path(work) / "real-world8"
    if run_dir.exists():  # an earlier run's losses and counts would be read as this one's
        import shutil

        shutil.rmtree(run_dir)
    counts = run_dir / "opcount"
    counts.mkdir(parents=True, exist_ok=True)
    env = {opcount.ENV_DIR: str(counts),
           "PYTHONPATH": os.pathsep.join(p for p in (str(opcount.SITE_DIR), os.environ.get("PYTHONPATH", "")) if p)}
    machines, spares, nproc, standby = 4, 2, 2, 1
    m = start_machines(run_dir, steps, f"{machines}:{machines + spares}", nproc,
                       launch_args=["--standby", str(standby)], env=env)
    loss = run_dir / "loss.jsonl"

    def logged() -> int:
        try:
            return len({json.loads(l)["step"] for l in loss.read_text().splitlines() if l.strip()})
        except (OSError, ValueError):
            return 0

    try:
        wait_for_event(run_dir, "warmed", n=spares * nproc + standby, timeout=900)
        _wait("step 3", lambda: logged() >= 3, 600, 0.05)
        s0 = logged()
        _wait(f"step {s0 + 1}", lambda: logged() > s0, 120, 0.02)
        s0, t0 = logged(), time.time()
        _wait(f"step {s0 + window_steps}", lambda: logged() >= s0 + window_steps, 600, 0.02)
        s1, t1 = logged(), time.time()
        time.sleep(0.6)  # the snapshots at t1 are written
    finally:
        for p in [m.head, *m.agents.values()]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=60)
    files = sorted(counts.glob("*.json"))
    got = opcount.window(files, t0, t1)
    dt, n = t1 - t0, s1 - s0
    ops: Dict[str, int] = {}
    for d in got.values():
        for k, v in d.items():
            ops[k] = ops.get(k, 0) + v
    real = {"ranks": 8, "machines": machines, "spare_machines": spares, "standby": standby, "window_s": round(dt, 3),
            "steps_in_window": n, "step_s": round(dt / n, 4), "processes_counted": opcount.kinds(files, t0, t1),
            "ops_by_label_op": dict(sorted(ops.items())),
            "per_step": _by_label(ops, 1 / n), "per_s": _by_label(ops, 1 / dt)}
    row = Row("tcpstore", 8, Path(work) / "sim-world8", nproc=nproc, step_s=real["step_s"]).run()
    sim: Dict[str, Any] = {"ranks": 8, "machines": row["machines"], "spare_machines": row["spare_machines"],
                           "standby": 1, "window_s": row.get("window_s"), "steps_in_window": row.get("steps_in_window"),
                           "step_s": row.get("step_s"), "error": row.get("error")}
    per = row.get("ops_by_purpose_per_s")
    if per and row.get("steps_in_window"):
        # a real machine's agent sends its vote's add and wait itself: the simulated "vote" clients
        lab = {"main": per["step"] + per["join"], "heartbeat": per["heartbeat"], "watch": per["watch"],
               "agent": per["agent"] + per["vote"], "controller": per["controller"]}
        sim["per_s"] = {k: round(v, 3) for k, v in lab.items() if v}
        sim["per_step"] = {k: round(v * row["window_s"] / row["steps_in_window"], 3) for k, v in lab.items() if v}
    ratio = {k: (round(sim["per_step"].get(k, 0) / v, 3) if v else None)
             for k, v in real["per_step"].items()} if "per_step" in sim else None
    return {"real": real, "simulated": sim, "sim_over_real_per_step": ratio}
