"""Synthetic traces of Megatron's 1F1B schedule, for tests and benchmarks before capture.

Pure. The op order follows ``forward_backward_pipelining_without_interleaving``:
``pp - stage - 1`` warmup forwards, then one-forward-one-backward, then the
cooldown backwards; a send paired with a recv (``send_forward_recv_backward``) is
a send followed by a recv (sends are eager in the replay, so no deadlock). After
the schedule: the data-parallel gradient all-reduce, the embedding all-reduce of
the first and last stages (pp > 1), and the optimizer step.
"""

from __future__ import annotations

from typing import List

from pitstop.emulation.graph import Comm, Compute, Op, RoleClass, Trace, stage_kind


def one_f_one_b(
    pp: int,
    stage: int,
    microbatches: int,
    fwd_s: float,
    bwd_s: float,
    act_bytes: int,
    grad_bytes: int,
    tp_bytes: int = 0,
    optim_s: float = 0.0,
    embd_bytes: int = 0,
) -> List[Op]:
    """One iteration of ``stage``'s 1F1B schedule. ``tp_bytes > 0`` splits each forward
    and backward in two halves around a ``tp`` all-reduce of that size."""
    first, last = stage == 0, stage == pp - 1
    ops: List[Op] = []

    def fwd(mb: int) -> None:
        if tp_bytes:
            ops.extend([Compute(fwd_s / 2, f"F{mb}"), Comm("all_reduce", "tp", tp_bytes), Compute(fwd_s / 2, f"F{mb}")])
        else:
            ops.append(Compute(fwd_s, f"F{mb}"))

    def bwd(mb: int) -> None:
        if tp_bytes:
            ops.extend([Compute(bwd_s / 2, f"B{mb}"), Comm("all_reduce", "tp", tp_bytes), Compute(bwd_s / 2, f"B{mb}")])
        else:
            ops.append(Compute(bwd_s, f"B{mb}"))

    warmup = min(pp - stage - 1, microbatches)
    steady = microbatches - warmup
    for mb in range(warmup):
        if not first:
            ops.append(Comm.recv(act_bytes, -1))
        fwd(mb)
        if not last:
            ops.append(Comm.send(act_bytes, +1))
    if steady and not first:
        ops.append(Comm.recv(act_bytes, -1))
    for k in range(steady):
        fwd(warmup + k)
        if not last:
            ops.extend([Comm.send(act_bytes, +1), Comm.recv(act_bytes, +1)])
        bwd(k)
        if not first:
            ops.append(Comm.send(act_bytes, -1))
            if k < steady - 1:
                ops.append(Comm.recv(act_bytes, -1))
    for k in range(steady, microbatches):
        if not last:
            ops.append(Comm.recv(act_bytes, +1))
        bwd(k)
        if not first:
            ops.append(Comm.send(act_bytes, -1))
    ops.append(Comm("all_reduce", "dp", grad_bytes))
    if embd_bytes and pp > 1 and (first or last):
        ops.append(Comm("all_reduce", "embd", embd_bytes))
    if optim_s:
        ops.append(Compute(optim_s, "optimizer"))
    return ops


def one_f_one_b_traces(pp: int, microbatches: int, iterations: int = 1, **kw) -> List[Trace]:
    """One trace per pipeline stage (class ``RoleClass(kind, stage)``); ``kw`` as :func:`one_f_one_b`."""
    out = []
    for s in range(pp):
        it = tuple(one_f_one_b(pp, s, microbatches, **kw))
        out.append(Trace(s, RoleClass(stage_kind(s, pp), s), (it,) * iterations, source="synthetic 1F1B"))
    return out
