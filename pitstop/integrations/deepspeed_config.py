"""The ``"pitstop"`` section of a DeepSpeed JSON config: parse, validate, take out.

A DeepSpeed job configures pitstop where it configures everything else, in its JSON::

    {
      "train_micro_batch_size_per_gpu": 4,
      "zero_optimization": {"stage": 2},
      "pitstop": {"standby": 1, "heartbeat_timeout": 5.0, "buddy": true}
    }

:func:`parse_section` validates the section into a frozen :class:`PitstopSection`;
:func:`strip_section` returns the config without it (for ``deepspeed.initialize``) and the
section. Keys are snake_case like DeepSpeed's own; times are seconds. Every error is a
:class:`pitstop.errors.ConfigError` naming the key path (``pitstop.heartbeat_timeout``), the
value and what was expected. Unknown keys are refused by name with the list of known keys,
and a bool is never taken for a number.

The module is pure: it imports neither ``torch.distributed`` nor DeepSpeed.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple, Union

from pitstop.errors import ConfigError
from pitstop.settings import BY_KEY, SETTINGS, check_all, runtime_fields, type_text

__all__ = ["SECTION", "EmulationSection", "PitstopSection", "parse_section", "load_config",
           "strip_section", "keys_table"]

SECTION = "pitstop"
"""The top-level key of the section in a DeepSpeed config."""


# ------------------------------------------------------------------------ the sections
@dataclass(frozen=True)
class EmulationSection:
    """``pitstop.emulation``: run the job as ``world_size`` ranks of which only ``real_ranks`` are processes."""

    world_size: int
    """The target world size the job believes it runs at (>= 1)."""
    real_ranks: Tuple[int, ...]
    """The ranks that run for real, each in ``[0, world_size)``, no repeats."""
    topology: str = "cpu-gloo-loopback"
    """The network model of the replay: a shipped name (``cpu-gloo-loopback``, ``h200-nvlink-ib``)
    or the path of a topology file."""


def _d(key: str):
    return BY_KEY[key].default


#: The settings the section holds (pitstop.settings.SETTINGS rows with ``deepspeed``), in table order.
_SETTINGS = tuple(s for s in SETTINGS if s.deepspeed)


@dataclass(frozen=True)
class PitstopSection:
    """The validated ``"pitstop"`` section of a DeepSpeed config (every key optional).

    Each field but ``emulation`` is a row of :data:`pitstop.settings.SETTINGS` (its default,
    bound and meaning live there; ``tests/unit/test_settings.py`` holds the two together)."""

    standby: int = _d("standby")
    heartbeat_interval: float = _d("heartbeat_interval")
    heartbeat_timeout: float = _d("heartbeat_timeout")
    collective_timeout: float = _d("collective_timeout")
    buddy: bool = _d("buddy")
    warmup: bool = _d("warmup")
    hold_for_warm: float = _d("hold_for_warm")
    emulation: Optional[EmulationSection] = None
    """Target-scale emulation settings; absent (None) for a normal run."""
    commit_interval: int = _d("commit_interval")  # after emulation: the field order is public
    async_commit: bool = _d("async_commit")
    given: FrozenSet[str] = field(default=frozenset(), compare=False, repr=False)
    """The keys the config wrote (the rest are defaults)."""

    def settings(self) -> Dict[str, Any]:
        """The settings' values by key (``emulation`` is not a setting of the table)."""
        return {s.key: getattr(self, s.key) for s in _SETTINGS}

    def runtime_config(self, base: Optional[Any] = None, env: Optional[Mapping[str, str]] = None):
        """This section as the worker runtime's :class:`pitstop.runtime.config.RuntimeConfig`.

        Precedence, as ``pitstop launch`` promises (explicit launch flags win): a setting the
        launcher passed (its ``PITSTOP_*`` variable is in ``env``, default ``os.environ``; the
        launcher already merged this section under its flags) stays as ``base`` has it; else a
        key the section wrote applies; else ``base``'s value (default: ``RuntimeConfig()``).
        Without that, the section's defaults overrode ``--no-warmup`` and ``--hold-for-warm``.
        ``standby`` and ``emulation`` are the launcher's business and have no runtime counterpart.
        """
        from dataclasses import replace

        from pitstop.runtime.config import RuntimeConfig

        env = os.environ if env is None else env
        base = base if base is not None else RuntimeConfig()
        mine = {k: v for k, v in self.settings().items() if k in self.given and BY_KEY[k].env not in env}
        return replace(base, **runtime_fields(mine))


# ---------------------------------------------------------------------------- checks
def _fmt(v: Any) -> str:
    return repr(v)


def _int(path: str, v: Any, lo: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{path}={_fmt(v)}: expected {what}, got {type(v).__name__}")
    if v < lo:
        raise ConfigError(f"{path}={_fmt(v)}: expected {what}")
    return v


def _unknown(path: str, values: Mapping[str, Any], known: List[str]) -> None:
    bad = [k for k in values if k not in known]
    if bad:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(repr(k) for k in bad)}; known keys are {', '.join(known)}"
        )


def _mapping(path: str, v: Any) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{path}={_fmt(v)}: expected an object (a JSON dict), got {type(v).__name__}")
    for k in v:
        if not isinstance(k, str):
            raise ConfigError(f"{path}: key {k!r} is not a string")
    return v


_SECTION_KEYS = [f.name for f in fields(PitstopSection) if f.name != "given"]
_EMULATION_KEYS = [f.name for f in fields(EmulationSection)]


def _parse_emulation(path: str, v: Any) -> EmulationSection:
    values = _mapping(path, v)
    _unknown(path, values, _EMULATION_KEYS)
    for key in ("world_size", "real_ranks"):
        if key not in values:
            raise ConfigError(f"{path}: missing key {key!r} (required: world_size, real_ranks)")
    n = _int(f"{path}.world_size", values["world_size"], 1, "an integer >= 1")
    rp = f"{path}.real_ranks"
    ranks = values["real_ranks"]
    if not isinstance(ranks, (list, tuple)) or not ranks:
        raise ConfigError(f"{rp}={_fmt(ranks)}: expected a non-empty list of ranks in [0, {n})")
    seen = set()
    for i, r in enumerate(ranks):
        if isinstance(r, bool) or not isinstance(r, int):
            raise ConfigError(f"{rp}[{i}]={_fmt(r)}: expected an integer rank in [0, {n}), got {type(r).__name__}")
        if not 0 <= r < n:
            raise ConfigError(f"{rp}[{i}]={_fmt(r)}: expected a rank in [0, {n}) (world_size {n})")
        if r in seen:
            raise ConfigError(f"{rp}[{i}]={_fmt(r)}: rank {r} is listed twice")
        seen.add(r)
    topology = values.get("topology", EmulationSection.topology)
    if not isinstance(topology, str) or not topology.strip():
        raise ConfigError(f"{path}.topology={_fmt(topology)}: expected a topology name or file path "
                          "(a non-empty string)")
    return EmulationSection(world_size=n, real_ranks=tuple(ranks), topology=topology)


def parse_section(values: Optional[Mapping[str, Any]], path: str = SECTION) -> PitstopSection:
    """Validate the ``"pitstop"`` section (``None`` or ``{}``: every default), with the rows of
    :data:`pitstop.settings.SETTINGS`: in table order, the timeouts each above the one before."""
    if values is None:
        return PitstopSection()
    values = _mapping(path, values)
    _unknown(path, values, _SECTION_KEYS)
    full = {s.key: values.get(s.key, s.default) for s in _SETTINGS}
    kw: Dict[str, Any] = check_all(full, where=lambda s: f"{path}.{s.key}", keys=_SETTINGS)
    if values.get("emulation") is not None:
        kw["emulation"] = _parse_emulation(f"{path}.emulation", values["emulation"])
    return PitstopSection(**kw, given=frozenset(values))


# ------------------------------------------------------------------- whole configs
def _no_duplicates(pairs):
    out: Dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(f"duplicate key {k!r} in the DeepSpeed config")
        out[k] = v
    return out


def load_config(config: Union[Mapping[str, Any], str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """A DeepSpeed config as a dict, from what ``deepspeed.initialize(config=...)`` accepts: a dict,
    the path of a JSON file, or a base64-encoded JSON string. A dict is deep-copied."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            raise ConfigError(f"DeepSpeed config {path}: is a directory, expected a JSON file")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    data = json.load(f, object_pairs_hook=_no_duplicates)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"DeepSpeed config {path}: not valid JSON ({exc})") from None
            except OSError as exc:
                raise ConfigError(f"DeepSpeed config {path}: cannot be read ({exc.strerror or exc})") from None
        else:
            try:
                text = base64.urlsafe_b64decode(path).decode("utf-8")
                data = json.loads(text, object_pairs_hook=_no_duplicates)
            except (binascii.Error, ValueError):
                raise ConfigError(
                    f"DeepSpeed config {path!r}: expected a dict, the path of an existing JSON file or "
                    "base64-encoded JSON") from None
        if not isinstance(data, dict):
            raise ConfigError(f"DeepSpeed config {path}: expected a JSON object at the top, got {type(data).__name__}")
        return data
    raise ConfigError(f"DeepSpeed config {config!r}: expected a dict or a path, got {type(config).__name__}")


def strip_section(config: Union[Mapping[str, Any], str, "os.PathLike[str]"]) -> Tuple[Dict[str, Any], PitstopSection]:
    """``(config without "pitstop", PitstopSection)``; the first goes to ``deepspeed.initialize``.

    The input is never modified. A config without the section gives every default.
    """
    data = load_config(config)
    _refuse_lookalikes(data)
    section = parse_section(data.pop(SECTION, None))
    return data, section


def unsupported(data: Mapping[str, Any]) -> List[str]:
    """What in a DeepSpeed config pitstop cannot keep bitwise across a replacement, one
    sentence each naming the key and its value (empty: everything is supported).

    ``pitstop.integrations.deepspeed.initialize`` and ``pitstop launch`` refuse a config
    that has any, before a process starts."""
    out: List[str] = []
    zero = data.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        return [f"zero_optimization={zero!r}: expected an object"]
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        out.append(f"zero_optimization.stage={stage!r}: expected a ZeRO stage 0, 1, 2 or 3")
    # ZeRO-3 variants that build process groups of their own, outside pitstop's registry (a
    # replacement could not rebuild or swap them)
    hpz = zero.get("zero_hpz_partition_size", 1)
    if hpz not in (None, 1):
        out.append(f"zero_optimization.zero_hpz_partition_size={hpz!r}: ZeRO++ hierarchical partitioning builds "
                   "secondary partition groups of its own, which pitstop does not rebuild; expected 1")
    mics = zero.get("mics_shard_size", -1)
    if mics not in (None, -1, 0):
        out.append(f"zero_optimization.mics_shard_size={mics!r}: MiCS builds shard groups of its own, which "
                   "pitstop does not rebuild; expected -1 (off)")
    for k in ("offload_optimizer", "offload_param"):
        dev = (zero.get(k) or {}).get("device", "none") if isinstance(zero.get(k) or {}, Mapping) else zero.get(k)
        if dev not in (None, "none"):
            out.append(f"zero_optimization.{k}.device={dev!r}: offload is not supported (the state a joiner "
                       "needs would live in CPU or NVMe buffers pitstop does not hand over)")
    fp16 = data.get("fp16") or {}
    if isinstance(fp16, Mapping) and fp16.get("enabled"):
        out.append("fp16.enabled=true: DeepSpeed's CPU accelerator has no fp16 without oneDNN fp16 support "
                   "(is_fp16_supported() is False on the CPUs pitstop is tested on), so pitstop's fp16 path "
                   "(carrying the dynamic loss scaler) has never run end to end; use bf16.enabled=true")
    # DeepSpeed reads "bf16", else the old name "bfloat16" (runtime/precision_config.py)
    bf16_key = "bf16" if data.get("bf16") is not None else "bfloat16"
    bf16 = data.get(bf16_key) or {}
    types = data.get("data_types") or {}
    accum = types.get("grad_accum_dtype") if isinstance(types, Mapping) else None
    if (isinstance(bf16, Mapping) and bf16.get("enabled") and stage == 1
            and str(accum).replace("torch.", "") in ("fp32", "float32", "float")):
        out.append(f"data_types.grad_accum_dtype={accum!r} with {bf16_key}.enabled=true and ZeRO stage 1: "
                   "DeepSpeed then runs its BF16_Optimizer, whose fp32 gradient accumulators pitstop does not "
                   "reset on a rollback (leave grad_accum_dtype unset, or use ZeRO stage 2)")
    if data.get("pipeline"):
        out.append("pipeline: DeepSpeed's pipeline engine is not supported (use Megatron-Core's pipeline)")
    sp = data.get("sequence_parallel_size", 1)
    if sp not in (None, 1):
        out.append(f"sequence_parallel_size={sp!r}: DeepSpeed-Ulysses sequence parallelism is not supported")
    for key, why in UNCARRIED_FEATURES.items():
        sect = data.get(key)
        if isinstance(sect, Mapping):  # compression_training has no top-level switch: any technique counts
            on = bool(sect) if key == "compression_training" else bool(sect.get("enabled"))
        else:
            on = bool(sect)
        if on:
            out.append(f"{key}.enabled=true: {why}")
    return out


#: DeepSpeed features that keep state or groups of their own which a joiner would not get,
#: so the run would leave the uninterrupted one (or hang): refused by name, with the reason.
UNCARRIED_FEATURES = {
    "amp": "NVIDIA Apex AMP keeps its own loss scaler and casts, which pitstop does not carry (use bf16)",
    "elasticity": "DeepSpeed's elastic training changes the batch layout with the world size; pitstop keeps the "
                  "world size and replaces members instead",
    "curriculum_learning": "the curriculum scheduler's difficulty state is not carried to a joiner",
    "data_efficiency": "the data sampler's and curriculum's state is not carried to a joiner",
    "progressive_layer_drop": "progressive layer drop's theta schedule lives in the engine and is not carried",
    "compression_training": "the compression scheduler's state is not carried to a joiner",
    "hybrid_engine": "the hybrid (training + inference) engine builds inference groups pitstop does not rebuild",
    "eigenvalue": "the eigenvalue computation keeps per-block state that is not carried to a joiner",
}


def refuse_unsupported(data: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` listing everything :func:`unsupported` finds."""
    bad = unsupported(data)
    if bad:
        raise ConfigError("DeepSpeed config uses what pitstop does not support: " + "; ".join(bad))


def _refuse_lookalikes(data: Mapping[str, Any]) -> None:
    """DeepSpeed 0.19.8 ignores unknown top-level keys, so a misspelt section would be dropped
    without a word: refuse a top-level key that looks like ``pitstop`` but is not."""
    import difflib

    for key in data:
        if key == SECTION or not isinstance(key, str):
            continue
        squashed = key.lower().replace("_", "").replace("-", "").replace(" ", "")
        if squashed == SECTION or difflib.SequenceMatcher(None, squashed, SECTION).ratio() >= 0.8:
            raise ConfigError(f"DeepSpeed config key {key!r}: did you mean {SECTION!r}? (DeepSpeed would "
                              "ignore it silently)")


# ---------------------------------------------------------------------- documentation
_TYPES = {
    "emulation": "object",
    "emulation.world_size": "int >= 1",
    "emulation.real_ranks": "list of int",
    "emulation.topology": "str",
}


def _doc(cls, name: str) -> str:
    """The attribute docstring of ``cls.name`` (read from the source), as one line."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    for i, node in enumerate(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == name and i + 1 < len(body)):
            nxt = body[i + 1]
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                return " ".join(nxt.value.value.split()).replace("``", "`")  # reST -> markdown
    return ""


def _default(v: Any) -> str:
    if v is None:
        return "absent"
    return json.dumps(v)


def keys_table() -> str:
    """A markdown table of every key (key, type, default, meaning), for the README: the
    settings' rows from :data:`pitstop.settings.SETTINGS`, then ``emulation``'s."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for st in _SETTINGS:
        rows.append(f"| `{SECTION}.{st.key}` | {type_text(st)} | {_default(st.default)} | {st.describe} |")
    rows.append(f"| `{SECTION}.emulation` | {_TYPES['emulation']} | absent | "
                f"{_doc(PitstopSection, 'emulation')} |")
    for f in fields(EmulationSection):
        default = "required" if f.default is MISSING else _default(f.default)
        rows.append(f"| `{SECTION}.emulation.{f.name}` | {_TYPES['emulation.' + f.name]} | {default} | "
                    f"{_doc(EmulationSection, f.name)} |")
    return "\n".join(rows) + "\n"
