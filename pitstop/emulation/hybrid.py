"""The hybrid oracle: real members exchange real data, virtual members' data is synthesised.

In emulation a few processes (the *real ranks*) run the real program in a world of N;
every other rank is virtual. Every group is a :class:`~pitstop.virtual.VirtualGroup`
answered by a :class:`HybridOracle`. For each operation the oracle:

* exchanges the real members' inputs over a real gloo communicator of just those
  members (the group's *sub-communicator*, created on the group's first operation:
  every real member issues the same operations in the same order, so lazy creation
  is collective-safe; point-to-point traffic uses a 2-member gloo group per pair);
* asks :class:`Contributions` what each virtual member contributes;
* computes this process's output from both, exactly as a fully real run would if the
  virtual members had contributed those values::

    group dp = [0, 1, 2, 3], real {0, 2}         all_reduce(SUM) on rank 0
      real 0 ----- gloo [0, 2] ----- real 2       x0 + x2            (real, exchanged)
      virtual 1, 3: contributions.combined(...)   + c1 + c3          (synthesised)

With one real member in a group nothing is exchanged and no communicator is created
(the warmup sandbox's case, every peer virtual).

What a virtual member contributes to the caller (``Contributions.contribution``):
its input tensor number ``index`` of the operation for all-reduce, reduce, the
all-gathers, gather and a broadcast from it; the chunk of its input addressed to the
caller (``group.rank()``) for reduce-scatter, all-to-all and a scatter from it; what it
sends for a recv. ``like`` has the answer's shape, dtype and device and holds what the
caller itself contributes at that place (its input; its own chunk for itself in a
reduce-scatter; its chunk addressed to that peer in an all-to-all, zeros when the
shapes differ; its own buffer for a broadcast or scatter from a virtual root; zeros
for a recv).

Floating-point reductions fold the real members in group order, then the virtual
contributions; a real backend reduces in another order, so results are bit-exact
with a real run when the values add exactly (integers, small multiples), and within
rounding otherwise.

A send to a real peer is posted asynchronously from a copy: gloo's send waits for the
matching recv, and a virtual group's operation must return completed work (two
pipeline stages that both send first would deadlock otherwise). :meth:`HybridOracle.close`
waits for what is still in flight. ``recv_anysource`` is refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from pitstop.errors import HybridError  # noqa: F401 - re-exported (pitstop.emulation.hybrid.HybridError)

R = dist.ReduceOp
T = torch.Tensor
Ts = List[torch.Tensor]


def members(group) -> List[int]:
    """The group's global ranks in group-rank order (the default group lists none: 0..size-1)."""
    return list(group.ranks) if group.ranks else list(range(group.size()))


def _where(group, what: str) -> str:
    return f"{what} on group {getattr(group, 'group_name', group.kind)!r} (kind {group.kind}, size {group.size()})"


# --------------------------------------------------------------------------- reductions
_REDUCTIONS: Dict[object, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    R.SUM: torch.add, R.MAX: torch.maximum, R.MIN: torch.minimum, R.PRODUCT: torch.mul,
    R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor,
}


def _reduce_op(group, what: str, opts) -> "R.RedOpType":
    op = getattr(opts, "reduceOp", R.SUM) if opts is not None else R.SUM
    op = getattr(op, "op", op)  # a ReduceOp wraps its RedOpType
    if op != R.AVG and op not in _REDUCTIONS:
        raise HybridError(f"{_where(group, what)}: reduce op {op} is not supported "
                          "(SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR are)")
    return op


def combine(op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (op) b``, out of place (AVG folds as SUM; the caller divides)."""
    return _REDUCTIONS[R.SUM if op == R.AVG else op](a, b)


def _fold(op, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    acc = parts[0]
    for p in parts[1:]:
        acc = combine(op, acc, p)
    return acc


# --------------------------------------------------------------------------- contributions
class Contributions:
    """What virtual members contribute (see the module docstring for ``like`` and ``index``)."""

    def contribution(self, group, what: str, rank: int, like: torch.Tensor, index: int) -> torch.Tensor:
        """The tensor virtual global rank ``rank`` contributes to the caller in ``what`` on ``group``."""
        raise NotImplementedError

    def combined(self, group, what: str, ranks: Sequence[int], like: T, index: int, op) -> Optional[T]:
        """The reduction (``op``; SUM for AVG) of the contributions of virtual ``ranks``, None if
        there are none. Folds one at a time, so 8191 virtual peers never sit in memory at once."""
        acc = None
        for v in ranks:
            c = self.contribution(group, what, v, like, index)
            acc = c if acc is None else combine(op, acc, c)
        return acc


class MirrorContributions(Contributions):
    """Every virtual member contributes a copy of ``like`` (what the caller contributes itself).

    Correctly shaped data that keeps control-path values sane: a SUM all-reduce of a
    grad-norm square gives ``size * local`` (never NaN), a MAX of found-inf flags stays
    the local flag. A recv from a virtual pipeline peer gets zeros (``like`` is zeros
    there): receive buffers are usually uninitialised, and zero activations and
    gradients keep the step finite. With several real members in a group each mirrors
    its own input, so their results differ where a real run's would agree.
    """

    def contribution(self, group, what: str, rank: int, like: torch.Tensor, index: int) -> torch.Tensor:  # noqa: ARG002
        return like.clone()

    def combined(self, group, what: str, ranks: Sequence[int], like: T, index: int, op) -> Optional[T]:  # noqa: ARG002
        """Closed forms (``n * like`` for SUM; for floats it may differ in the last bit from n
        additions): O(1) instead of one pass per virtual member."""
        n = len(ranks)
        if n == 0:
            return None
        if like.dtype == torch.bool or op in (R.MAX, R.MIN, R.BAND, R.BOR):
            return like.clone()
        if op in (R.SUM, R.AVG):
            return like * n
        if op == R.PRODUCT:
            return like.pow(n)
        return like.clone() if n % 2 else torch.zeros_like(like)  # BXOR


Key = Tuple[Union[str, Tuple[int, ...]], int, int]


class RecordedContributions(Contributions):
    """Given tensors, keyed ``(group kind or tuple of its global ranks, op sequence index, virtual rank)``.

    The op sequence index counts every operation of that group, from 0 (the group's
    ``ops`` when the operation is served). A value is the tensor, or a list indexed by
    ``index`` (coalesced operations). Lets a hybrid run reproduce a fully real one.
    """

    def __init__(self, mapping: Mapping[Key, Union[torch.Tensor, Sequence[torch.Tensor]]]) -> None:
        self.mapping = dict(mapping)

    def contribution(self, group, what: str, rank: int, like: torch.Tensor, index: int) -> torch.Tensor:
        seq = getattr(group, "ops", 0)
        keys = [(group.kind, seq, rank), (tuple(members(group)), seq, rank)]
        val = next((self.mapping[k] for k in keys if k in self.mapping), None)
        if val is None:
            raise HybridError(f"{_where(group, what)}: no recorded contribution of virtual rank {rank} "
                              f"to operation #{seq} (keys {keys})")
        if not isinstance(val, torch.Tensor):
            if index >= len(val):
                raise HybridError(f"{_where(group, what)} #{seq}: virtual rank {rank} has {len(val)} "
                                  f"recorded tensor(s), tensor {index} is needed")
            val = val[index]
        if val.shape != like.shape or val.dtype != like.dtype:
            raise HybridError(
                f"{_where(group, what)} #{seq}: virtual rank {rank}'s recorded tensor {index} is "
                f"{list(val.shape)} {val.dtype}, the operation needs {list(like.shape)} {like.dtype}"
            )
        return val.to(like.device)


# --------------------------------------------------------------------------- the oracle
@dataclass
class _Op:
    """One operation as the oracle sees it."""

    group: object
    what: str
    ranks: List[int]  # global ranks, group order
    me: int  # my group rank
    real: List[int]  # group ranks of the real members, ascending (me among them)
    oracle: "HybridOracle"

    @property
    def alone(self) -> bool:
        """No other real member: nothing to exchange."""
        return len(self.real) == 1

    @cached_property
    def sub(self) -> Optional[dist.ProcessGroup]:
        """The real members' communicator (None when I am alone), made on first use: point-to-point
        never asks for it, so a send does not wait for real members that are not its peer."""
        return self.oracle._sub(self.group, self.ranks, self.real) if len(self.real) > 1 else None

    @property
    def virtual(self) -> List[int]:
        return [g for g in range(len(self.ranks)) if g not in self.real]

    def vglobal(self, gs: Sequence[int]) -> List[int]:
        return [self.ranks[g] for g in gs]

    def where(self) -> str:
        return _where(self.group, self.what)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


class HybridOracle:
    """Serves virtual groups in which ``real_ranks`` run real processes (this one is ``me``).

    ``store`` is shared by the real processes (rendezvous of the real communicators);
    ``contributions`` synthesises the virtual members' data. Call :meth:`close` at the
    end to finish pending sends and destroy the communicators it made.
    """

    def __init__(self, real_ranks: Sequence[int], me: int, store: dist.Store, contributions: Contributions,
                 timeout: timedelta = timedelta(minutes=5), prefix: str = "pitstop-hybrid") -> None:
        self.real = frozenset(real_ranks)
        if me not in self.real:
            raise HybridError(f"rank {me} is not among the real ranks {sorted(self.real)}")
        self.me = me
        self.store = store
        self.contributions = contributions
        self.timeout = timeout
        self.prefix = prefix
        self.comms: Dict[str, dist.ProcessGroup] = {}
        """Real gloo communicators made so far, by name (none while every peer is virtual)."""
        self._sending: List[Tuple[dist.Work, torch.Tensor]] = []

    # ----------------------------------------------------------------- plumbing
    def serve(self, group, what: str, args: tuple) -> None:
        handler = _HANDLERS.get(what)
        if handler is None:
            raise HybridError(f"{_where(group, what)}: the hybrid oracle does not emulate {what!r}")
        self._reap()
        handler(self, self._op(group, what), *args)

    def _op(self, group, what: str) -> _Op:
        ranks = members(group)
        me = group.rank()
        if ranks[me] != self.me:
            raise HybridError(f"{_where(group, what)}: group rank {me} is global rank {ranks[me]}, "
                              f"this process is rank {self.me}")
        real = [g for g, r in enumerate(ranks) if r in self.real]
        return _Op(group, what, ranks, me, real, self)

    def _sub(self, group, ranks: List[int], real: List[int]) -> dist.ProcessGroup:
        glob = [ranks[g] for g in real]
        digest = hashlib.sha1(",".join(map(str, glob)).encode()).hexdigest()[:10]
        return self._comm(f"{self.prefix}:{getattr(group, 'group_name', group.kind)}:{digest}", glob)

    def _pair(self, op: _Op, peer: int) -> Tuple[dist.ProcessGroup, int]:
        """The 2-member communicator of me and group rank ``peer``, and the peer's rank in it."""
        pair = sorted((self.me, op.ranks[peer]))
        name = f"{self.prefix}:{getattr(op.group, 'group_name', op.group.kind)}:p2p:{pair[0]}-{pair[1]}"
        return self._comm(name, pair), pair.index(op.ranks[peer])

    def _comm(self, name: str, ranks: List[int]) -> dist.ProcessGroup:
        pg = self.comms.get(name)
        if pg is not None:
            return pg
        try:
            pg, _ = c10d._new_process_group_helper(
                len(ranks), ranks.index(self.me), ranks, "gloo", dist.PrefixStore(name, self.store), name,
                timeout=self.timeout, group_desc="hybrid",
            )
        except Exception as exc:  # gloo reports a peer that never came as a generic error
            raise HybridError(f"creating real communicator {name} over ranks {ranks} failed: {exc}") from exc
        if pg is c10d.GroupMember.NON_GROUP_MEMBER:
            raise HybridError(f"creating {name} over ranks {ranks}: the default group says "
                              f"this process is not rank {self.me}")
        c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
        self.comms[name] = pg
        return pg

    def _reap(self) -> None:
        """Forget finished sends (raising a failed one's error)."""
        keep = []
        for work, buf in self._sending:
            if work.is_completed():
                work.wait()
            else:
                keep.append((work, buf))
        self._sending = keep

    def close(self) -> None:
        """Wait for pending sends, then destroy the real communicators."""
        for work, _ in self._sending:
            work.wait()
        self._sending = []
        for pg in self.comms.values():
            if pg in c10d._world.pg_map:
                dist.destroy_process_group(pg)
        self.comms.clear()

    # ----------------------------------------------------------------- real exchange
    def _allgather(self, op: _Op, t: torch.Tensor) -> Dict[int, torch.Tensor]:
        """Every real member's ``t``, by group rank."""
        if op.alone:
            return {op.me: t}
        parts = [torch.empty_like(_cpu(t)) for _ in op.real]
        op.sub.allgather([parts], [_cpu(t)]).wait()
        return {g: p.to(t.device) for g, p in zip(op.real, parts)}

    def _alltoall(self, op: _Op, send: Dict[int, T], like: Dict[int, T]) -> Dict[int, T]:
        """Send ``send[g]`` to each real member g; receive a ``like[g]``-shaped tensor from each."""
        if op.alone:
            return {op.me: send[op.me]}
        src = torch.cat([_cpu(send[g]).reshape(-1) for g in op.real])
        dst = torch.empty(sum(like[g].numel() for g in op.real), dtype=src.dtype)
        op.sub.alltoall_base(dst, src, [like[g].numel() for g in op.real], [send[g].numel() for g in op.real],
                             dist.AllToAllOptions()).wait()
        parts = dst.split([like[g].numel() for g in op.real])
        return {g: p.view(like[g].shape).to(like[g].device) for g, p in zip(op.real, parts)}

    def _contribution(self, op: _Op, g: int, like: torch.Tensor, index: int) -> torch.Tensor:
        return self.contributions.contribution(op.group, op.what, op.ranks[g], like, index)

    # ----------------------------------------------------------------- reductions
    def _reduced(self, op: _Op, redop, real: Dict[int, torch.Tensor], like: torch.Tensor, index: int) -> torch.Tensor:
        """The reduction over every member: the real parts, then the virtual contributions."""
        acc = _fold(redop, [real[g] for g in op.real])
        virt = self.contributions.combined(op.group, op.what, op.vglobal(op.virtual), like, index, redop)
        if virt is not None:
            acc = combine(redop, acc, virt)
        if redop == R.AVG:
            if not acc.is_floating_point() and not acc.is_complex():
                raise HybridError(f"{op.where()}: AVG of {acc.dtype} is not supported")
            acc = acc / len(op.ranks)
        return acc

    def allreduce(self, op: _Op, tensors: List[torch.Tensor], opts=None) -> None:
        redop = _reduce_op(op.group, op.what, opts)
        for i, t in enumerate(tensors):
            if t.is_sparse:
                raise HybridError(f"{op.where()}: sparse tensor {i} ({list(t.shape)}) is not supported")
            res = self._reduced(op, redop, self._allgather(op, t), t, i)
            with torch.no_grad():
                t.copy_(res)

    def reduce(self, op: _Op, tensors: List[torch.Tensor], opts) -> None:
        """Only the root's buffer changes (gloo leaves partial sums in others; callers may not rely on them)."""
        redop = _reduce_op(op.group, op.what, opts)
        root = self._root(op, opts)
        if root not in op.real:
            return  # only a virtual root receives anything
        for i, t in enumerate(tensors):
            real = self._gather_to(op, root, t)
            if op.me == root:
                with torch.no_grad():
                    t.copy_(self._reduced(op, redop, real, t, i))

    def reduce_scatter(self, op: _Op, outputs: Ts, input_lists: List[Ts], opts=None) -> None:
        redop = _reduce_op(op.group, op.what, opts)
        for i, (out, ins) in enumerate(zip(outputs, input_lists)):
            self._size(op, len(ins), "input list")
            self._reduce_scatter_one(op, redop, out, list(ins), i)

    def _reduce_scatter_base(self, op: _Op, out: torch.Tensor, inp: torch.Tensor, opts=None) -> None:
        redop = _reduce_op(op.group, op.what, opts)
        self._reduce_scatter_one(op, redop, out, self._chunks(op, inp, out), 0)

    def reduce_scatter_tensor_coalesced(self, op: _Op, outputs: Ts, inputs: Ts, opts=None) -> None:
        redop = _reduce_op(op.group, op.what, opts)
        for i, (out, inp) in enumerate(zip(outputs, inputs)):
            self._reduce_scatter_one(op, redop, out, self._chunks(op, inp, out), i)

    def _reduce_scatter_one(self, op: _Op, redop, out: torch.Tensor, chunks: List[torch.Tensor], index: int) -> None:
        real = self._alltoall(op, {g: chunks[g] for g in op.real}, {g: out for g in op.real})
        with torch.no_grad():
            out.copy_(self._reduced(op, redop, real, chunks[op.me], index))

    # ----------------------------------------------------------------- gathers
    def allgather(self, op: _Op, output_lists: List[Ts], inputs: Ts, opts=None) -> None:  # noqa: ARG002
        for i, (outs, inp) in enumerate(zip(output_lists, inputs)):
            self._size(op, len(outs), "output list")
            self._gather_into(op, list(outs), inp, i)

    def allgather_coalesced(self, op: _Op, output_lists: List[Ts], inputs: Ts, opts=None) -> None:  # noqa: ARG002
        """``output_lists[g][i]`` receives member g's ``inputs[i]``."""
        self._size(op, len(output_lists), "output list")
        for i, inp in enumerate(inputs):
            self._gather_into(op, [outs[i] for outs in output_lists], inp, i)

    def _allgather_base(self, op: _Op, out: torch.Tensor, inp: torch.Tensor, opts=None) -> None:  # noqa: ARG002
        self._gather_into(op, self._chunks(op, out, inp), inp, 0)

    def allgather_into_tensor_coalesced(self, op: _Op, outputs: Ts, inputs: Ts, opts=None) -> None:  # noqa: ARG002
        for i, (out, inp) in enumerate(zip(outputs, inputs)):
            self._gather_into(op, self._chunks(op, out, inp), inp, i)

    def _gather_into(self, op: _Op, outs: List[torch.Tensor], inp: torch.Tensor, index: int) -> None:
        real = self._allgather(op, inp)
        self._fill(op, outs, real, inp, index)

    def _fill(self, op: _Op, outs: Ts, real: Dict[int, T], like: T, index: int) -> None:
        with torch.no_grad():
            for g, o in enumerate(outs):
                o.copy_(real[g] if g in real else self._contribution(op, g, like, index))

    def gather(self, op: _Op, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts) -> None:
        root = self._root(op, opts)
        if root not in op.real:
            return
        for i, inp in enumerate(inputs):
            real = self._gather_to(op, root, inp)
            if op.me == root:
                self._size(op, len(outputs[i]), "gather list")
                self._fill(op, list(outputs[i]), real, inp, i)

    def _gather_to(self, op: _Op, root: int, t: torch.Tensor) -> Dict[int, torch.Tensor]:
        """Every real member's ``t`` at the (real) root, by group rank; {} elsewhere."""
        if op.alone:
            return {op.me: t}
        mine = op.me == root
        parts = [torch.empty_like(_cpu(t)) for _ in op.real] if mine else []
        opts = dist.GatherOptions()
        opts.rootRank = op.real.index(root)
        op.sub.gather([parts] if mine else [], [_cpu(t)], opts).wait()
        return {g: p.to(t.device) for g, p in zip(op.real, parts)}

    # ----------------------------------------------------------------- one to all
    def broadcast(self, op: _Op, tensors: List[torch.Tensor], opts) -> None:
        root = self._root(op, opts)
        for i, t in enumerate(tensors):
            if root not in op.real:
                val = self._contribution(op, root, t, i)
            elif op.alone:
                continue
            else:
                val = _cpu(t) if op.me == root else torch.empty_like(_cpu(t))
                bopts = dist.BroadcastOptions()
                bopts.rootRank = op.real.index(root)
                op.sub.broadcast([val], bopts).wait()
                if op.me == root:
                    continue
            with torch.no_grad():
                t.copy_(val)

    def scatter(self, op: _Op, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts) -> None:
        root = self._root(op, opts)
        for i, out in enumerate(outputs):
            if root not in op.real:
                val = self._contribution(op, root, out, i)
            elif op.alone:
                self._size(op, len(input_lists[i]), "scatter list")
                val = input_lists[i][op.me]
            else:
                mine = op.me == root
                if mine:
                    self._size(op, len(input_lists[i]), "scatter list")
                val = torch.empty_like(_cpu(out))
                sopts = dist.ScatterOptions()
                sopts.rootRank = op.real.index(root)
                op.sub.scatter([val], [[_cpu(input_lists[i][g]) for g in op.real]] if mine else [], sopts).wait()
            with torch.no_grad():
                out.copy_(val)

    # ----------------------------------------------------------------- all to all
    def alltoall(self, op: _Op, outputs: Ts, inputs: Ts, opts=None) -> None:  # noqa: ARG002
        self._size(op, len(outputs), "output list")
        self._size(op, len(inputs), "input list")
        self._alltoall_into(op, list(outputs), list(inputs))

    def alltoall_base(self, op: _Op, out: T, inp: T, out_splits: List[int], in_splits: List[int],
                      opts=None) -> None:  # noqa: ARG002
        self._alltoall_into(op, self._rows(op, out, out_splits, "output"), self._rows(op, inp, in_splits, "input"))

    def _alltoall_into(self, op: _Op, outs: List[torch.Tensor], ins: List[torch.Tensor]) -> None:
        real = self._alltoall(op, {g: ins[g] for g in op.real}, {g: outs[g] for g in op.real})
        with torch.no_grad():
            for g, o in enumerate(outs):
                if g in real:
                    o.copy_(real[g])
                else:
                    mirror = ins[g] if ins[g].shape == o.shape and ins[g].dtype == o.dtype else torch.zeros_like(o)
                    o.copy_(self._contribution(op, g, mirror, 0))

    # ----------------------------------------------------------------- point to point
    def send(self, op: _Op, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> None:
        """To a virtual peer: done. To a real one: sent asynchronously from a copy (a gloo send
        waits for the matching recv, and the caller expects a completed operation)."""
        self._peer(op, dst)
        if dst in op.real:
            pair, peer = self._pair(op, dst)
            bufs = [_cpu(t).clone() for t in tensors]
            self._sending.append((pair.send(bufs, peer, tag), bufs[0]))

    def recv(self, op: _Op, tensors: List[torch.Tensor], src: int, tag: int = 0) -> None:
        self._peer(op, src)
        if src in op.real:
            pair, peer = self._pair(op, src)
            bufs = [torch.empty_like(_cpu(t)) for t in tensors]
            pair.recv(bufs, peer, tag).wait()
        else:
            bufs = [self._contribution(op, src, torch.zeros_like(t), i) for i, t in enumerate(tensors)]
        with torch.no_grad():  # a pipeline recv buffer may be a leaf that requires grad
            for t, b in zip(tensors, bufs):
                t.copy_(b)

    def barrier(self, op: _Op, opts=None) -> None:  # noqa: ARG002
        if not op.alone:
            op.sub.barrier().wait()

    # ----------------------------------------------------------------- checks
    def _size(self, op: _Op, n: int, what: str) -> None:
        if n != len(op.ranks):
            raise HybridError(f"{op.where()}: the {what} has {n} tensor(s), the group has {len(op.ranks)} members")

    def _root(self, op: _Op, opts) -> int:
        root = int(getattr(opts, "rootRank", 0))
        if not 0 <= root < len(op.ranks):
            raise HybridError(f"{op.where()}: root group rank {root} is outside 0..{len(op.ranks) - 1}")
        return root

    def _peer(self, op: _Op, peer: int) -> None:
        if not 0 <= peer < len(op.ranks) or peer == op.me:
            raise HybridError(f"{op.where()}: peer group rank {peer} is not another member of 0..{len(op.ranks) - 1}")

    def _chunks(self, op: _Op, whole: torch.Tensor, part: torch.Tensor) -> List[torch.Tensor]:
        """``whole`` as size() consecutive ``part``-shaped views (all_gather_into_tensor, reduce_scatter_tensor)."""
        n = len(op.ranks)
        if whole.numel() != n * part.numel() or not whole.is_contiguous():
            raise HybridError(
                f"{op.where()}: a contiguous tensor of "
                f"{n} x {part.numel()} elements is needed, got {list(whole.shape)} "
                f"({whole.numel()} elements, contiguous={whole.is_contiguous()})"
            )
        flat = whole.view(-1)
        return [flat[g * part.numel():(g + 1) * part.numel()].view(part.shape) for g in range(n)]

    def _rows(self, op: _Op, t: torch.Tensor, splits: List[int], what: str) -> List[torch.Tensor]:
        """all_to_all_single's chunks: ``splits`` rows each, or an even split when empty."""
        n = len(op.ranks)
        if not splits:
            if t.shape[0] % n:
                raise HybridError(f"{op.where()}: {what} has {t.shape[0]} rows, not divisible by {n} members")
            splits = [t.shape[0] // n] * n
        if len(splits) != n or sum(splits) != t.shape[0]:
            raise HybridError(f"{op.where()}: {what} split sizes {list(splits)} do not cover "
                              f"{t.shape[0]} rows over {n} members")
        return list(t.split(list(splits)))


def _refuse(why: str):
    def handler(self: HybridOracle, op: _Op, *args) -> None:  # noqa: ARG001
        raise HybridError(f"{op.where()}: {why}")

    return handler


_HANDLERS: Dict[str, Callable] = {
    "allreduce": HybridOracle.allreduce,
    "allreduce_coalesced": HybridOracle.allreduce,
    "reduce": HybridOracle.reduce,
    "allgather": HybridOracle.allgather,
    "allgather_coalesced": HybridOracle.allgather_coalesced,
    "_allgather_base": HybridOracle._allgather_base,
    "all_gather_single": HybridOracle._allgather_base,  # torch >= 2.13's name
    "allgather_into_tensor_coalesced": HybridOracle.allgather_into_tensor_coalesced,
    "all_gather_single_coalesced": HybridOracle.allgather_into_tensor_coalesced,
    "reduce_scatter": HybridOracle.reduce_scatter,
    "_reduce_scatter_base": HybridOracle._reduce_scatter_base,
    "reduce_scatter_single": HybridOracle._reduce_scatter_base,
    "reduce_scatter_tensor_coalesced": HybridOracle.reduce_scatter_tensor_coalesced,
    "reduce_scatter_single_coalesced": HybridOracle.reduce_scatter_tensor_coalesced,
    "broadcast": HybridOracle.broadcast,
    "gather": HybridOracle.gather,
    "scatter": HybridOracle.scatter,
    "alltoall": HybridOracle.alltoall,
    "alltoall_base": HybridOracle.alltoall_base,
    "all_to_all_single": HybridOracle.alltoall_base,
    "send": HybridOracle.send,
    "recv": HybridOracle.recv,
    "barrier": HybridOracle.barrier,
    "monitored_barrier": HybridOracle.barrier,
    "recv_anysource": _refuse("a receive from any source is not emulated "
                              "(which peer, real or virtual, would send first is unknowable)"),
}
