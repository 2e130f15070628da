"""The delta plan: which process groups a roster change rebuilds. A pure function.

``plan_delta(layout, old_roster, new_roster)`` names, for every rank, which of its
groups are rebuilt in the new generation and which stay the very same objects.
Only communicators that contain a replaced role are rebuilt; the ranks that do any
group work are the members of those communicators, never the whole world.

Three kinds of group realisation keep that promise at scale::

    comm       a real communicator (gloo / NCCL), e.g. tp, pp, dp, dp-cp, edp
    alias      the same object as another kind when they coincide, e.g. tp-dp == dp at tp 1
    composite  a product of two orthogonal communicators, reduced one after the other:
               tp-dp = tp x dp, tp-dp-cp = tp-cp x dp, intra-dist-opt = tp-ep-pp x edp

A composite spans up to the whole world, but rebuilding one is local bookkeeping:
only its parts communicate, so a role's delta touches at most its model-parallel
group plus its data-parallel group (``tp*pp + dp`` ranks at cp 1, ep 1), not 8,192.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from pitstop.errors import LayoutError
from pitstop.layout import ParallelLayout
from pitstop.roster import Roster

#: Composite kinds and their (inner, outer) parts; outer may depend on the layout.
_COMPOSITES = {
    "tp-dp": ("tp", "dp"),
    "tp-dp-cp": ("tp-cp", "dp"),
    "intra-dist-opt": ("tp-ep-pp", "edp"),
}


@dataclass(frozen=True)
class Realization:
    """How one group kind is realised on a layout."""

    kind: str
    how: str
    """``"comm"``, ``"alias"`` or ``"composite"``."""
    parts: Tuple[str, ...] = ()
    """For an alias, the kind it shares; for a composite, (inner, outer)."""


def realization(layout: ParallelLayout, kind: str) -> Realization:
    """How ``kind`` is built on ``layout`` (see the module docstring)."""
    if kind not in _COMPOSITES:
        if kind not in layout.kinds():
            layout.group_ranks(kind)  # raises UnknownGroupKindError for a kind Megatron lacks
        return Realization(kind, "comm")
    inner, outer = _COMPOSITES[kind]
    if kind == "intra-dist-opt" and layout.dist_opt_instances > 1:
        outer = "intra-edp"
    n_inner = len(layout.group_of(inner, 0))
    n_outer = len(layout.group_of(outer, 0))
    if n_outer == 1:
        return Realization(kind, "alias", (inner,))
    if n_inner == 1:
        return Realization(kind, "alias", (outer,))
    return Realization(kind, "composite", (inner, outer))


def comm_kinds(layout: ParallelLayout) -> Tuple[str, ...]:
    """Kinds realised as real communicators, in creation order (a global total order,
    so that ranks building overlapping groups never wait on each other in a cycle)."""
    out = [k for k in layout.kinds() if realization(layout, k).how == "comm"]
    for k in layout.kinds():  # parts of composites must exist even if not a Megatron kind
        for p in realization(layout, k).parts:
            if p not in out:
                out.append(p)
    return tuple(out)


@dataclass(frozen=True)
class GroupRef:
    """One group of the job: its kind and its members, in Megatron's order."""

    kind: str
    ranks: Tuple[int, ...]


@dataclass(frozen=True)
class DeltaPlan:
    """What a roster change does to the job's process groups."""

    old_generation: int
    new_generation: int
    replaced: Tuple[int, ...]
    """Roles whose process changes."""
    rebuilt: Tuple[GroupRef, ...]
    """Communicators that hold a replaced role: rebuilt under the new generation."""
    ranks_involved: FrozenSet[int]
    """Ranks that do any group work: the members of ``rebuilt``."""
    param_sources: Dict[int, Optional[int]]
    """For each replaced role, a data-parallel peer with the same tp/cp/pp coordinates
    that holds the same parameters (None at dp 1)."""
    layout: ParallelLayout

    def rebuilt_kinds(self, rank: int) -> Tuple[str, ...]:
        """Kinds whose group on ``rank`` changes: rebuilt comms, plus aliases and composites
        built on them. A joiner (a replaced role) rebuilds all of its kinds."""
        if rank in self.replaced:
            return tuple(self.layout.groups_of(rank))
        comms = {g.kind for g in self.rebuilt if rank in g.ranks}
        out = []
        for kind in self.layout.groups_of(rank):
            r = realization(self.layout, kind)
            if kind in comms or (r.how != "comm" and any(p in comms for p in r.parts)):
                out.append(kind)
        return tuple(out)

    def kept_kinds(self, rank: int) -> Tuple[str, ...]:
        """Kinds whose group object on ``rank`` stays the very same object."""
        rebuilt = set(self.rebuilt_kinds(rank))
        return tuple(k for k in self.layout.groups_of(rank) if k not in rebuilt)


def plan_delta(layout: ParallelLayout, old: Roster, new: Roster) -> DeltaPlan:
    """The delta plan of a roster change; pure, so every rank computes the same answer."""
    if old.world_size != layout.world_size:
        from pitstop.errors import RosterError

        raise RosterError(
            f"roster has {old.world_size} roles but the layout's world_size is {layout.world_size}"
        )
    replaced = old.changed_roles(new)
    return plan_replace(layout, replaced, old.generation, new.generation)


def plan_replace(
    layout: ParallelLayout, replaced: Tuple[int, ...], old_gen: int = 0, new_gen: int = 1
) -> DeltaPlan:
    """The delta plan for replacing ``replaced`` roles (no roster needed)."""
    for r in replaced:
        layout._check_rank(r)
    rebuilt: List[GroupRef] = []
    seen = set()
    for kind in comm_kinds(layout):
        for role in replaced:
            g = layout.group_of(kind, role)
            if g is None:
                continue
            ref = GroupRef(kind, tuple(g))
            if ref not in seen:
                seen.add(ref)
                rebuilt.append(ref)
    involved = frozenset(r for g in rebuilt for r in g.ranks)
    sources: Dict[int, Optional[int]] = {}
    for role in replaced:
        peers = [p for p in layout.group_of("dp", role) if p != role and p not in replaced]
        sources[role] = peers[0] if peers else None
    return DeltaPlan(old_gen, new_gen, tuple(replaced), tuple(rebuilt), involved, sources, layout)


def job_group_count(layout: ParallelLayout) -> int:
    """Communicators in the whole job (composites and aliases are not communicators)."""
    return sum(len(layout.group_ranks(k)) for k in comm_kinds(layout))


def ring_neighbours(layout: ParallelLayout, kind: str, role: int) -> Tuple[int, int]:
    """(next, previous) of ``role`` in its ``kind`` group, the buddy ring: the next one holds
    this role's shard copy, the previous one's shard copy is held by this role."""
    ring = layout.group_of(kind, role)
    if ring is None:
        raise LayoutError(f"role {role} has no {kind!r} group")
    i = ring.index(role)
    return ring[(i + 1) % len(ring)], ring[(i - 1) % len(ring)]


def unrecoverable(layout: ParallelLayout, kind: str, lost: Sequence[int]) -> List[str]:
    """Why the state of ``lost`` roles (lost together) cannot come from their peers; empty if it can.

    A lost role's shard lives only in itself and in its ring successor's buddy copy: if
    both are lost, so is the shard, and the job must fall back to a checkpoint. A ring of
    one (no data-parallel peer) has no copy at all."""
    gone = set(lost)
    out = []
    for r in sorted(gone):
        ring = layout.group_of(kind, r)
        if ring is None or len(ring) == 1:
            out.append(f"role {r}: no data-parallel peer holds its shard (its {kind} group has 1 member)")
            continue
        nxt, _ = ring_neighbours(layout, kind, r)
        if nxt in gone:
            out.append(f"role {r}: its shard's only copy was on role {nxt}, lost in the same failure")
    return out
