"""Machines of a job, as pure data: ``--nnodes MIN:MAX``, the node rank, and SLURM's variables.

``--nnodes 4`` is four machines that all train. ``--nnodes 4:5`` (torchrun's elastic
spelling) is four that train plus one *standby machine*: its agent starts
``--nproc-per-node`` standbys, and when a training machine fails or is drained, that
machine takes over all of its roles at once, keeping local-rank order::

    node rank   0 (head)       1             2             3             4
    roles       r0 r1          r2 r3         r4 r5         r6 r7         standby x2
    addr        127.0.0.2      127.0.0.3     127.0.0.4     127.0.0.5     127.0.0.6   (on one test host)

Under SLURM one line starts it all: ``srun --ntasks-per-node 1 pitstop launch --nnodes 4:5
--nproc-per-node 2 --rdzv-endpoint $HEAD:29400 -- train.py``; the node rank comes from
``SLURM_NODEID`` and the head from the first host of ``SLURM_JOB_NODELIST``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Mapping, Optional

from pitstop.errors import ConfigError


@dataclass(frozen=True)
class Nodes:
    """How many machines train (``min``) and how many there are in all (``max``)."""

    min: int
    max: int

    def __post_init__(self) -> None:
        for name in ("min", "max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--nnodes {name}({v!r}): expected an integer >= 1")
        if self.max < self.min:
            raise ConfigError(f"--nnodes {self.min}:{self.max}: MAX({self.max}) must be >= MIN({self.min})")

    @classmethod
    def parse(cls, text: str) -> "Nodes":
        """``"4"`` or ``"4:5"``."""
        lo, sep, hi = str(text).partition(":")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX, e.g. 4 or 4:5") from None
        return cls(a, b)

    @property
    def standby_machines(self) -> int:
        return self.max - self.min

    def is_standby_machine(self, node_rank: int) -> bool:
        return node_rank >= self.min

    def check_rank(self, node_rank: int) -> None:
        if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < self.max:
            raise ConfigError(f"--node-rank({node_rank!r}): expected 0..{self.max - 1} for --nnodes {self.min}:{self.max}")

    def node_of(self, rank: int, nproc_per_node: int) -> int:
        """The machine of a training rank: ranks fill machines in order, as torchrun's static rendezvous."""
        return rank // nproc_per_node


def expand_hostlist(text: str) -> List[str]:
    """SLURM's compressed host list: ``"gpu[01-03,07],login1"`` -> gpu01 gpu02 gpu03 gpu07 login1."""
    out: List[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?(?:,|$)", text.strip()):
        prefix, ranges = m.group(1), m.group(2)
        if not prefix and not ranges:
            continue
        if ranges is None:
            out.append(prefix)
            continue
        for part in ranges.split(","):
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise ConfigError(f"SLURM_JOB_NODELIST {text!r}: cannot read the range {part!r}")
            if not dash:
                out.append(prefix + lo)
                continue
            width = len(lo)
            if int(hi) < int(lo):
                raise ConfigError(f"SLURM_JOB_NODELIST {text!r}: range {part!r} runs backwards")
            out.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
    if not out:
        raise ConfigError(f"SLURM_JOB_NODELIST {text!r}: no host in it")
    return out


@dataclass(frozen=True)
class SlurmPlace:
    nnodes: int
    node_rank: int
    head: str


def from_slurm(env: Mapping[str, str]) -> Optional[SlurmPlace]:
    """This machine's place in the job from SLURM's variables (None outside a SLURM job step)."""
    if "SLURM_JOB_NODELIST" not in env and "SLURM_NODELIST" not in env:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    hosts = expand_hostlist(nodelist)
    try:
        nnodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or len(hosts))
        node_rank = int(env["SLURM_NODEID"])
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"SLURM variables: SLURM_NNODES={env.get('SLURM_NNODES')!r}, "
                          f"SLURM_NODEID={env.get('SLURM_NODEID')!r}: expected integers ({exc})") from None
    if nnodes != len(hosts):
        raise ConfigError(f"SLURM_NNODES({nnodes}) != {len(hosts)} hosts in SLURM_JOB_NODELIST {nodelist!r}")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"SLURM_NODEID({node_rank}): expected 0..{nnodes - 1}")
    return SlurmPlace(nnodes, node_rank, hosts[0])
