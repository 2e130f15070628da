"""The product of two orthogonal communicators (e.g. tp x dp), :class:`CompositeGroup`.

An all-reduce over it is an all-reduce over the inner group followed by one over the
outer group. A world-spanning Megatron group (the distributed optimizer's grad-stats
group) is built this way, so replacing one role never rebuilds a world-sized
communicator."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from pitstop.errors import GroupError
from pitstop.pg.base import _COMPOSABLE, DoneWork, _op


class CompositeGroup(dist.ProcessGroup):
    """The product of two orthogonal communicators, reduced inner first, then outer (a
    one-element floating-point sum: gathered, and added in a flat group's order).

    ``ranks`` is the member list in Megatron's order; ``inner`` and ``outer`` are the
    two real groups of this rank whose product is exactly ``ranks``. Reductions
    (sum, max, min, product) and barrier are exact compositions; other collectives
    are refused with an error that names the group.
    """

    def __init__(self, ranks: Sequence[int], me: int, inner: dist.ProcessGroup, outer: dist.ProcessGroup, name: str) -> None:
        super().__init__(sorted(ranks).index(me), len(ranks))
        self.inner = inner
        self.outer = outer
        self._name = name
        self.public: Optional[str] = None
        """The stable name c10d knows the group by, once renamed (see :class:`GuardedGroup`)."""
        self._me = me
        self._ranks = sorted(ranks)
        self._order: Optional[List[Tuple[int, int]]] = None
        """(outer rank, inner rank) of each member, by global rank: see :meth:`_sum_as_flat`."""

    def getBackendName(self) -> str:  # noqa: N802
        return "pitstop_composite"

    def shutdown(self) -> None:
        """Destroying a composite leaves its parts alone: the registry owns them."""

    @property
    def group_name(self) -> str:  # c10d's own setter keeps it on backends, which we have none of
        return self.public or self._name

    @property
    def uid(self) -> str:
        return self._name

    def allreduce(self, tensors, opts=None):
        if opts is None:
            opts = dist.AllreduceOptions()
        if _op(opts.reduceOp) not in _COMPOSABLE:
            raise GroupError(f"{self._name}: reduce op {opts.reduceOp} cannot be composed")
        if _op(opts.reduceOp) == dist.ReduceOp.SUM and all(t.numel() == 1 and t.is_floating_point() for t in tensors):
            for t in tensors:
                self._sum_as_flat(t)
            return DoneWork(list(tensors))
        self.inner.allreduce(tensors, opts).wait()
        self.outer.allreduce(tensors, opts).wait()
        return DoneWork(list(tensors))

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every member's ``t`` (one element), as an [outer rank, inner rank] matrix. The buffers
        start as copies of ``t``: a part that is broken (a peer died in this step) leaves them as
        they were, and uninitialised memory made a negative squared norm, whose square root is
        complex in Python, and Megatron's clipping raised on it: a stayer lost in a step that is
        discarded anyway."""
        row = [t.clone() for _ in range(self.inner.size())]
        self.inner.allgather([row], [t]).wait()
        flat = torch.cat([r.reshape(1) for r in row])
        rows = [flat.clone() for _ in range(self.outer.size())]
        self.outer.allgather([rows], [flat]).wait()
        return torch.stack(rows)

    def _member_order(self) -> List[Tuple[int, int]]:
        """(outer rank, inner rank) of each member, by global rank. Arithmetic, no message: every
        member must run the same collectives whatever it has cached (a joiner's first call and a
        stayer's hundredth), or a healthy part would see two different operations. The parts are
        orthogonal slices of one rank grid, so the member at (o, i) is ``inner[i] + outer[o] - me``."""
        inner = [dist.get_global_rank(self.inner, i) for i in range(self.inner.size())]
        outer = [dist.get_global_rank(self.outer, o) for o in range(self.outer.size())]
        grid = sorted((a + b - self._me, (o, i)) for o, b in enumerate(outer) for i, a in enumerate(inner))
        if [g for g, _ in grid] != self._ranks:
            raise GroupError(f"{self._name}: inner {inner} x outer {outer} around rank {self._me} does not make "
                             f"its members {self._ranks}")
        return [oi for _, oi in grid]

    def _sum_as_flat(self, t: torch.Tensor) -> None:
        """A floating-point sum of one element, added up in the order a flat gloo group of the
        same members adds it (its ring accumulates from the highest group rank down to rank 0:
        ``v0 + (v1 + (... + v(n-1)))``), not inner-then-outer.

        Why: the distributed optimizer's grad norm and zero count are one-element sums over
        this group (``intra-dist-opt``). Summed inner-then-outer, the norm differed from
        Megatron's own flat group in its last bit now and then, and with ``--clip-grad`` the
        parameters did too (seen in a 20-step Megatron-LM run: equal to plain torchrun up to
        step 19, a few elements one ulp apart after it). Larger tensors keep the two-step
        reduction: a ring splits them into chunks, each added in an order of its own.
        ``tests/test_pg.py`` checks the order against gloo itself."""
        if self._order is None:
            self._order = self._member_order()
        vals = self._gather(t.reshape(1))
        acc = vals[self._order[-1]].clone()
        for oi in reversed(self._order[:-1]):
            acc = vals[oi] + acc
        t.copy_(acc.reshape(t.shape))

    def barrier(self, opts=None):  # noqa: ARG002
        self.inner.barrier().wait()
        self.outer.barrier().wait()
        return DoneWork()

    def _unsupported(self, what: str):
        raise GroupError(
            f"{what} on composite group {self._name} (size {self.size()}) is not supported: "
            "pitstop composes only reductions and barrier; use the inner/outer groups"
        )

    def broadcast(self, *a, **k):
        self._unsupported("broadcast")

    def allgather(self, *a, **k):
        self._unsupported("allgather")

    def _allgather_base(self, *a, **k):
        self._unsupported("all_gather_into_tensor")

    def reduce_scatter(self, *a, **k):
        self._unsupported("reduce_scatter")

    def _reduce_scatter_base(self, *a, **k):
        self._unsupported("reduce_scatter_tensor")

    def alltoall_base(self, *a, **k):
        self._unsupported("all_to_all_single")

    def all_gather_single(self, *a, **k):
        self._unsupported("all_gather_into_tensor")

    def reduce_scatter_single(self, *a, **k):
        self._unsupported("reduce_scatter_tensor")
