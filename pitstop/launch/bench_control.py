"""``pitstop bench control``: a running job under a stream of junk on every control key.

The fuzzer is what a process on the same machine can do that knows the store's
address but not the job token: write random, truncated, oversized and wrong-type
values, and replay sealed values it read, onto every key name of
:mod:`pitstop.runtime.keys`. The job must finish bitwise identical to an
uninterrupted run and still replace a rank killed meanwhile; every junk message
that anybody read must have been refused.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional

from pitstop.runtime import keys

log = logging.getLogger(__name__)


def _junk(rng: random.Random, stolen: List[bytes]) -> bytes:
    kind = rng.randrange(8)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))      # random bytes
    if kind == 1:
        return b"ps1." + bytes(rng.choice(b"0123456789abcdef") for _ in range(rng.randrange(0, 70)))  # truncated envelope
    if kind == 2:
        return b"x" * (300 * 1024)                                                  # oversized
    if kind == 3:                                                                   # wrong type, unsigned
        return json.dumps(rng.choice([[1, 2], "ok", 7, None, {"role": "5"}, {"n": -1}, {"fallback": True}])).encode()
    if kind == 4:                                                                   # the old plain protocol
        return rng.choice([b"1", b"ok", b"switch", b"0:5:1.0", b'{"role": 0, "generation": 1, "mode": "recover"}'])
    if kind == 5 and stolen:                                                        # a sealed value, replayed elsewhere
        return rng.choice(stolen)
    if kind == 6 and stolen:                                                        # a sealed value, truncated
        s = rng.choice(stolen)
        return s[: rng.randrange(1, max(2, len(s)))]
    return b"ps1." + b"0" * 64 + b"." + json.dumps({"role": 0, "generation": 1, "mode": "recover"}).encode()  # forged MAC


def fuzz_store(host: str, port: int, seconds: float, seed: int = 0, period_s: float = 0.05,
               stop: Optional[threading.Event] = None) -> Dict[str, int]:
    """Write junk onto every key of ``keys.all_patterns()`` for ``seconds`` (bounded, then stops).

    Values already in the store are read first and replayed onto other keys, or back
    onto their own key later (a stale heartbeat). Returns how many writes of each kind."""
    import torch.distributed as dist

    st = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    rng = random.Random(seed)
    names = keys.all_patterns()
    stolen: List[bytes] = []
    counts = {"writes": 0, "replays": 0, "rounds": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        try:
            for k in rng.sample(names, min(len(names), 40)):
                if st.check([k]):
                    v = st.get(k)
                    if v.startswith(b"ps1.") and len(stolen) < 200:
                        stolen.append(bytes(v))
                v = _junk(rng, stolen)
                if v in stolen:
                    counts["replays"] += 1
                st.set(k, v)
                counts["writes"] += 1
        except (RuntimeError, OSError) as exc:  # DistNetworkError: the job ended and its store with it
            counts["store_gone"] = 1
            log.info("fuzzer: the store went away after %d writes: %s", counts["writes"], str(exc).splitlines()[0])
            break
        counts["rounds"] += 1
        time.sleep(period_s)
    return counts


def bench_control(run_dir: str = "runs/bench-control", steps: int = 10, fuzz_s: float = 60.0) -> Dict:
    """One world-8 job with a standby, a SIGKILL at step 4 and the fuzzer running; against an
    uninterrupted run of the same job."""
    from pitstop.launch.runs import run_job, wait_for_event
    from pitstop.runtime.faults import Fault

    root = Path(run_dir)
    ref = run_job(root / "reference", steps)
    counts: Dict[str, int] = {}

    def during(rd: Path) -> None:
        wait_for_event(rd, "roster")
        info = json.loads((rd / "controller.json").read_text())
        counts.update(fuzz_store(info["host"], info["port"], fuzz_s, seed=1))

    fault = Fault.kill(rank=5).at(step=4, phase="backward")
    res = run_job(root / "fuzzed", steps, standby=1, faults=fault.spec(), during=during,
                  launch_args=["--hold-for-warm", "30"])
    replaced = [e for e in res.of("replaced") if e.get("role") == 5]
    same = (res.code == 0 and ref.code == 0 and len(res.losses) == steps
            and all(res.losses.get(s) == ref.losses.get(s) for s in range(1, steps + 1))
            and res.checksums == ref.checksums)
    refused = res.of("refused")
    return {"bench": "control", "fuzz": {
        "messages": counts.get("writes", 0), "replays": counts.get("replays", 0),
        "refused": len(refused), "refused_keys": len({e["key"] for e in refused}),
        "job_ok": bool(same and replaced), "replaced": len(replaced),
        "loss_identical": bool(same), "exit_code": res.code}}
