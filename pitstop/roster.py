"""The roster: which process plays which role, per generation. Pure data.

Roles never change; the process behind a role can. Every change raises the
generation, and every process group is keyed by the generation it was built in.

    generation 3                         generation 4 (role 5 replaced)
    role 0 -> host-a pid 101             role 0 -> host-a pid 101
    ...                                  ...
    role 5 -> host-b pid 205  --leaves   role 5 -> host-c pid 330  (was standby)
    standbys: [host-c pid 330]           standbys: []
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace as _dc_replace
from typing import Dict, Tuple

from pitstop.errors import RosterError


@dataclass(frozen=True)
class ProcessInfo:
    """One live process: where it runs and how to reach it."""

    host: str
    """Host name of the machine the process runs on."""
    pid: int
    """Operating-system process id on that host."""
    addr: str = ""
    """Address (``host:port``) of the process's own endpoint, if it serves one."""

    def describe(self) -> str:
        return f"{self.host}:{self.pid}" + (f"@{self.addr}" if self.addr else "")


@dataclass(frozen=True)
class Roster:
    """A generation-numbered map from role (global rank) to process, plus standbys."""

    generation: int
    """Rises by one on every change; groups built in generation g live under prefix g."""
    roles: Tuple[ProcessInfo, ...]
    """``roles[r]`` is the process that plays global rank ``r``."""
    standbys: Tuple[ProcessInfo, ...] = field(default=())
    """Live processes without a role, ready to take one."""

    def __post_init__(self) -> None:
        if self.generation < 0:
            raise RosterError(f"generation({self.generation}) must be >= 0")
        seen: Dict[ProcessInfo, str] = {}
        for i, p in enumerate(self.roles):
            if p in seen:
                raise RosterError(f"process {p.describe()} plays both {seen[p]} and role {i}")
            seen[p] = f"role {i}"
        for p in self.standbys:
            if p in seen:
                raise RosterError(f"standby {p.describe()} already has {seen[p]}")
            seen[p] = "standby"

    @property
    def world_size(self) -> int:
        return len(self.roles)

    def check_role(self, role: int) -> None:
        if isinstance(role, bool) or not isinstance(role, int) or not 0 <= role < self.world_size:
            raise RosterError(f"role({role!r}) does not exist: roles are 0..{self.world_size - 1}")

    def replace(self, role: int, new: ProcessInfo) -> "Roster":
        """Generation + 1 with ``new`` playing ``role``; a standby that takes it leaves the pool."""
        self.check_role(role)
        if new in self.roles:
            raise RosterError(
                f"process {new.describe()} already plays role {self.roles.index(new)}; "
                f"it cannot also take role {role}"
            )
        roles = list(self.roles)
        roles[role] = new
        standbys = tuple(p for p in self.standbys if p != new)
        return Roster(self.generation + 1, tuple(roles), standbys)

    def replace_many(self, changes: "dict[int, ProcessInfo]") -> "Roster":
        """Generation + 1 (once) with every ``role -> process`` of ``changes`` applied:
        the roles of a lost machine, or ranks lost in the same step, change together."""
        if not changes:
            raise RosterError("replace_many: no role to replace")
        new = list(changes.values())
        if len(set(new)) != len(new):
            raise RosterError(f"replace_many: one process for two roles ({[p.describe() for p in new]})")
        roles = list(self.roles)
        for role, p in changes.items():
            self.check_role(role)
            if p in self.roles and self.roles.index(p) not in changes:
                raise RosterError(f"process {p.describe()} already plays role {self.roles.index(p)}; "
                                  f"it cannot also take role {role}")
            roles[role] = p
        standbys = tuple(s for s in self.standbys if s not in new)
        return Roster(self.generation + 1, tuple(roles), standbys)

    def with_standby(self, p: ProcessInfo) -> "Roster":
        """Generation + 1 with ``p`` added to the standby pool."""
        return _dc_replace(self, generation=self.generation + 1, standbys=self.standbys + (p,))

    def changed_roles(self, newer: "Roster") -> Tuple[int, ...]:
        """Roles whose process differs between ``self`` and ``newer``."""
        if newer.world_size != self.world_size:
            raise RosterError(
                f"world_size changed from {self.world_size} to {newer.world_size}: "
                "pitstop replaces processes, it does not resize the job"
            )
        return tuple(r for r, (a, b) in enumerate(zip(self.roles, newer.roles)) if a != b)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Roster":
        d = json.loads(text)
        return cls(
            d["generation"],
            tuple(ProcessInfo(**p) for p in d["roles"]),
            tuple(ProcessInfo(**p) for p in d.get("standbys", ())),
        )
