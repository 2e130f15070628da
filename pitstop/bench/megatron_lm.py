"""``pitstop bench recovery --framework megatron-lm``: Megatron-LM's own ``pretrain`` four ways.

World 8 (tp2 pp2 dp2), ``examples/pretrain_gpt.py`` with the distributed optimizer,
overlapped grad reduce and param gather, dropout 0.1, on CPU/gloo, one run each::

    reference   an uninterrupted ``pitstop launch`` (losses, checksums, steady iteration)
    restart     no standby: rank 5 killed in step 6's backward, every process restarted,
                Megatron-LM's own --load of its --save checkpoint of step 4 (what a
                Megatron-LM user does today, driven by pitstop's fallback)
    unplanned   the same kill, a standby takes rank 5's role
    planned     a drain of rank 2 onto a standby

Times come from the controller's events, measured alike: from the kill (the fault injector
stamps the store just before it fires) to the end of the first step finished after it. It
needs megatron-core 0.19 (``megatron.training``): run it with the second lane's interpreter,
``.venv-lm/bin/python -m pitstop.cli bench recovery --framework megatron-lm``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from pitstop.errors import PitstopError
from pitstop.launch.controller import request_drain
from pitstop.runtime.faults import Fault

SCRIPT = "examples/pretrain_gpt.py"
#: A small GPT that Megatron-LM runs on CPU: its local (non-Transformer-Engine) layers, gloo,
#: no fused CUDA kernels.
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --log-interval 1 --lr 1e-3 --min-lr 1e-4 "
         "--lr-decay-style constant --weight-decay 0.01 --clip-grad 1.0 --seed 1234 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 128 --split 98,1,1 --eval-iters 0 --eval-interval 1000 "
         "--transformer-impl local --spec local --attention-backend local --distributed-backend gloo "
         "--use-cpu-initialization --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
         "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm").split()
#: The features Megatron-LM users keep on.
FEATURES = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer "
            "--overlap-grad-reduce --overlap-param-gather --manual-gc --hidden-dropout 0.1 "
            "--attention-dropout 0.1").split()
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
KILL = Fault.kill(rank=5).at(step=6, phase="backward")

_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? elapsed time per iteration \(ms\): ([0-9.]+) \|.*? lm loss: ([0-9.E+-]+)")


def args_for(steps: int) -> List[str]:
    return [*MODEL, *FEATURES, "--train-iters", str(steps), "--checksum"]


def parse(text: str) -> Tuple[Dict[int, str], Dict[int, str], Dict[int, float]]:
    """(losses by iteration, each rank's parameter checksum, iteration ms by iteration) as
    Megatron-LM logged them (a later line for the same iteration wins)."""
    losses, ms = {}, {}
    for m in _LOSS.finditer(text):
        losses[int(m.group(1))] = m.group(3)
        ms[int(m.group(1))] = float(m.group(2))
    sums = {}
    for line in text.splitlines():
        if line.startswith('{"rank"'):
            d = json.loads(line)
            sums[d["rank"]] = d["param_sha256"]
    return losses, sums, ms


def logs_of(run_dir: Path, pattern: str = "logs/*/*/*/*/std*.log") -> str:
    return "\n".join(f.read_text(errors="replace") for f in sorted(run_dir.glob(pattern)))


def launch(run_dir: Path, steps: int, standby: int, fault: str = "", during: Optional[Callable[[Path], None]] = None,
           restarts: int = 0, extra: Tuple[str, ...] = (), root: Optional[Path] = None,
           timeout_s: float = 500, warmup: bool = False) -> Tuple[int, str, List[dict]]:
    """One ``pitstop launch`` of the script: (exit status, its stderr, the controller's events).
    ``warmup``: standbys warm up in the sandbox, and step 1's ranks wait for them after it
    (``--hold-for-warm``); otherwise standbys join cold (``--no-warmup``)."""
    root = root or Path.cwd()
    warm = ["--hold-for-warm", "600"] if warmup else ["--no-warmup"]
    cmd = [sys.executable, "-m", "pitstop.cli", "launch", "--nproc-per-node", "8", "--standby", str(standby),
           *warm, "--max-restarts", str(restarts), "--collective-timeout", "60", "--run-dir", str(run_dir),
           "--", str(root / SCRIPT), *args_for(steps), *extra]
    env = dict(os.environ, **ENV, PITSTOP_FAULT=fault)
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=root) as job:
        try:
            if during is not None:
                during(run_dir)
            _, err = job.communicate(timeout=timeout_s)
        except BaseException:
            job.kill()
            job.communicate()
            raise
    ev = run_dir / "events.jsonl"
    events = [json.loads(line) for line in ev.read_text().splitlines()] if ev.exists() else []
    return job.returncode, err, events


def drain_at_once(rank: int) -> Callable[[Path], None]:
    """Ask for a drain of ``rank`` as soon as the controller runs (it starts once the roster is up)."""
    def during(run_dir: Path) -> None:
        deadline = time.monotonic() + 120
        while not (run_dir / "controller.json").is_file():
            if time.monotonic() > deadline:
                raise PitstopError(f"{run_dir}: the controller wrote no controller.json in 120 s")
            time.sleep(0.2)
        request_drain(run_dir, rank=rank)

    return during


def _first(events: List[dict], kind: str) -> Dict[str, Any]:
    return next((e for e in events if e.get("event") == kind), {})


def bench_recovery_megatron_lm(steps: int = 12, run_dir: str = "runs/bench-recovery-megatron-lm") -> Dict[str, Any]:
    import importlib.util

    try:  # found, not imported: on Python 3.11 it imports only behind pitstop's shim (patches/py311.py)
        found = importlib.util.find_spec("megatron.training") is not None
    except ImportError:
        found = False
    if not found:
        raise PitstopError("--framework megatron-lm needs megatron-core 0.19 with megatron.training: run it with the "
                           "second lane's interpreter (make venv-lm; .venv-lm/bin/python -m pitstop.cli ...)")
    if steps < 8:
        raise PitstopError(f"--steps {steps}: the Megatron-LM bench kills at step 6 and restarts from step 4; "
                           "expected at least 8")
    base = Path(run_dir) / time.strftime("%Y%m%d-%H%M%S")
    runs: Dict[str, Tuple[int, str, List[dict]]] = {}
    runs["reference"] = launch(base / "reference", steps, standby=0)
    if runs["reference"][0] != 0:
        raise PitstopError(f"the reference run failed (exit {runs['reference'][0]}):\n{runs['reference'][1][-3000:]}")
    ckpt = base / "restart-ckpt"
    runs["restart"] = launch(base / "restart", steps, standby=0, fault=KILL.spec(), restarts=1,
                             extra=("--save", str(ckpt), "--load", str(ckpt), "--save-interval", "4"))
    # the default: the standby warms up in the sandbox (held for after step 1) before the kill
    runs["unplanned"] = launch(base / "unplanned", steps, standby=1, fault=KILL.spec(), warmup=True)
    runs["unplanned_cold"] = launch(base / "unplanned-cold", steps, standby=1, fault=KILL.spec())
    runs["planned"] = launch(base / "planned", steps, standby=1, during=drain_at_once(2))

    ref_losses, ref_sums, ms = parse(logs_of(base / "reference"))
    steady = statistics.median(v for k, v in ms.items() if k > 2) / 1000.0
    dirs = {"unplanned": "unplanned", "unplanned_cold": "unplanned-cold", "planned": "planned"}
    got = {k: parse(logs_of(base / d)) for k, d in dirs.items()}
    rep, drn, rst = _first(runs["unplanned"][2], "replaced"), _first(runs["planned"][2], "drained"), \
        _first(runs["restart"][2], "restarted")
    cold = _first(runs["unplanned_cold"][2], "replaced")
    warmed = _first(runs["unplanned"][2], "warmed")
    # true only if each replacement and the drain happened, and each run matched the reference
    identical = bool(rep) and bool(cold) and bool(drn) and all(
        runs[k][0] == 0 and got[k][0] == ref_losses and got[k][1] == ref_sums for k in dirs)
    restart_sums = parse(logs_of(base / "restart", "logs/*-e1/*/*/*/std*.log"))[1]
    baseline_s, unplanned_s = rst.get("downtime_s"), rep.get("downtime_s")
    return {
        "framework": "megatron-lm",
        "baseline_restart_s": baseline_s,
        "unplanned_s": unplanned_s,
        "planned_pause_s": drn.get("pause_s"),
        "steady_iteration_s": round(steady, 4),
        "ratio_unplanned": None if not (baseline_s and unplanned_s) else round(unplanned_s / baseline_s, 4),
        "loss_identical": identical,
        "unplanned_warm": rep.get("warm"),
        "unplanned_cold_s": cold.get("downtime_s"),
        "warmup": {"ok": warmed.get("ok"), "standby_rss_bytes": warmed.get("rss_bytes"),
                   "classes": [{k: c.get(k) for k in ("cls", "seconds", "ops", "local_checked", "local_equal")}
                               for c in warmed.get("classes", [])]},
        "breakdown": {
            "unplanned": {k: rep.get(k) for k in ("detect_s", "plan_s", "groups_s", "state_s", "first_step_s",
                                                  "joiner_built_s", "joiner_attach_wait_s", "swapped", "stale_refs")},
            "unplanned_cold": {k: cold.get(k) for k in ("detect_s", "groups_s", "state_s", "first_step_s",
                                                        "joiner_built_s")},
            "planned": {k: drn.get(k) for k in ("step", "prepare_s", "pause_s", "groups_s", "state_s", "first_step_s",
                                                "swapped", "stale_refs")},
            "restart": {"resume_step": _first(runs["restart"][2], "fallback").get("resume_step"),
                        "checksums_identical": runs["restart"][0] == 0 and restart_sums == ref_sums},
        },
        "exit_codes": {k: v[0] for k, v in runs.items()},
        "job": "world 8 (tp2 pp2 dp2) Megatron-LM pretrain (examples/pretrain_gpt.py) on CPU/gloo, distributed optimizer, "
               "overlapped grad reduce and param gather, dropout 0.1; 1 standby, warmed in the sandbox (and, side by side, a cold one); "
               "kill rank 5 at step 6 (backward); drain rank 2; baseline: Megatron-LM's --save/--load restart from step 4",
        "run_dir": str(base),
    }
