"""The control protocol's envelope: every message that anybody acts on is authenticated.

Anything read from the control store is untrusted: any process that reaches the
store's port can write any key, and TCPStore traffic is plain text on the wire. So
a message is *sealed* with an HMAC under the job token, over the key it is written
to and its JSON body, and *opened* (verified, size-checked, parsed, shape-checked)
before anything acts on it::

    writer                                    store                      reader
    seal(key, body) = "ps1." mac "." json --> key --------------------> open(key, raw, schema)
          mac = HMAC-SHA256(token, "pitstop/1" | key | json)                 |  bad: Refused(key, why)
                                                                             v  good: body (a dict)

- The MAC covers the key, and every key names what it is about (slot, generation,
  step), so a message copied to another key, another generation or another job
  does not verify: replay onto another key is refused. A message written again to
  its own key is the same message (idempotent), except for counters that must grow,
  such as heartbeats, which the reader checks itself.
- Atomic counters (``add``) and the vote's ``compare_set`` slots cannot carry a MAC:
  their names get a suffix derived from the token (:meth:`Channel.private`), so a
  process without the token cannot even find them, let alone poison them.
- Sealing is deterministic (same key and body, same bytes), which the vote's
  ``compare_set`` relies on.

Pure: no torch import. The store is anything with ``get/set/check/add/compare_set``.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import time
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Union

from pitstop.errors import PitstopError, Refused  # noqa: F401 - Refused re-exported (pitstop.protocol.Refused)

log = logging.getLogger(__name__)

MAGIC = b"ps1."
DOMAIN = b"pitstop/1"
MAX_BYTES = 256 * 1024
"""Largest message anybody reads (a warmup report with every class is ~10 KiB)."""


ENV_TOKEN = "PITSTOP_JOB_TOKEN"


def new_token() -> str:
    """A fresh job token (256 random bits, hex)."""
    return secrets.token_hex(32)


def job_id(token: Union[str, bytes]) -> str:
    """A job's public name, derived from its token: every machine holding the token finds the
    job's keys (``/pitstop/<id>/`` in etcd) without another setting, and the name reveals
    nothing of the token."""
    t = token.encode() if isinstance(token, str) else bytes(token)
    return hmac.new(t, b"pitstop job id", hashlib.sha256).hexdigest()[:16]


def take_token_from_env() -> str:
    """Read the job token and remove it from this process's environment.

    Once pitstop holds it, the user script's own children (data loader workers,
    shell-outs) do not inherit it. Returns "" when there is none."""
    return os.environ.pop(ENV_TOKEN, "")


def _mac(token: bytes, key: str, payload: bytes) -> bytes:
    return hmac.new(token, DOMAIN + b"\0" + key.encode() + b"\0" + payload, hashlib.sha256).hexdigest().encode()


def seal(token: Union[str, bytes], key: str, body: Any) -> bytes:
    """The bytes to store under ``key``: ``ps1.<hex mac>.<canonical json>``."""
    tok = token.encode() if isinstance(token, str) else token
    if not tok:
        raise PitstopError("no job token: a control message cannot be sealed (is PITSTOP_JOB_TOKEN set?)")
    payload = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return MAGIC + _mac(tok, key, payload) + b"." + payload


MAGIC_RAW = b"ps1r."
DOMAIN_RAW = b"pitstop/1/raw"


def seal_raw(token: bytes, key: str, data: bytes) -> bytes:
    """Opaque bytes (a gloo address, an NCCL id, a world-collective payload) sealed for ``key``:
    ``ps1r.<hex mac>.<data>``. A domain of its own, so a raw value never opens as a message."""
    if not token:
        raise PitstopError("no job token: a value cannot be sealed (is PITSTOP_JOB_TOKEN set?)")
    mac = hmac.new(token, DOMAIN_RAW + b"\0" + key.encode() + b"\0" + data, hashlib.sha256).hexdigest().encode()
    return MAGIC_RAW + mac + b"." + data


def open_raw(token: bytes, key: str, raw: Any, max_bytes: int = 64 * 1024 * 1024) -> bytes:
    """The bytes :func:`seal_raw` sealed for ``key``; :class:`Refused` naming why not."""
    if not isinstance(raw, (bytes, bytearray)):
        raise Refused(key, f"value of type {type(raw).__name__}, expected bytes")
    raw = bytes(raw)
    if len(raw) > max_bytes:
        raise Refused(key, f"oversized: {len(raw)} bytes > {max_bytes}")
    if not raw.startswith(MAGIC_RAW) or raw[len(MAGIC_RAW) + 64:len(MAGIC_RAW) + 65] != b".":
        raise Refused(key, f"unauthenticated: no sealed envelope (starts {raw[:12]!r})")
    mac, data = raw[len(MAGIC_RAW):len(MAGIC_RAW) + 64], raw[len(MAGIC_RAW) + 65:]
    want = hmac.new(token, DOMAIN_RAW + b"\0" + key.encode() + b"\0" + data, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(mac, want):
        raise Refused(key, "bad MAC: not written with this job's token, or written for another key")
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def open_(token: Union[str, bytes], key: str, raw: Any, schema: Optional["Schema"] = None,
          max_bytes: int = MAX_BYTES) -> Any:
    """Verify and parse what ``key`` holds; raise :class:`Refused` naming why not."""
    tok = token.encode() if isinstance(token, str) else token
    if not isinstance(raw, (bytes, bytearray)):
        raise Refused(key, f"value of type {type(raw).__name__}, expected bytes")
    raw = bytes(raw)
    if len(raw) > max_bytes:
        raise Refused(key, f"oversized: {len(raw)} bytes > {max_bytes}")
    if not raw.startswith(MAGIC):
        raise Refused(key, f"unauthenticated: no pitstop envelope (starts {raw[:12]!r})")
    mac, dot, payload = raw[len(MAGIC):].partition(b".")
    if not dot or len(mac) != 64:
        raise Refused(key, "malformed envelope: no 64-digit MAC")
    if not hmac.compare_digest(mac, _mac(tok, key, payload)):
        raise Refused(key, "bad MAC: not written with this job's token, or written for another key")
    try:
        body = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refused(key, f"malformed JSON: {exc}") from None
    if schema is not None:
        try:
            body = schema.check(body)
        except ValueError as exc:
            raise Refused(key, f"malformed message: {exc}") from None
    return body


# --------------------------------------------------------------------------- message shapes
class Field:
    """One field of a message: its types, whether it must be there, and bounds for numbers."""

    def __init__(self, *types: type, required: bool = True, lo: Optional[float] = None,
                 hi: Optional[float] = None, choices: Optional[Iterable[Any]] = None, max_len: int = 4096) -> None:
        self.types = types
        self.required = required
        self.lo, self.hi = lo, hi
        self.choices = None if choices is None else tuple(choices)
        self.max_len = max_len

    def check(self, name: str, v: Any) -> Any:
        if v is None and type(None) in self.types:
            return v
        ok = isinstance(v, self.types) and not (isinstance(v, bool) and bool not in self.types)
        if not ok:
            want = "|".join("null" if t is type(None) else t.__name__ for t in self.types)
            raise ValueError(f"{name}={_short(v)}: expected {want}, got {type(v).__name__}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{name}={v}: expected a finite number")
            if self.lo is not None and v < self.lo:
                raise ValueError(f"{name}={v}: expected >= {self.lo}")
            if self.hi is not None and v > self.hi:
                raise ValueError(f"{name}={v}: expected <= {self.hi}")
        if isinstance(v, (str, list, dict)) and len(v) > self.max_len:
            raise ValueError(f"{name}: {len(v)} items, expected at most {self.max_len}")
        if self.choices is not None and v not in self.choices:
            raise ValueError(f"{name}={_short(v)}: expected one of {', '.join(map(repr, self.choices))}")
        return v


class Schema:
    """The shape of one kind of message: a dict with these fields (unknown fields are refused)."""

    def __init__(self, name: str, fields: Mapping[str, Field], extra: bool = False) -> None:
        self.name = name
        self.fields = dict(fields)
        self.extra = extra

    def check(self, body: Any) -> Dict[str, Any]:
        if not isinstance(body, dict):
            raise ValueError(f"{self.name}: expected an object, got {type(body).__name__}")
        for k, f in self.fields.items():
            if k in body:
                f.check(f"{self.name}.{k}", body[k])
            elif f.required:
                raise ValueError(f"{self.name}: missing field {k!r}")
        if not self.extra:
            unknown = sorted(set(body) - set(self.fields))
            if unknown:
                raise ValueError(f"{self.name}: unknown field(s) {', '.join(map(repr, unknown[:5]))}")
        return body


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


_INT = (int,)
_NUM = (int, float)
NAT = dict(lo=0, hi=2 ** 53)

HELLO = Schema("hello", {"pid": Field(int, lo=1, hi=2 ** 31), "host": Field(str, max_len=255),
                         "standby": Field(bool), "rank": Field(int, type(None), **NAT)})
JOIN_VERDICT = Schema("join-verdict", {"ok": Field(bool), "reason": Field(str, required=False),
                                       "slot": Field(int, required=False, **NAT)})
ASSIGN = Schema("assign", {"role": Field(int, **NAT), "generation": Field(int, **NAT),
                           "roles": Field(list, required=False, max_len=4096),
                           "mode": Field(str, choices=("recover", "drain")),
                           "step": Field(int, required=False, **NAT),
                           "from_generation": Field(int, required=False, **NAT)})
FAULT = Schema("fault", {"role": Field(int, required=False, **NAT), "roles": Field(list, required=False, max_len=4096),
                         "joiners": Field(list, required=False, max_len=4096),
                         "generation": Field(int, required=False, **NAT),
                         "step": Field(int, required=False, **NAT), "joiner": Field(str, required=False),
                         "fallback": Field(bool, required=False), "resume_step": Field(int, required=False, **NAT)})
DRAIN = Schema("drain", {"role": Field(int, **NAT), "roles": Field(list, required=False, max_len=4096),
                         "generation": Field(int, **NAT), "joiner": Field(str)})
DRAIN_REQUEST = Schema("drain-request", {"rank": Field(int, type(None), **NAT), "host": Field(str, type(None), max_len=255)})
HEARTBEAT = Schema("heartbeat", {"n": Field(int, **NAT)})
COMMITTED = Schema("committed", {"generation": Field(int, **NAT), "step": Field(int, **NAT), "time": Field(*_NUM, lo=0)})
STAMP = Schema("stamp", {"time": Field(*_NUM, lo=0)})
FLAG = Schema("flag", {"set": Field(bool)})
DRAIN_SWITCH = Schema("drain-switch", {"step": Field(int, **NAT), "time": Field(*_NUM, lo=0)})
TIMING = Schema("timing", {}, extra=True)
RECORD = Schema("record", {"cls": Field(str, choices=("only", "first", "middle", "last")), "role": Field(int, **NAT),
                           "path": Field(str, max_len=4096), "bytes": Field(int, **NAT),
                           "value_bytes": Field(int, **NAT), "ops": Field(int, **NAT), "record_s": Field(*_NUM, lo=0)})
WARM = Schema("warm", {"pid": Field(int, lo=1, hi=2 ** 31), "results": Field(list, max_len=16),
                       "stopped": Field(str), "ok": Field(bool), "rss_bytes": Field(int, **NAT)})
VOTE = Schema("vote", {"verdict": Field(str, max_len=2048)})


class Verdict:
    """The words a step's vote settles to (the ``verdict`` of :data:`VOTE`), written and read
    only through here, by the workers' boundary and by the controller::

        "ok"                          every rank arrived healthy: the step (window) is final
        "switch"                      as ok, and a prepared drain switches after this step
        "switch next"                 as ok (an asynchronous vote, read a step late): the drain
                                      switches after the next step, which everyone votes at once
        "poisoned at r5: <why>"       a rank's groups broke: the window is discarded
        '{"fault": {...}}'            the controller settled it first: discarded, replaced
    """

    OK = "ok"
    SWITCH = "switch"
    SWITCH_NEXT = "switch next"
    _POISONED = "poisoned"
    WHY_MAX = 1500

    @classmethod
    def poisoned(cls, rank: Optional[int], why: str) -> str:
        """A rank's (or, with ``rank`` None, the reader's own) poisoned verdict."""
        where = f" at r{rank}" if rank is not None else ""
        return f"{cls._POISONED}{where}: {str(why)[:cls.WHY_MAX]}"

    #: The roles a fault's verdict names (the rest are counted): the verdict is read as "not
    #: final" and its roles only logged, and a slot holds at most 2,048 characters. 62 machines
    #: lost at 4,096 ranks made a verdict of 2,914, refused by every reader.
    FAULT_ROLES_MAX = 64

    @classmethod
    def fault(cls, fault: Dict[str, Any]) -> str:
        """The controller's verdict for a step that a failure discards (the fault key holds
        every role; the verdict names the first :attr:`FAULT_ROLES_MAX`)."""
        roles = fault.get("roles")
        if isinstance(roles, list) and len(roles) > cls.FAULT_ROLES_MAX:
            fault = {**fault, "roles": roles[:cls.FAULT_ROLES_MAX], "roles_not_named": len(roles) - cls.FAULT_ROLES_MAX}
        return json.dumps({"fault": fault})

    @classmethod
    def commits(cls, v: Optional[str]) -> bool:
        """The step is final (ok, or ok with a switch now or after the next step)."""
        return v in (cls.OK, cls.SWITCH, cls.SWITCH_NEXT)

    @classmethod
    def is_poisoned(cls, v: Optional[str]) -> bool:
        return v is not None and v.startswith(cls._POISONED)
CLASSES = Schema("classes", {"classes": Field(list, max_len=4)})
ROSTER = Schema("roster", {}, extra=True)
LAYOUT = Schema("layout", {"world_size": Field(int, lo=1, hi=2 ** 24), "tp": Field(int, lo=1, hi=2 ** 24),
                           "pp": Field(int, lo=1, hi=2 ** 24), "cp": Field(int, lo=1, hi=2 ** 24),
                           "ep": Field(int, lo=1, hi=2 ** 24), "etp": Field(int, type(None), lo=1, hi=2 ** 24),
                           "order": Field(str, max_len=64), "shard_kind": Field(str, max_len=32)})

#: Where a script's own checkpoints are (Megatron-LM's ``--save``): an absolute directory and the
#: name of the file in it that holds the last complete save's step (``latest_checkpointed_iteration.txt``).
CHECKPOINT = Schema("checkpoint", {"dir": Field(str, max_len=4096), "marker": Field(str, max_len=255)})


#: The controller's own state (launch.controller.Controller._state); checked field by field on restore.
CONTROLLER_STATE = Schema("controller-state", {}, extra=True)
NODE_LINK = Schema("node-link", {"host": Field(str, max_len=255), "port": Field(int, lo=1, hi=65535)})
NODE_HELLO = Schema("node-hello", {"node": Field(int, lo=0, hi=2 ** 20), "host": Field(str, max_len=255),
                                   "addr": Field(str, max_len=255), "nproc": Field(int, lo=1, hi=4096),
                                   "pid": Field(int, lo=1, hi=2 ** 31)})
NODE_CMD = Schema("node-cmd", {"op": Field(str, choices=("start", "kill")), "name": Field(str, max_len=64),
                               "env": Field(dict, required=False, max_len=256),
                               "sig": Field(int, required=False, lo=1, hi=64)})
NODE_STARTED = Schema("node-started", {"pid": Field(int, lo=1, hi=2 ** 31)})
NODE_HUNG = Schema("node-hung", {"pid": Field(int, type(None), lo=1, hi=2 ** 31), "silent_s": Field(*_NUM, lo=0)})
NODE_EXIT = Schema("node-exit", {"pid": Field(int, type(None), lo=1, hi=2 ** 31), "exit": Field(str, max_len=200)})


def role_list(body: Dict[str, Any], world: int) -> list:
    """The roles a fault or assignment names (``roles``, or the older single ``role``),
    each an int in ``[0, world)``, no repeats; ValueError naming the bad one if not."""
    roles = body.get("roles")
    if roles is None:
        roles = [] if body.get("role") is None else [body["role"]]
    for r in roles:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
            raise ValueError(f"role {r!r}: expected an int in [0, {world})")
    if len(set(roles)) != len(roles):
        raise ValueError(f"roles {roles}: a role is named twice")
    return sorted(roles)


def check_timing(body: Dict[str, Any]) -> Dict[str, Any]:
    """A worker's timing report: a flat dict of numbers, booleans and nulls."""
    for k, v in body.items():
        if not (v is None or isinstance(v, (bool, int, float))) or len(k) > 64:
            raise ValueError(f"timing.{k[:64]}={_short(v)}: expected a number")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"timing.{k}={v}: expected a finite number")
    return body


TIMING.check = lambda body, _c=TIMING.check: check_timing(_c(body))  # type: ignore[method-assign]


# --------------------------------------------------------------------------- big messages (Channel.put_big)
BIG_CHUNK_BYTES = 128 * 1024
"""Default chunk of :meth:`Channel.put_big`: one stored value is this plus :data:`RAW_ENVELOPE`."""
BIG_CHUNK_MAX = 1024 * 1024
"""The largest chunk :meth:`Channel.put_big` takes (etcd refuses a request over 1.5 MiB)."""
BIG_MAX_BYTES = 64 * 1024 * 1024
"""The largest body :meth:`Channel.put_big` writes and :meth:`Channel.read_big` reads by default."""
RAW_ENVELOPE = len(MAGIC_RAW) + 64 + 1
"""Bytes :func:`seal_raw` adds to its data."""
_HEX64 = frozenset("0123456789abcdef")

BIG_MANIFEST = Schema("big-manifest", {"chunks": Field(int, lo=1, hi=2 ** 20), "bytes": Field(int, lo=1, hi=2 ** 40),
                                       "sha256": Field(str, max_len=64),
                                       "prev": Field(dict, type(None), required=False, max_len=2)})


def big_chunk_key(key: str, digest: str, i: int) -> str:
    """Where chunk ``i`` of the version of ``key`` whose canonical JSON has sha256 ``digest`` lives."""
    return f"{key}/v{digest[:16]}/c{i}"


def _is_digest(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and set(v) <= _HEX64


def _manifest_fault(man: Dict[str, Any], max_bytes: int) -> str:
    """Why a verified manifest cannot be read ('' if it can)."""
    if not _is_digest(man["sha256"]):
        return f"malformed message: big-manifest.sha256={_short(man['sha256'])}: expected 64 hex digits"
    if man["bytes"] > max_bytes:
        return f"oversized: {man['bytes']} bytes > {max_bytes}"
    if man["chunks"] > man["bytes"]:
        return f"malformed message: {man['chunks']} chunks for {man['bytes']} bytes"
    prev = man.get("prev")
    if prev is not None and not (_is_digest(prev.get("sha256")) and isinstance(prev.get("chunks"), int)
                                 and not isinstance(prev.get("chunks"), bool) and 1 <= prev["chunks"] <= 2 ** 20):
        return f"malformed message: big-manifest.prev={_short(prev)}"
    return ""


# --------------------------------------------------------------------------- the channel
class Channel:
    """The control store as seen by one process that holds the job token.

    ``put`` seals, ``read`` opens; a message that does not open is reported once to
    ``on_refused(key, reason)`` (the controller writes a ``refused`` event, a worker a
    log line) and read as absent, so the caller keeps waiting for a good one. Nothing
    raised by the store's content escapes ``read``.

    Junk written over a good message would lose it, so the writer *owns* what it put
    (``own=True``, the default) and :meth:`reassert` (the controller's loop, a worker's
    heartbeat thread) writes back every owned message that was overwritten. Channels of
    one process share ``owned`` so that one thread can reassert what another put.
    """

    def __init__(self, store: Any, token: Union[str, bytes],
                 on_refused: Optional[Callable[[str, str], None]] = None,
                 owned: Optional[Dict[str, bytes]] = None) -> None:
        self.store = store
        self.token = token.encode() if isinstance(token, str) else token
        self.on_refused = on_refused or (lambda key, reason: log.warning("refused %s: %s", key, reason))
        self._seen: Dict[str, bytes] = {}
        self._opened: Dict[str, tuple] = {}
        """key -> (raw, schema, body) of the last message that verified there: a poll that finds the
        same bytes again skips the MAC and the JSON (the controller polls every member's heartbeat)."""
        self.refused = 0
        self.owned: Dict[str, bytes] = {} if owned is None else owned
        self._no_multi = False

    def sibling(self, store: Any) -> "Channel":
        """The same identity over another store connection (a store client is one thread's)."""
        return Channel(store, self.token, self.on_refused, self.owned)

    # -- sealed messages
    def put(self, key: str, body: Any, own: bool = True) -> None:
        """Seal and write; ``own=False`` for values that others overwrite legitimately
        (the last commit) or that are rewritten anyway (heartbeats)."""
        raw = seal(self.token, key, body)
        self.store.set(key, raw)
        if own:
            self.owned[key] = raw

    def disown(self, key: str) -> None:
        self.owned.pop(key, None)

    def reassert(self) -> int:
        """Write back every owned message that is no longer in the store as written; returns how many.

        Where the store has ``multi_get`` (``TCPStore``), all of them are read back in two
        operations (a ``check`` that every key is there, then one ``multi_get``), not two per
        key: a process that owns many messages reasserts them every fraction of a second."""
        items = list(self.owned.items())
        multi = getattr(self.store, "multi_get", None)
        if multi is not None and len(items) > 1 and not self._no_multi:
            names = [k for k, _ in items]
            try:
                if self.store.check(names):
                    n = 0
                    for (key, raw), got in zip(items, multi(names)):
                        got = bytes(got)
                        if got != raw:
                            self._refuse(key, "overwritten: the sealed message was written back", got)
                            self.store.set(key, raw)
                            n += 1
                    return n
            except (RuntimeError, NotImplementedError) as exc:  # a store without it: key by key from now on
                if "timeout" in str(exc).lower():
                    raise
                self._no_multi = True
        n = 0
        for key, raw in items:
            got = self.store.get(key) if self.store.check([key]) else None
            if got != raw:
                if got is not None:
                    self._refuse(key, "overwritten: the sealed message was written back", got)
                self.store.set(key, raw)
                n += 1
        return n

    def read(self, key: str, schema: Optional[Schema] = None, present: bool = False) -> Optional[Any]:
        """The verified body under ``key``; None when absent or refused. ``present``: the caller
        waited for the key, so the existence check (one round trip) is skipped."""
        if not present and not self.store.check([key]):
            return None
        raw = self.store.get(key)
        hit = self._opened.get(key)
        if hit is not None and hit[0] == raw and hit[1] is schema:  # polled again, unchanged: verified already
            return copy.deepcopy(hit[2])
        try:
            body = open_(self.token, key, raw, schema)
        except Refused as exc:
            self._refuse(key, exc.reason, raw)
            return None
        if len(self._opened) > 4096:
            self._opened.clear()
        self._opened[key] = (bytes(raw), schema, body)
        return copy.deepcopy(body)

    def refuse(self, key: str, reason: str, raw: bytes = b"") -> None:
        """Report a message that opened but cannot be acted on (e.g. a role out of range)."""
        self._refuse(key, reason, raw)

    def _refuse(self, key: str, reason: str, raw: bytes) -> None:
        digest = hashlib.sha256(bytes(raw) + reason.encode()).digest()
        if self._seen.get(key) == digest:  # polled again: the same junk is reported once
            return
        self._seen[key] = digest
        self.refused += 1
        try:
            self.on_refused(key, reason)
        except Exception:  # noqa: BLE001 - reporting must not become the crash it reports
            log.exception("reporting a refused message on %s failed", key)

    def wait(self, key: str, schema: Optional[Schema] = None, timeout_s: float = 60.0,
             interrupted: Optional[Callable[[], bool]] = None, period_s: float = 0.02) -> Optional[Any]:
        """Poll until ``key`` holds a good message; None if ``interrupted()`` or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            body = self.read(key, schema)
            if body is not None:
                return body
            if interrupted is not None and interrupted():
                return None
            if time.monotonic() > deadline:
                return None
            time.sleep(period_s)

    # -- counters and compare-and-set slots: private names
    def private(self, key: str) -> str:
        """``key`` with a token-derived suffix: for ``add`` and ``compare_set``, which carry no MAC."""
        tag = hmac.new(self.token, b"name\0" + key.encode(), hashlib.sha256).hexdigest()[:20]
        return f"{key}/{tag}"

    def add(self, key: str, n: int) -> int:
        return int(self.store.add(self.private(key), n))

    def vote(self, key: str, desired: str) -> str:
        """Settle ``key`` once: the first sealed verdict wins; returns the verdict that holds."""
        name = self.private(key)
        got = self.store.compare_set(name, "", seal(self.token, name, {"verdict": desired}))
        try:
            return open_(self.token, name, got, VOTE)["verdict"]
        except Refused as exc:  # cannot happen without the token; never act on it
            self._refuse(name, exc.reason, got)
            return "poisoned: the vote holds a message that does not verify"

    def settled(self, key: str, present: bool = False) -> Optional[str]:
        """The verdict of ``key`` if one is settled, else None (``present``: see :meth:`read`)."""
        name = self.private(key)
        body = self.read(name, VOTE, present=present)
        return None if body is None else body["verdict"]

    # -- big messages: chunked (appended; ``put``/``read`` above stay for messages under MAX_BYTES)
    def put_big(self, key: str, body: Any, own: bool = True, chunk_bytes: int = BIG_CHUNK_BYTES) -> Dict[str, Any]:
        """Write ``body`` (any size up to :data:`BIG_MAX_BYTES`) as sealed chunks, then its manifest
        (see :func:`big_chunk_key`); returns the manifest. A roster of 8,192 roles (~560 KB) is 5 chunks.

        ::

            key/v<digest16>/c0 .. c<n-1>   seal_raw(token, that key, chunk i of the canonical JSON)
            key                            seal(token, key, {chunks, bytes, sha256, prev})   written LAST

        Each stored value is at most ``chunk_bytes`` + :data:`RAW_ENVELOPE` bytes, so one request stays
        under etcd's 1.5 MiB and TCPStore's 8 MiB (:mod:`pitstop.limits`). The chunks of a version
        live under its own digest, so a reader never mixes two versions; a rewrite deletes the chunks
        of the version *before* the one it replaces (named by the manifest's ``prev``), not those
        of the one it replaces: a reader that read that manifest a moment ago still finds them
        (a TCPStore ``get`` of a deleted key would block for the store's whole timeout).
        ``own``: the manifest and the chunks are written back by :meth:`reassert`."""
        if not 1 <= chunk_bytes <= BIG_CHUNK_MAX:
            raise PitstopError(f"put_big({key!r}): chunk_bytes={chunk_bytes}, expected 1..{BIG_CHUNK_MAX}")
        if not self.token:
            raise PitstopError("no job token: a control message cannot be sealed (is PITSTOP_JOB_TOKEN set?)")
        payload = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        if len(payload) > BIG_MAX_BYTES:
            raise PitstopError(f"put_big({key!r}): {len(payload)} bytes > {BIG_MAX_BYTES}")
        digest = hashlib.sha256(payload).hexdigest()
        n = max(1, -(-len(payload) // chunk_bytes))
        older = self._big_manifest(key)  # what this rewrite replaces (kept), and what that one replaced (dropped)
        prev = None if older is None else {"sha256": older["sha256"], "chunks": older["chunks"]}
        if older is not None and older["sha256"] == digest:  # the same body again: it replaces nothing
            prev = older.get("prev")
        for i in range(n):  # written again even when the same: a restarted writer owns them too
            ck = big_chunk_key(key, digest, i)
            raw = seal_raw(self.token, ck, payload[i * chunk_bytes:(i + 1) * chunk_bytes])
            self.store.set(ck, raw)
            if own:
                self.owned[ck] = raw
        manifest = {"chunks": n, "bytes": len(payload), "sha256": digest, "prev": prev}
        self.put(key, manifest, own=own)
        drop = older.get("prev") if older is not None and older["sha256"] != digest else None
        if drop is not None and drop["sha256"] not in (digest, older["sha256"]):
            self._drop_big_chunks(key, drop["sha256"], drop["chunks"])
        if older is not None and older["sha256"] != digest:  # superseded: kept for readers, not reasserted
            for i in range(older["chunks"]):
                self.owned.pop(big_chunk_key(key, older["sha256"], i), None)
        return manifest

    def _big_manifest(self, key: str) -> Optional[Dict[str, Any]]:
        """The manifest under ``key`` if one verifies (a writer's look; nothing refused is reported)."""
        if not self.store.check([key]):
            return None
        try:
            man = open_(self.token, key, self.store.get(key), BIG_MANIFEST)
        except Refused:
            return None
        return man if not _manifest_fault(man, BIG_MAX_BYTES) else None

    def _drop_big_chunks(self, key: str, digest: str, n: int) -> None:
        delete = getattr(self.store, "delete_key", None)
        for i in range(n):
            ck = big_chunk_key(key, digest, i)
            self.owned.pop(ck, None)
            if delete is None:
                continue
            try:
                delete(ck)
            except (RuntimeError, NotImplementedError) as exc:  # a store that cannot delete keeps them
                log.debug("put_big(%s): cannot delete %s (%s)", key, ck, exc)
                return

    def read_big(self, key: str, schema: Optional[Schema] = None,
                 max_bytes: int = BIG_MAX_BYTES) -> Optional[Any]:
        """The verified body :meth:`put_big` wrote under ``key``; None when absent or refused (reported
        to ``on_refused(key, why)``, naming the chunk at fault). Nothing raised by the store's
        content escapes. A manifest polled again unchanged costs one ``check`` and one ``get`` (and a
        JSON parse): its digest pins the body."""
        for attempt in range(3):
            if not self.store.check([key]):
                return None
            raw = self.store.get(key)
            ck_cache = key + "\0big"
            hit = self._opened.get(ck_cache)
            if hit is not None and hit[0] == raw and hit[1] is schema:  # parsed again: faster than a deep copy
                return json.loads(hit[2])
            try:
                man = open_(self.token, key, raw, BIG_MANIFEST)
            except Refused as exc:
                self._refuse(key, exc.reason, raw)
                return None
            fault = _manifest_fault(man, max_bytes)
            if fault:
                self._refuse(key, fault, raw)
                return None
            digest, n = man["sha256"], man["chunks"]
            cks = [big_chunk_key(key, digest, i) for i in range(n)]
            if not self.store.check(cks):
                now = self.store.get(key) if self.store.check([key]) else None
                if now != raw and attempt < 2:  # rewritten meanwhile: read the new version
                    continue
                i = next((i for i, ck in enumerate(cks) if not self.store.check([ck])), None)
                if i is None:  # there after all (written back meanwhile): read again
                    continue
                self._refuse(key, f"chunk {i} of {n} ({cks[i]}) is missing", raw)
                return None
            parts = []
            for i, (ck, craw) in enumerate(zip(cks, self._get_many(cks, man["bytes"] // n + RAW_ENVELOPE))):
                try:
                    parts.append(open_raw(self.token, ck, craw, man["bytes"] + RAW_ENVELOPE))
                except Refused as exc:
                    self._refuse(key, f"chunk {i} of {n} ({ck}): {exc.reason}", craw)
                    return None
            payload = b"".join(parts)
            if len(payload) != man["bytes"]:
                self._refuse(key, f"its chunks hold {len(payload)} bytes, its manifest says {man['bytes']}", raw)
                return None
            if hashlib.sha256(payload).hexdigest() != digest:
                self._refuse(key, "its chunks do not match its manifest's sha256", raw)
                return None
            try:
                body = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
            except (UnicodeDecodeError, ValueError) as exc:
                self._refuse(key, f"malformed JSON: {exc}", raw)
                return None
            if schema is not None:
                try:
                    body = schema.check(body)
                except ValueError as exc:
                    self._refuse(key, f"malformed message: {exc}", raw)
                    return None
            if len(self._opened) > 4096:
                self._opened.clear()
            self._opened[ck_cache] = (bytes(raw), schema, payload)
            return body
        return None

    def _get_many(self, keys_: list, each: int) -> list:
        """``get`` of every key (present), through ``multi_get`` in batches of ~1 MiB where the store has it."""
        multi = getattr(self.store, "multi_get", None)
        if multi is None:
            return [self.store.get(k) for k in keys_]
        batch = max(1, (1024 * 1024) // max(1, each))
        out: list = []
        for i in range(0, len(keys_), batch):
            out.extend(multi(keys_[i:i + batch]))
        return out

