"""Every pitstop setting, once: the table that each front door is generated from.

A setting used to be written down in up to five places (the runtime config, Megatron's
``--pitstop-*`` flags, the DeepSpeed section, ``pitstop launch``'s flags, the
environment), each with its own default, bound and help. Now each is one row of
:data:`SETTINGS`, and the doors are generated from the rows::

                               SETTINGS (this module)
       ┌───────────────────┬──────────┴─────────┬─────────────────────────┐
    pitstop launch       --pitstop-*          DeepSpeed JSON           PITSTOP_* env
    --heartbeat-timeout  (Megatron-LM,        "pitstop": {             (launcher -> worker,
    --no-buddy ...        the examples)        "heartbeat_timeout":..}  RuntimeConfig.to_env)
       │  add_flags()      │ add_flags(         │ check() per key          │ from_text()
       │                   │  script=True)      │ (deepspeed_config)       │
       └──────────┬────────┴────────────────────┴─────────────┬───────────┘
          strongest first: launch flag, script flag, DeepSpeed section, default
                                    RuntimeConfig (validated by the same rows)

Every check says where the value came from (``--heartbeat-timeout``,
``pitstop.heartbeat_timeout``, ``PITSTOP_HEARTBEAT_TIMEOUT_S``, ``heartbeat_timeout_s``),
the value, and what was expected. A setting that must exceed another names it, and the
whole chain it belongs to (``0.5 < 500.0 < 120.0``).

Pure data: imports nothing of pitstop but its errors, and nothing of torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from pitstop.errors import ConfigError

ENV_PREFIX = "PITSTOP_"
SCRIPT_PREFIX = "pitstop-"


@dataclass(frozen=True)
class Setting:
    """One setting: its names at every door, its type, default, bound and meaning."""

    key: str
    """The DeepSpeed key and the flags' stem, snake_case (``heartbeat_timeout``)."""
    field: Optional[str]
    """The :class:`pitstop.runtime.config.RuntimeConfig` attribute; None for a setting only the
    launcher uses (the standby count)."""
    type: type
    """``float``, ``int``, ``bool`` or ``str``."""
    default: Any
    help: str
    """What it does, one or two sentences (argparse's help, the README's tables)."""
    floor: Optional[float] = None
    """The smallest value allowed (None: no bound)."""
    open: bool = False
    """The floor itself is not allowed (``> floor``, not ``>= floor``)."""
    above: Optional[str] = None
    """The key of the setting this one must exceed (the timeouts are ordered)."""
    note: str = ""
    """What a special value means, appended to the expectation (``0: do not wait``)."""
    seconds: bool = False
    metavar: str = ""
    deepspeed: bool = True
    """A key of the DeepSpeed config's ``"pitstop"`` section."""
    script: bool = True
    """A ``--pitstop-*`` flag of the training script (the standby count is the launcher's alone)."""
    shown_default: str = ""
    """How the default reads in the README where ``repr`` would not say it (``<run-dir>/checkpoints``)."""

    # ------------------------------------------------------------------ names
    @property
    def negated(self) -> bool:
        """A bool that is on by default is switched by ``--no-<key>``."""
        return self.type is bool and self.default is True

    def flag(self, script: bool = False) -> str:
        stem = ("no-" if self.negated else "") + self.key.replace("_", "-")
        return "--" + (SCRIPT_PREFIX if script else "") + stem

    def dest(self, script: bool = False) -> str:
        return ("pitstop_" if script else "") + self.key

    @property
    def describe(self) -> str:
        """The help with what a special value means (``... is warm (0: do not wait).``)."""
        return f"{self.help.rstrip('.')} ({self.note})." if self.note else self.help

    @property
    def env(self) -> Optional[str]:
        return None if self.field is None else ENV_PREFIX + self.field.upper()

    # ------------------------------------------------------------------ checks
    def expected(self, above: Optional[Tuple[str, Any]] = None) -> str:
        """What a value must be, in words (``a number of seconds > heartbeat_interval (0.5)``)."""
        if self.type is bool:
            return "true or false"
        if self.type is str:
            return "a string"
        noun = "a number of seconds" if self.seconds else "an integer" if self.type is int else "a number"
        if above is not None:
            bound = f" > {above[0]} ({above[1]!r})"
        elif self.floor is not None:
            bound = f" {'>' if self.open else '>='} {self.floor:g}"
        else:
            bound = ""
        return noun + bound + (f" ({self.note})" if self.note else "")

    def check(self, value: Any, where: str, shown: Optional[str] = None) -> Any:
        """``value`` if it is of the right type and within its floor (a float as ``float``), else
        a :class:`ConfigError` naming ``where``, the value (as ``shown``, default its repr) and
        what was expected. The order against another setting is :func:`check_all`'s."""
        what = self.expected()
        got = type(value).__name__
        value_text = repr(value) if shown is None else shown
        if self.type in (bool, str):
            if not isinstance(value, self.type):
                raise ConfigError(f"{where}={value_text}: expected {what}, got {got}")
            return value
        ok = (int,) if self.type is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok):
            raise ConfigError(f"{where}={value_text}: expected {what}, got {got}")
        if self.type is float and not math.isfinite(value):
            raise ConfigError(f"{where}={value_text}: expected {what}, got a non-finite number")
        if self.floor is not None and (value < self.floor or (self.open and value == self.floor)):
            raise ConfigError(f"{where}={value_text}: expected {what}")
        return float(value) if self.type is float else value

    def from_text(self, text: str, where: str) -> Any:
        """A flag's or an environment variable's text as a checked value (bounds, not order)."""
        try:
            if self.type is bool:
                low = text.lower()
                if low in ("1", "true", "yes"):
                    return True
                if low in ("0", "false", "no", ""):
                    return False
                raise ValueError(text)
            value = self.type(text)
        except ValueError:
            raise ConfigError(f"{where}={text!r}: expected {self.expected()}") from None
        return self.check(value, where, shown=repr(text))  # the text as given, not the number it became

    def argparse_type(self) -> Callable[[str], Any]:
        """argparse's ``type=``: a bad value is a usage error naming the text (exit 2)."""
        def parse(text: str) -> Any:
            try:
                return self.from_text(text, "")
            except ConfigError as exc:  # "='<text>': expected ..." -> "'<text>': expected ..."
                raise argparse.ArgumentTypeError(str(exc)[1:]) from None
        return parse


SETTINGS: Tuple[Setting, ...] = (
    Setting("standby", None, int, 0, floor=0, metavar="N", script=False,
            help="Warm standby processes kept beside the workers (0: none; a failed worker then cannot be "
                 "replaced in place)."),
    Setting("heartbeat_interval", "heartbeat_interval_s", float, 0.5, floor=0, open=True, seconds=True, metavar="S",
            help="Seconds between a worker's heartbeats to the controller."),
    Setting("heartbeat_timeout", "heartbeat_timeout_s", float, 5.0, floor=0, open=True, above="heartbeat_interval",
            seconds=True,
            metavar="S", help="A worker silent this many seconds is hung (e.g. SIGSTOP): it is killed and replaced."),
    Setting("collective_timeout", "collective_timeout_s", float, 120.0, floor=0, open=True, above="heartbeat_timeout",
            seconds=True,
            metavar="S", help="Timeout in seconds of every pitstop communicator, the last defence against a hang "
                              "(Megatron's communicators included, instead of its distributed_timeout_minutes)."),
    Setting("buddy", "buddy", bool, True,
            help="Keep a CPU copy of a data-parallel neighbour's optimizer shard (distributed optimizer or ZeRO "
                 "partition), so a replacement gets its state from a peer."),
    Setting("save_interval", "save_interval", int, 0, floor=0, note="0: never", metavar="K", deepspeed=False,
            help="Save a checkpoint every K steps, the fallback when no standby is left."),
    Setting("save_dir", "save_dir", str, "", metavar="DIR", deepspeed=False, shown_default="`<run-dir>/checkpoints`",
            help="Where checkpoints go."),
    Setting("warmup", "warmup", bool, True,
            help="Record each role class's first iteration and let standbys run a sandboxed iteration of every "
                 "stage kind before they are needed (off: standbys join cold)."),
    Setting("hold_for_warm", "hold_for_warm_s", float, 0.0, floor=0, note="0: do not wait", seconds=True,
            metavar="S", help="After step 1, hold training up to this many seconds until every standby is warm."),
    Setting("commit_interval", "commit_interval", int, 1, floor=1, note="1: vote at every step", metavar="K",
            help="Vote, take the rollback point and exchange the buddy copy every K steps; a failure redoes at "
                 "most K steps, bitwise."),
    Setting("async_commit", "async_commit", bool, True,
            help="Pack the rollback point, exchange the buddy copy and vote in a background thread while the next "
                 "step runs; a vote's verdict is read at the next boundary, so a failure redoes one step more "
                 "(off: the boundary waits for its own vote)."),
)

BY_KEY: Dict[str, Setting] = {s.key: s for s in SETTINGS}
BY_FIELD: Dict[str, Setting] = {s.field: s for s in SETTINGS if s.field is not None}


def chain(s: Setting) -> List[Setting]:
    """The settings ordered with ``s`` (the timeouts), lowest first."""
    low = s
    while low.above is not None:
        low = BY_KEY[low.above]
    out = [low]
    while True:
        nxt = [t for t in SETTINGS if t.above == out[-1].key]
        if not nxt:
            return out
        out.append(nxt[0])


def check_all(values: Mapping[str, Any], where: Callable[[Setting], str],
              name: Optional[Callable[[Setting], str]] = None, keys: Iterable[Setting] = SETTINGS) -> Dict[str, Any]:
    """Check ``values`` (by key) in table order, each against the one it must exceed; the checked
    values by key. ``where(s)`` names a value in an error (``pitstop.heartbeat_timeout``), ``name``
    the one it must exceed (default: ``where``). An order error prints the whole chain."""
    name = name or where
    out: Dict[str, Any] = {}
    for s in keys:
        if s.key not in values:
            continue
        out[s.key] = s.check(values[s.key], where(s))
        if s.above is not None and s.above in out and not out[s.key] > out[s.above]:
            links = [t for t in chain(s) if t.key in values]
            raise ConfigError(
                f"{where(s)}={values[s.key]!r}: expected {s.expected((name(BY_KEY[s.above]), out[s.above]))}; "
                f"they must be ordered {' < '.join(name(t) for t in links)}, got "
                f"{' < '.join(repr(out.get(t.key, values[t.key])) for t in links)}")
    return out


# ---------------------------------------------------------------------- the flags
def add_flags(parser, script: bool = False, defaults: Optional[Mapping[str, Any]] = None) -> None:
    """Add one flag per setting to ``parser`` (an argparse parser or group).

    ``script=False``: ``pitstop launch``'s flags (``--heartbeat-timeout``, ``--no-buddy``), default
    None so the launcher knows what was given. ``script=True``: the training script's
    ``--pitstop-*`` flags, default from ``defaults`` (by key; the launcher's environment)."""
    for s in SETTINGS:
        if script and not s.script:
            continue
        default = None if defaults is None else defaults.get(s.key, s.default)
        help = s.describe.replace("%", "%%")
        if s.negated:
            help = "Switches off (on by default): " + help
        elif s.type is not bool:
            help += f" (default {(s.shown_default or repr(s.default)).strip('`')})"
        if s.type is bool:
            parser.add_argument(s.flag(script), dest=s.dest(script), action="store_const", const=not s.default,
                                default=default, help=help)
        else:
            parser.add_argument(s.flag(script), dest=s.dest(script), type=s.argparse_type(), default=default,
                                metavar=s.metavar or None, help=help)


def given_flags(ns: argparse.Namespace, script: bool = False) -> Dict[str, Any]:
    """The settings (by key) whose flag a parsed namespace holds (a value that is not None)."""
    return {s.key: getattr(ns, s.dest(script)) for s in SETTINGS
            if getattr(ns, s.dest(script), None) is not None}


def runtime_fields(values: Mapping[str, Any]) -> Dict[str, Any]:
    """Values by key -> the :class:`RuntimeConfig` keyword arguments they hold."""
    return {s.field: values[s.key] for s in SETTINGS if s.field is not None and s.key in values}


# ---------------------------------------------------------------------- documentation
def flags_table() -> str:
    """The README's table of the training script's ``--pitstop-*`` flags."""
    rows = ["| Megatron flag | default | meaning |", "|---|---|---|"]
    for s in SETTINGS:
        if not s.script:
            continue
        flag = s.flag(script=True) + (f" {s.metavar}" if s.metavar else "")
        default = (f"{s.key} {'on' if s.default else 'off'}" if s.type is bool
                   else s.shown_default or repr(s.default))
        rows.append(f"| `{flag}` | {default} | {s.describe} |")
    return "\n".join(rows) + "\n"


def type_text(s: Setting) -> str:
    """``float > heartbeat_interval, s``: a setting's type and bound in the README's keys table."""
    text = {bool: "bool", int: "int", float: "float", str: "str"}[s.type]
    if s.above is not None:
        text += f" > {s.above}"
    elif s.floor is not None:
        text += f" {'>' if s.open else '>='} {s.floor:g}"
    return text + (", s" if s.seconds else "")
