"""The group registry: the one owner of every process group of a pitstop job.

Each rank builds only its own groups, each under a store prefix that names the
generation (``pitstop/g3/...``), so there is no world barrier and keys of an older
generation never collide with newer ones. Groups are keyed by
``(kind, ranks, generation)``.

``replace(role)`` rebuilds exactly the groups of this rank that hold ``role``
(see :mod:`pitstop.plan`); every other group stays the identical Python object::

    before (g0), rank 0 of tp2 pp2 dp2     after replace(5) (g1)
    tp       [0,1]      g0  ------------>  [0,1]      g0   kept, same object
    dp       [0,2]      g0  ------------>  [0,2]      g0   kept
    tp-pp    [0,1,4,5]  g0  ---rebuild-->  [0,1,4,5]  g1   holds 5: new communicator
    intra-dist-opt (tp-ep-pp x edp)  ----> re-composed locally from the new tp-ep-pp

Groups are created in the global order of :func:`pitstop.plan.comm_kinds`; every
rank follows that order, so ranks building overlapping groups never deadlock.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from pitstop import pg as pgmod
from pitstop.errors import GroupError, RosterError, UnknownGroupKindError
from pitstop.layout import ParallelLayout
from pitstop.logtag import tag
from pitstop.plan import comm_kinds, plan_replace, realization
from pitstop.roster import ProcessInfo
from pitstop.store import SharedConnection, sealed

log = logging.getLogger(__name__)

#: Kinds for which Megatron also wants a gloo twin (its ``*_GLOO`` globals).
GLOO_TWIN_KINDS = ("dp", "dp-cp", "edp", "intra-dp-cp", "intra-edp")

GroupKey = Tuple[str, Tuple[int, ...], int]


@dataclass
class Entry:
    """One group of this rank."""

    key: GroupKey
    group: dist.ProcessGroup
    how: str
    gloo: Optional[dist.ProcessGroup] = None
    """The gloo twin for CPU-side collectives; the group itself when it is gloo already."""
    ring: Optional[dist.ProcessGroup] = None
    """A gloo communicator of the same ranks that only pitstop's buddy ring uses (the
    registry's ``ring_kind``): its exchange runs in a background thread while the training
    step runs collectives on the group and its twin, and two threads must never interleave
    operations on one gloo communicator (each rank would pair them in a different order)."""

    @property
    def kind(self) -> str:
        return self.key[0]

    @property
    def ranks(self) -> List[int]:
        return list(self.key[1])

    @property
    def generation(self) -> int:
        return self.key[2]


@dataclass
class ReplaceReport:
    """What ``replace`` did on this rank."""

    role: int
    generation: int
    rebuilt: List[GroupKey] = field(default_factory=list)
    kept: List[GroupKey] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Pending:
    """The next generation's groups of this rank, built but not installed yet."""

    role: int
    old_generation: int
    new_generation: int
    entries: Dict[str, Entry]
    seconds: float


def _concurrently(fns: List, what: str, undo=None) -> List:
    """Run ``fns`` each in a thread of its own; their results in order. If any raised, the
    results of the others are handed to ``undo`` and the first error is raised."""
    results: List = [None] * len(fns)
    errors: List[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), name=f"pitstop-group-{what}-{i}", daemon=True)
               for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        if undo is not None:
            for r in results:
                if r is not None:
                    undo(r)
        raise errors[0]
    return results


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


VIRTUAL = "pitstop_virtual"
"""The emulation backend's name (:mod:`pitstop.virtual`): its groups never rendezvous."""

SOLO = "solo"
"""The kind of :meth:`GroupRegistry.solo`: not a Megatron kind, and in no layout's plan."""


class GroupRegistry:
    """Creates, looks up, replaces and destroys this rank's process groups."""

    def __init__(
        self,
        layout: ParallelLayout,
        store: dist.Store,
        *,
        generation: int = 0,
        backend: Optional[str] = None,
        timeout: timedelta = timedelta(minutes=10),
        gloo_twins: bool = True,
        prefix: str = "pitstop",
        fence: Optional[pgmod.Fence] = pgmod.FENCE,
        deferred: bool = False,
        connections: Optional[SharedConnection] = None,
        ring_kind: Optional[str] = None,
    ) -> None:
        if not dist.is_initialized():
            raise GroupError("torch.distributed is not initialised: call pitstop.pg.init_world() first")
        self.layout = layout
        self.rank = dist.get_rank()
        if dist.get_world_size() != layout.world_size:
            raise GroupError(
                f"layout world_size({layout.world_size}) != torch.distributed world size "
                f"({dist.get_world_size()})"
            )
        self.store = store
        self.generation = generation
        self.backend = backend or default_backend()
        self.timeout = timeout
        self.gloo_twins = gloo_twins
        self.prefix = prefix
        self.fence = fence
        """Failed operations poison the step instead of raising while it is armed
        (:class:`pitstop.pg.Fence`); None builds plain, unguarded communicators."""
        self._entries: Dict[str, Entry] = {}
        self._retired: List[dist.ProcessGroup] = []
        if connections is not None and connections.store is not store:
            raise GroupError("connections must share a connection to the registry's own store "
                             "(SharedConnection(store))")
        self.connections = connections if connections is not None else SharedConnection(store)
        """The spare store connection that rendezvous running at once share, each through a
        polling view (a c10d client holds one lock for the whole of a blocking ``wait``,
        so a background :meth:`prepare` whose rendezvous waits for a late peer on the
        training thread's connection would stall that thread's step verdict, which those
        peers may be waiting for: a deadlock). Opened by :meth:`build` (or a standby,
        before it had a role), so a replacement opens none; see
        :class:`pitstop.store.SharedConnection`."""
        self.ring_kind = ring_kind
        """The kind whose communicator gets a :attr:`Entry.ring` (the buddy ring's shard kind),
        or None. Resolved to the communicator that realises it (``dp-cp`` is ``dp``'s alias
        at cp 1); a composite kind has none, and its ring exchanges on the training thread."""
        self._ring_comm: Optional[str] = None
        if ring_kind is not None and self.backend != VIRTUAL:
            r = realization(layout, ring_kind)
            self._ring_comm = ring_kind if r.how == "comm" else r.parts[0] if r.how == "alias" else None
        self._deferred: Optional[List] = [] if deferred else None
        """A joiner's communicators still to build (see :meth:`build` and :meth:`attach`)."""
        self._builder: Optional[threading.Thread] = None
        self._builder_error: Optional[BaseException] = None
        self.attach_wait_s = 0.0
        """How long :meth:`attach` waited for the background build (0: it was done already)."""
        if deferred and fence is None:
            raise GroupError("a deferred build needs a fence to answer for the groups until they exist")

    # ----------------------------------------------------------------- naming
    def _name(self, kind: str, ranks: Tuple[int, ...], gen: int, suffix: str = "") -> str:
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:10]
        return f"{self.prefix}:g{gen}:{kind}{suffix}:{digest}"

    def _publish(self, entries) -> None:
        """Give the installed groups of ``entries`` their stable c10d names (``pitstop:tp``,
        ``pitstop:tp+gloo``): the same in every generation and in a standby's warmup sandbox,
        so code that ``torch.compile`` traced with one generation's group runs with the
        next one's (dynamo guards on ``group_name``). Called once the groups they replace
        are unregistered; a name another live group holds (a second registry in one
        process) is left as the generation's unique name."""
        for e in entries:
            if e.how == "alias":
                continue
            kind = e.key[0]
            for g, suffix in ((e.group, ""), (e.gloo, "+gloo"), (e.ring, "+ring")):
                if g is not None and not (suffix and g is e.group):
                    if not pgmod.rename(g, f"{self.prefix}:{kind}{suffix}"):
                        log.debug("%s group %s keeps its name %s", tag(self.generation, self.rank), kind, g.group_name)

    def _store_for(self, gen: int, base: Optional[dist.Store] = None) -> dist.Store:
        """The generation's prefix; inside a pitstop job its values are sealed with the job
        token (:func:`pitstop.store.sealed`), so junk cannot redirect a rendezvous."""
        return dist.PrefixStore(f"{self.prefix}/g{gen}", sealed(base if base is not None else self.store))

    # ----------------------------------------------------------------- building
    def _build_comm(self, kind: str, ranks: Tuple[int, ...], gen: int, base: Optional[dist.Store] = None,
                    deferred: Optional[List] = None) -> Entry:
        if deferred is not None:  # the builder thread takes the group's view of the shared connection when it runs
            box: List[dist.Store] = []

            def store() -> dist.Store:  # one view per group: its gloo twin rendezvouses after it
                if not box:
                    box.append(self._store_for(gen, self.connections.take()))
                return box[0]
        else:
            store = self._store_for(gen, base)
        group = pgmod.new_comm(ranks, self.backend, store, self._name(kind, ranks, gen), self.timeout, kind, self.fence,
                               deferred)
        gloo = None
        if self.gloo_twins and kind in GLOO_TWIN_KINDS:
            gloo = group if self.backend in ("gloo", VIRTUAL) else pgmod.new_comm(
                ranks, "gloo", store, self._name(kind, ranks, gen, "+gloo"), self.timeout, kind + "+gloo", self.fence,
                deferred,
            )
        ring = None
        if kind == self._ring_comm and len(ranks) > 1:
            ring = pgmod.new_comm(ranks, "gloo", store, self._name(kind, ranks, gen, "+ring"), self.timeout,
                                  kind + "+ring", self.fence, deferred)
        return Entry((kind, ranks, gen), group, "comm", gloo, ring)

    def rendezvous_count(self) -> int:
        """How many communicators of this rank rendezvous in a full build: the most any
        delta of this rank rebuilds at once (each over a view of the one shared connection)."""
        return sum(1 for k in comm_kinds(self.layout) if self.layout.group_of(k, self.rank) is not None)

    def _derive(self, kind: str, gen: int, entries: Dict[str, Entry]) -> Entry:
        r = realization(self.layout, kind)
        ranks = tuple(self.layout.group_of(kind, self.rank))
        if r.how == "alias":
            part = entries[r.parts[0]]
            return Entry((kind, ranks, gen), part.group, "alias", part.gloo if kind in GLOO_TWIN_KINDS else None,
                         part.ring)
        inner, outer = (entries[p] for p in r.parts)
        name = self._name(kind, ranks, gen)
        group = pgmod.CompositeGroup(ranks, self.rank, inner.group, outer.group, name)
        pgmod.register_python_group(group, name, ranks, kind)
        return Entry((kind, ranks, gen), group, "composite")

    def build(self) -> None:
        """Create every group of this rank for the current generation.

        A deferred registry (a joiner: ``deferred=True``) returns at once. Every group
        object exists, named and registered, so the script builds its model, optimizer
        and data around them while a background thread rendezvouses with the stayers,
        who are rolling back and preparing their side meanwhile::

            joiner   assigned | groups exist (empty) | model, optimizer, data  | attach | state
                              | background: rendezvous tp, pp, dp, ... ------> |
            stayers  rollback | prepare the delta (rendezvous) ------------->  | send state

        Until :meth:`attach` returns, the fence must be local (nothing is sent).
        """
        if self._entries:
            raise GroupError(f"rank {self.rank}: groups already built (generation {self.generation})")
        if self._deferred is not None:
            # each rendezvous polls over the shared spare connection: the main thread's store
            # client stays free (a c10d client serialises every call behind a blocking wait)
            self._build_kinds(set(self.layout.groups_of(self.rank)) | set(comm_kinds(self.layout)), self.generation,
                              self._entries, deferred=self._deferred)
            self._publish(self._entries.values())
            self._builder = threading.Thread(target=self._run_deferred, name=f"pitstop-groups-g{self.generation}",
                                             daemon=True)
            self._builder.start()
            return
        self._build_kinds(set(self.layout.groups_of(self.rank)) | set(comm_kinds(self.layout)), self.generation, self._entries)
        self._publish(self._entries.values())
        if self.backend != VIRTUAL:  # a virtual group never rendezvouses
            t0 = time.perf_counter()
            made = self.connections.reserve(1)
            log.debug("%s %d store connection opened for a replacement's rendezvous in %.3fs", tag(self.generation, self.rank),
                      made, time.perf_counter() - t0)

    def _run_deferred(self) -> None:
        t0 = time.perf_counter()
        tasks = self._deferred or []
        try:  # every group at once, as the stayers prepare theirs (_build_kinds(concurrent=True))
            _concurrently([(lambda t=t: [attach() for attach in t]) for t in tasks], f"r{self.rank} g{self.generation}")
        except BaseException as exc:  # noqa: BLE001 - raised by attach() in the caller's thread
            self._builder_error = exc
            return
        log.info("%s %d communicators built in the background in %.3fs", tag(self.generation, self.rank),
                 sum(len(t) for t in tasks), time.perf_counter() - t0)

    @property
    def deferred(self) -> bool:
        """Whether some communicators are still being built in the background."""
        return self._builder is not None

    def attach(self, timeout_s: Optional[float] = None) -> float:
        """Wait for a deferred build to finish; returns the seconds waited (0 when not deferred).
        Raises :class:`GroupError` if a rendezvous failed or did not finish in time."""
        if self._builder is None:
            return 0.0
        t0 = time.perf_counter()
        limit = self.timeout.total_seconds() if timeout_s is None else timeout_s
        self._builder.join(limit)
        if self._builder.is_alive():
            raise GroupError(f"rank {self.rank}: the background build of generation {self.generation}'s groups "
                             f"did not finish within {limit:.0f}s")
        self._builder = None
        if self._builder_error is not None:
            err, self._builder_error = self._builder_error, None
            raise GroupError(f"rank {self.rank}: building generation {self.generation}'s groups failed: {err}") from err
        self._deferred = None
        self.attach_wait_s = time.perf_counter() - t0
        return self.attach_wait_s

    def _build_kinds(self, kinds, gen: int, entries: Dict[str, Entry], base: Optional[dist.Store] = None,
                     concurrent: bool = False, deferred: Optional[List] = None) -> List[str]:
        """Build ``kinds`` into ``entries`` (which also supplies the parts of composites),
        through ``base`` (default: the registry's store).

        ``concurrent``: every communicator rendezvouses at once, each in a thread with a
        polling view of the shared spare connection (a c10d client serialises its calls,
        so two rendezvous blocking on one connection could each wait behind the other;
        views never block it, see :class:`pitstop.store.PollingStore`). Each group's
        rendezvous involves only its members, so no order across ranks is needed and a
        delta of k groups costs about one rendezvous instead of k. ``deferred`` (a joiner's
        :meth:`build`) gets one such task per group instead, to run in the background."""
        built = []
        todo = []
        for kind in comm_kinds(self.layout):
            if kind not in kinds:
                continue
            ranks = self.layout.group_of(kind, self.rank)
            if ranks is None:
                continue
            todo.append((kind, tuple(ranks)))
        if deferred is not None:
            for kind, ranks in todo:
                tasks: List = []
                entries[kind] = self._build_comm(kind, ranks, gen, None, tasks)
                deferred.append(tasks)
                built.append(kind)
        elif concurrent:
            conns = self.connections.lend(len(todo))
            made = _concurrently([(lambda k=kind, r=ranks, c=c: self._build_comm(k, r, gen, c))
                                  for (kind, ranks), c in zip(todo, conns)],
                                 f"r{self.rank} g{gen}", self._destroy_entry) if len(todo) > 1 else \
                [self._build_comm(k, r, gen, c) for (k, r), c in zip(todo, conns)]
            for (kind, _), e in zip(todo, made):
                entries[kind] = e
                built.append(kind)
        else:
            for kind, ranks in todo:
                entries[kind] = self._build_comm(kind, ranks, gen, base)
                built.append(kind)
        for kind in self.layout.kinds():
            if kind in kinds and realization(self.layout, kind).how != "comm":
                if self.layout.group_of(kind, self.rank) is not None:
                    entries[kind] = self._derive(kind, gen, entries)
                    built.append(kind)
        return built

    def solo(self) -> Entry:
        """This rank alone, as a communicator of its own (built once, at this generation).

        megatron-core 0.19 keeps GTP weight-remat groups that are singletons unless
        ``gtp_remat_size`` > 1, and calls collectives on them (the params-norm reduce).
        No other rank is in such a group, so it is never part of a delta: a joiner builds
        its own, and a stayer's stays the same object across every replacement."""
        e = self._entries.get(SOLO)
        if e is None:
            e = self._entries[SOLO] = self._build_comm(SOLO, (self.rank,), self.generation)
        return e

    # ----------------------------------------------------------------- lookup
    def entry(self, kind: str) -> Optional[Entry]:
        """This rank's entry for ``kind``; None if this rank holds no group of it
        (only ``embd``/``pos-embd``). Unknown kinds raise."""
        if kind not in self._entries and kind not in self.layout.kinds() and kind not in comm_kinds(self.layout):
            raise UnknownGroupKindError(
                f"unknown group kind {kind!r}; this job's kinds are {', '.join(self.layout.kinds())}"
            )
        return self._entries.get(kind)

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
        e = self.entry(kind)
        return e.group if e else None

    def gloo_group(self, kind: str) -> Optional[dist.ProcessGroup]:
        e = self.entry(kind)
        return e.gloo if e else None

    def entries(self) -> Dict[str, Entry]:
        """This rank's entries in the layout's kind order (the same order on every rank,
        so callers can issue collectives over them in a loop without deadlock)."""
        order = list(self.layout.kinds()) + [k for k in comm_kinds(self.layout) if k not in self.layout.kinds()]
        return {k: self._entries[k] for k in order if k in self._entries}

    def communicators(self) -> List[dist.ProcessGroup]:
        """Distinct real communicators of this rank (gloo twins included), no composites."""
        seen, out = set(), []
        for e in self._entries.values():
            if e.how != "comm":
                continue
            for g in (e.group, e.gloo, e.ring):
                if g is not None and id(g) not in seen:
                    seen.add(id(g))
                    out.append(g)
        return out

    # ----------------------------------------------------------------- replace
    def replace(self, role: int, new_process: Optional[ProcessInfo] = None) -> ReplaceReport:
        """Move to the next generation with ``role`` played by ``new_process``.

        Rebuilds exactly this rank's groups that hold ``role`` (and composites
        built on them), under the new generation's prefix; every other group
        stays the same object. Old groups are unregistered after the new ones exist
        and freed later by :meth:`reap`, off the critical path.
        The joiner itself does not call this: it builds a fresh registry at the new
        generation. ``replace`` is :meth:`prepare` followed by :meth:`commit`.
        """
        return self.commit(self.prepare(role, new_process))

    def prepare(self, role, new_process: Optional[ProcessInfo] = None) -> "Pending":
        """Phase 1: build the next generation's groups of this rank that hold ``role``
        (one role, or a sequence of roles lost together: the union of their groups,
        each group built once).

        Nothing is swapped: the current groups stay installed and usable, so this
        may run in a background thread while training goes on (a planned drain). The
        new groups rendezvous over polling views of the shared spare connection
        (:attr:`connections`), never the training thread's, so their waits never block
        its use of the store.
        """
        roles = (role,) if isinstance(role, int) and not isinstance(role, bool) else tuple(role)
        for r in roles:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.layout.world_size:
                raise RosterError(f"role({r!r}) does not exist: roles are 0..{self.layout.world_size - 1}")
        if not roles or len(set(roles)) != len(roles):
            raise RosterError(f"roles {list(roles)}: expected one or more distinct roles")
        if self.rank in roles:
            raise RosterError(
                f"rank {self.rank} is a role being replaced; the joiner builds a fresh "
                f"GroupRegistry at generation {self.generation + 1}, the leaver leaves"
            )
        t0 = time.perf_counter()
        gen = self.generation + 1
        plan = plan_replace(self.layout, tuple(sorted(roles)), self.generation, gen)
        kinds = set(plan.rebuilt_kinds(self.rank))
        who = new_process.describe() if new_process else "new processes" if len(roles) > 1 else "a new process"
        log.info("%s prepare role(s) %s for %s: building %s", tag(gen, self.rank), ",".join(map(str, roles)),
                 who, sorted(kinds))
        # built into a private view: the installed entries are never touched, so the
        # training thread may keep using them while this runs
        view = {k: v for k, v in self._entries.items() if k not in kinds}
        try:
            self._build_kinds(kinds, gen, view, concurrent=True)  # each over a view of the shared connection
        except Exception:
            for k in kinds:
                if k in view:
                    self._destroy_entry(view[k])
            raise
        staged = {k: view[k] for k in kinds if k in view}
        return Pending(roles[0] if len(roles) == 1 else roles, self.generation, gen, staged, time.perf_counter() - t0)

    def commit(self, pending: "Pending") -> ReplaceReport:
        """Phase 2: swap in the groups built by :meth:`prepare`; retire the old ones."""
        if pending.old_generation != self.generation:
            raise GroupError(
                f"rank {self.rank}: prepared for generation {pending.old_generation} -> "
                f"{pending.new_generation}, but the registry is at generation {self.generation}"
            )
        t0 = time.perf_counter()
        old = {k: self._entries[k] for k in pending.entries if k in self._entries}
        self._entries.update(pending.entries)
        for e in old.values():
            self._destroy_entry(e, retire=True)
        self.generation = pending.new_generation
        self._publish(pending.entries.values())
        report = ReplaceReport(pending.role, self.generation, seconds=pending.seconds + time.perf_counter() - t0)
        for k, e in self._entries.items():
            (report.rebuilt if k in pending.entries else report.kept).append(e.key)
        return report

    def abandon(self, pending: "Pending") -> None:
        """Destroy groups built by :meth:`prepare` that will not be committed."""
        for e in pending.entries.values():
            self._destroy_entry(e)

    def destroy(self) -> None:
        """Destroy every communicator this registry created."""
        for e in self._entries.values():
            self._destroy_entry(e)
        self._entries.clear()
        self.reap()

    def _destroy_entry(self, e: Entry, retire: bool = False) -> None:
        # aliases share their part's objects, which the part's own entry destroys
        if e.how == "alias":
            return
        for g in {id(e.group): e.group, id(e.gloo): e.gloo, id(e.ring): e.ring}.values():
            if g is not None:
                pgmod.destroy(g)
                if retire:
                    self._retired.append(g)

    def reap(self) -> int:
        """Drop the groups retired by ``replace``; returns how many.

        Unregistering a group is cheap, but freeing a gloo communicator joins its
        threads and closes its sockets (about 10 ms per group here), so ``replace``
        keeps the objects and this frees them off the critical path.
        """
        n = len(self._retired)
        self._retired.clear()
        return n
