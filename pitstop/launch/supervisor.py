"""``pitstop launch --rdzv-backend etcd``: the controller as a process that may die and come back.

::

    pitstop launch (supervisor) ──> head agent (node 0) ── workers, standbys     etcd
                        │                 never restarted; outlive the controller   /pitstop/<job>/...
                        └─> controller ──────── reads and writes only the store ──────┘
                            SIGKILLed?  -> started again with --resume: it re-attaches
                                           from ctl/controller/state and goes on

Steady state needs no controller: the workers vote on every step among themselves in
etcd, and the agents keep their processes. While it is down, failures wait: a process
that exits meanwhile is reported in the store by its agent, and the restarted controller
handles it on its first loop. ``pitstop launch --resume --run-dir D`` does the same from
another shell, when the supervisor itself is gone.

The job's id is derived from the job token (:func:`pitstop.protocol.job_id`), so every
machine's ``pitstop launch`` finds the same keys without another setting.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from pitstop.errors import PitstopError
from pitstop.launch.controller import ENV_JOB, LAUNCH_FILE, Controller, LaunchSpec, start_head_agent
from pitstop.launch.events import CONTROLLER, EventLog
from pitstop.protocol import ENV_TOKEN, job_id, new_token
from pitstop.store import etcd_spec

log = logging.getLogger(__name__)

#: A controller that keeps dying is not restarted forever.
MAX_RESTARTS = 5
#: Exit statuses that end the job (0 done, 1 failed, 2 bad input); anything else is a death.
FINAL = (0, 1, 2)


def _token(spec: LaunchSpec, resume: bool) -> str:
    if resume:
        try:
            return str(json.loads((Path(spec.run_dir) / CONTROLLER).read_text())["token"])
        except (OSError, ValueError, KeyError) as exc:
            raise PitstopError(f"--resume: cannot read the job token from {Path(spec.run_dir) / CONTROLLER}: {exc}") from None
    token = os.environ.get(ENV_TOKEN, "")
    if spec.multi_node and len(token) < 32:
        raise PitstopError(f"--nnodes {spec.nodes.min}:{spec.nodes.max}: set {ENV_TOKEN} to the same secret of at "
                           f"least 32 characters on every machine (e.g. `export {ENV_TOKEN}=$(openssl rand -hex 32)`)")
    return token if len(token) >= 32 else new_token()


def load_spec(run_dir: Path) -> LaunchSpec:
    path = Path(run_dir) / LAUNCH_FILE
    if not path.is_file():
        raise PitstopError(f"--resume --run-dir {run_dir}: {path} does not exist (give the run directory of a job "
                           "launched with --rdzv-backend etcd)")
    try:
        spec = LaunchSpec.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise PitstopError(f"{path}: not a launch spec pitstop can resume ({exc})") from None
    if spec.rdzv_backend != "etcd":
        raise PitstopError(f"--resume --run-dir {run_dir}: the job ran with --rdzv-backend {spec.rdzv_backend}; its "
                           "store died with its controller. Only an etcd-backed job can be re-attached")
    return spec


def supervise(spec: LaunchSpec, resume: bool = False) -> int:
    """Run the controller in a child process until the job ends, restarting it when it dies."""
    run_dir = Path(spec.run_dir)
    token = _token(spec, resume)
    job = job_id(token)
    where = etcd_spec(spec.rdzv_endpoint, job)
    from datetime import timedelta

    from pitstop.store import connect

    try:  # nothing starts half-way: etcd must answer first
        connect(where, timeout=timedelta(seconds=10)).check(["ctl/done"])
    except Exception as exc:  # noqa: BLE001 - refused, unreachable, not etcd
        raise PitstopError(f"--rdzv-endpoint {spec.rdzv_endpoint}: etcd does not answer there "
                           f"({str(exc).splitlines()[0][:200]})") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    events = EventLog(run_dir)
    if not resume:
        (run_dir / LAUNCH_FILE).write_text(json.dumps(spec.to_json(), indent=1))
    env = dict(os.environ, **{ENV_TOKEN: token, ENV_JOB: job})
    os.environ.pop(ENV_TOKEN, None)  # the token travels to the children by their environment only
    head = None
    if not resume:
        head = start_head_agent(spec, token, where, spec.local_addr or "127.0.0.1")
    restarts = 0
    again = resume
    try:
        while True:
            cmd = [sys.executable, "-m", "pitstop.launch.supervisor", "--run-dir", str(run_dir)] + (["--resume"] if again else [])
            child = subprocess.Popen(cmd, env=env)
            rc = child.wait()
            if rc in FINAL:
                return rc
            restarts += 1
            events.write("controller-lost", pid=child.pid, exit=rc, restarts=restarts)
            log.warning("the controller (pid %d) died (%s); %s", child.pid, rc,
                        "starting it again: it re-attaches from etcd" if restarts <= MAX_RESTARTS else "giving up")
            if restarts > MAX_RESTARTS:
                events.write("failed", reason=f"the controller died {restarts} times")
                return 1
            again = True
    finally:
        if head is not None:  # it sees ctl/done (set by the controller) and stops its processes
            try:
                head.wait(timeout=60)
            except subprocess.TimeoutExpired:
                head.kill()


def main(argv: Optional[List[str]] = None) -> int:
    """The controller process: ``python -m pitstop.launch.supervisor --run-dir D [--resume]``."""
    p = argparse.ArgumentParser(prog="pitstop-controller")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    try:
        spec = load_spec(Path(args.run_dir))
        return Controller(spec, resume=args.resume).run()
    except PitstopError as exc:
        print(f"pitstop: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
