"""The arithmetic of a finished change: from what the controller and the ranks reported to
the ``replaced``, ``drained`` or ``restarted`` event.

A pure function, apart from the controller that reads the reports and writes the event
(:meth:`pitstop.launch.controller.Controller._complete`), so that every number the
benchmarks quote can be checked against hand-made reports::

    controller  fired -> detected -> planned                 (the change, ``ch``)
    stayers     r<k>:  groups_s, state_s, ready, ...          (``timings``)
    joiner      joiner: built_s, attach_wait_s, state_s, ...
    every rank  it<k>: first_iter_s, steady_iter_s            (``iters``)
    workers     the first commit after the change: t_commit, committed_step

    downtime_s   = t_commit - (fired or detected)
    first_step_s = t_commit - the last rank's ready
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

def change_event(ch: Dict[str, Any], timings: Dict[str, Dict[str, Any]], iters: Dict[int, Dict[str, Any]],
                 t_commit: Optional[float], committed_step: Optional[int]) -> Tuple[str, Dict[str, Any]]:
    """``(event name, fields)`` of the finished change ``ch``: a ``replaced`` event for an
    ``unplanned`` change, ``drained`` for a ``planned`` one, ``restarted`` for a ``restart``.

    ``timings`` maps ``r<k>`` (stayers), ``joiner`` and ``leaver`` to their reports;
    ``iters`` maps a rank to its first-iteration report; ``t_commit`` and ``committed_step``
    are the first commit after the change (None when the job ended before one)."""
    g = ch["generation"]
    stayers = [v for k, v in timings.items() if k.startswith("r")]
    ready = max([v.get("ready", 0) for v in timings.values()] or [t_commit or 0.0])

    def after(t0: float) -> Optional[float]:
        return None if t_commit is None else round(t_commit - t0, 4)

    ev: Dict[str, Any] = {"role": ch.get("role"), "roles": ch.get("roles", [ch.get("role")]),
                          "generation": g, "step": ch["step"],
                          "old": ch.get("old"), "new": ch.get("new"),
                          "swapped": sum(v.get("swapped", 0) for v in stayers),
                          "stale_refs": sum(v.get("stale", 0) for v in stayers)}
    if iters:  # the joiner's first iteration against the stayers' steady one (same step, same job)
        steady = sorted(v["steady_iter_s"] for r, v in iters.items() if r != ch.get("role") and v.get("steady_iter_s"))
        first = iters.get(ch.get("role"), {}).get("first_iter_s")
        ev.update(first_iter_s=first, steady_iter_s=steady[len(steady) // 2] if steady else None,
                  warm=ch.get("warm"))
    joiner = timings.get("joiner", {})
    if ch["kind"] == "unplanned":
        start = ch["fired"] or ch["detected"]
        ev.update(
            detect_s=None if ch["fired"] is None else round(ch["detected"] - ch["fired"], 4),
            plan_s=round(ch["planned"] - ch["detected"], 4),
            groups_s=round(max([v.get("groups_s", 0) for v in stayers] or [0]), 4),
            state_s=round(max([v.get("state_s", 0) for v in stayers] + [joiner.get("state_s", 0)]), 4),
            first_step_s=after(ready),
            downtime_s=after(start),
            # the steps the stayers threw away and ran again (their report; with async_commit one
            # more than the window: the step run while the vote was in flight), else from the first
            # discarded step to the first commit after it
            steps_redone=max(v["discarded"] for v in stayers if "discarded" in v)
            if any("discarded" in v for v in stayers) else
            None if t_commit is None or committed_step is None else int(committed_step) - ch["step"] + 1,
            rebuilt=max([v.get("rebuilt", 0) for v in stayers] or [0]),
            # the joiner built its model while its groups rendezvoused; then it waited this long for them
            joiner_built_s=joiner.get("built_s"),
            joiner_attach_wait_s=joiner.get("attach_wait_s"),
            ranks_rebuilding=sum(1 for v in stayers if v.get("groups_s", 0) and v.get("rebuilt")),
            reason=ch["reason"],
        )
        return "replaced", ev
    if ch["kind"] == "planned":
        ev.update(
            prepare_s=None if ch.get("ready_at") is None else round(ch["ready_at"] - ch["requested"], 4),
            pause_s=joiner.get("pause_s"),
            groups_s=round(max([v.get("switch_s", 0) for v in stayers] or [0]), 4),
            state_s=joiner.get("recv_s"),
            first_step_s=after(ready),
        )
        return "drained", ev
    start = ch["fired"] or ch["detected"]
    ev.update(downtime_s=after(start), reason=ch["reason"])
    return "restarted", ev
