"""pitstop's exception hierarchy.

Every message carries the offending values, so a log line alone says what went wrong.
"""

from __future__ import annotations


class PitstopError(Exception):
    """Base of every error pitstop raises on purpose."""


class LayoutError(PitstopError, ValueError):
    """A parallel layout that cannot exist, e.g. ``tp(2) * pp(4) * cp(1) does not divide world_size(12)``."""


class UnknownGroupKindError(LayoutError, KeyError):
    """A group kind that Megatron does not build (``"tq"``, ``"tp-ep-cp"``)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RosterError(PitstopError, ValueError):
    """A roster change that is not allowed, e.g. replacing role 9 in a world of 8."""


class GroupError(PitstopError, RuntimeError):
    """Creating, registering or destroying a process group failed."""


class InstallError(PitstopError, RuntimeError):
    """Writing Megatron's ``parallel_state`` globals failed, e.g. on a global pitstop does not know."""


class PatchError(PitstopError, RuntimeError):
    """A third-party function pitstop patches is gone, or its signature changed."""


class MissingDependencyError(PitstopError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str):
    """Import ``module`` or raise :class:`MissingDependencyError` naming ``pip install 'pitstop[extra]'``."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - exercised via a subprocess test
        raise MissingDependencyError(
            f"{module!r} is not installed (needed here): install it with "
            f"pip install 'pitstop[{extra}]'"
        ) from exc


class ConfigError(PitstopError, ValueError):
    """A pitstop setting with a wrong value, type or order, e.g. ``heartbeat_interval_s(5.0) >= heartbeat_timeout_s(2.0)``."""


class AuthError(PitstopError, PermissionError):
    """A process that could not prove it holds the job token was refused a role."""


class RecoveryError(PitstopError, RuntimeError):
    """A roster change could not be carried out (no standby, a lost buddy copy, ...)."""


class RecordMismatchError(GroupError):
    """A sandboxed operation does not match the record it is served from (op, shapes or
    dtypes differ, or the record has run out): the record belongs to another model or layout."""


class EmulationError(PitstopError):
    """Emulation at target scale cannot go on: a bad topology, trace or execution graph."""


class TopologyError(EmulationError, ValueError):
    """A network topology file with a missing, unknown or out-of-range key, e.g.
    ``intra_node.alpha_s(-1.0) must be a finite number >= 0 (seconds)``."""


class TraceError(EmulationError, ValueError):
    """A trace or execution graph that does not fit the layout, e.g. a missing role class
    or a collective on a group kind the rank does not belong to."""


class ReplayError(EmulationError, RuntimeError):
    """The replay cannot finish: ranks wait on each other forever, or the members of one
    collective disagree on its operation or size."""


class CheckpointError(PitstopError, RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the directory."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint where one was expected."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was written by a job of another shape than the one loading it."""


class HybridError(GroupError):
    """An operation, option or contribution the hybrid oracle cannot serve, e.g.
    ``recv_anysource on group pitstop:g0:pp:ab12 (size 4)``."""


class EtcdUnavailable(PitstopError, RuntimeError):
    """etcd did not answer (a ``RuntimeError``, as a lost ``TCPStore`` raises, so code that
    survives a lost store survives a lost etcd alike)."""


class Refused(PitstopError, ValueError):
    """A control message that is not acted on: unauthenticated, malformed, oversized or replayed.

    ``key`` and ``reason`` are what the ``refused`` event records."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"refused {key}: {reason}")
        self.key = key
        self.reason = reason
