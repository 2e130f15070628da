"""Small, named, version-guarded, reversible patches of third-party code.

A :class:`Patch` replaces one attribute (``module`` + dotted ``attr``) with a value built
from the original by ``replacement(original)``. Before touching anything it checks that

* the distribution (``dist``, default ``megatron-core``) is installed at a version in
  ``requires`` (a :class:`packaging.specifiers.SpecifierSet` string),
* the module imports and the attribute exists,
* the original still has the parameter names ``params`` (``inspect.signature``), and
* the original's source still contains each fragment of ``source_contains`` (for patches
  that rely on a detail of the body, e.g. a ``.cuda()`` call they neutralise; when the original
  is not a function or class, e.g. ``torch`` as imported by ``module``, the source of ``module``
  is searched),

and raises :class:`pitstop.errors.PatchError` naming the patch, the target and what differs
otherwise. ``revert()`` puts back exactly the original object (``is``-identical).

A :class:`PatchSet` applies all of its patches or none of them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from pitstop.errors import PatchError

__all__ = ["Patch", "PatchSet"]

_MISSING = object()


def _has_own_source(obj: Any) -> bool:
    """A function, or a class written in Python (a compiled class, e.g. from pybind, has none)."""
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        return True
    if inspect.isclass(obj):
        try:
            inspect.getsourcefile(obj)
            inspect.getsource(obj)
        except (OSError, TypeError):
            return False
        return True
    return False


@dataclass(eq=False)
class Patch:
    """One replaced attribute of a third-party module.

    ``replacement`` is a factory: it is given the original object (for a ``staticmethod`` or
    ``classmethod`` found in a class ``__dict__``, the underlying function) and returns the new
    value. When the original was a static/class method the new value is wrapped the same way.
    """

    name: str
    module: str
    attr: str
    replacement: Callable[[Any], Any]
    params: tuple[str, ...] | None
    requires: str
    dist: str = "megatron-core"
    source_contains: tuple[str, ...] = ()

    _raw: Any = field(default=_MISSING, init=False, repr=False)
    _owned: bool = field(default=False, init=False, repr=False)
    _new: Any = field(default=_MISSING, init=False, repr=False)

    # ------------------------------------------------------------------ lookup
    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}"

    @property
    def applied(self) -> bool:
        return self._raw is not _MISSING

    def _fail(self, what: str) -> PatchError:
        return PatchError(f"patch {self.name!r} on {self.target}: {what}")

    def _owner_and_leaf(self) -> tuple[Any, str]:
        try:
            obj = importlib.import_module(self.module)
        except ImportError as exc:
            raise self._fail(f"module {self.module!r} does not import ({exc})") from exc
        *path, leaf = self.attr.split(".")
        walked = self.module
        for part in path:
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise self._fail(f"missing attribute {part!r} in {walked}") from None
            walked += "." + part
        return obj, leaf

    def _lookup(self) -> tuple[Any, str, Any, bool]:
        """(owner, leaf, raw value, whether owner defines it itself)."""
        owner, leaf = self._owner_and_leaf()
        own = getattr(owner, "__dict__", None)
        if own is not None and leaf in own:
            return owner, leaf, own[leaf], True
        try:
            return owner, leaf, getattr(owner, leaf), False
        except AttributeError:
            raise self._fail(f"missing attribute {leaf!r}") from None

    @staticmethod
    def _unwrap(raw: Any) -> Any:
        if isinstance(raw, (staticmethod, classmethod)):
            return raw.__func__
        return raw

    # ------------------------------------------------------------------- check
    def _check_version(self) -> None:
        try:
            spec = SpecifierSet(self.requires)
        except InvalidSpecifier as exc:
            raise self._fail(f"invalid version spec {self.requires!r} ({exc})") from None
        try:
            found = importlib.metadata.version(self.dist)
        except importlib.metadata.PackageNotFoundError:
            raise self._fail(f"distribution {self.dist!r} is not installed") from None
        try:
            ok = spec.contains(Version(found), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            raise self._fail(f"{self.dist} version {found} not in {self.requires!r}")

    def _check_original(self, original: Any) -> None:
        if self.params is not None:
            try:
                got = tuple(inspect.signature(original).parameters)
            except (TypeError, ValueError) as exc:
                raise self._fail(f"cannot read the signature of {original!r} ({exc})") from None
            if got != tuple(self.params):
                raise self._fail(
                    f"signature changed: expected ({', '.join(self.params)}) got ({', '.join(got)})"
                )
        if self.source_contains:
            # A function or class is read itself; anything else (e.g. an imported module rebound
            # inside ``module``) has no source of its own here, so ``module`` is read instead.
            where = original if _has_own_source(original) else importlib.import_module(self.module)
            try:
                source = inspect.getsource(where)
            except (OSError, TypeError) as exc:
                raise self._fail(f"cannot read the source of {where!r} ({exc})") from None
            missing = [frag for frag in self.source_contains if frag not in source]
            if missing:
                raise self._fail(f"source changed: no longer contains {missing!r}")

    def check(self) -> None:
        """Raise :class:`PatchError` if this patch does not fit the installed code."""
        self._check_version()
        if self.applied:
            self._check_original(self._unwrap(self._raw))
            return
        _, _, raw, _ = self._lookup()
        self._check_original(self._unwrap(raw))

    # ------------------------------------------------------------ apply/revert
    def apply(self) -> None:
        """Check, then replace the attribute. A no-op when already applied."""
        if self.applied:
            return
        self.check()
        owner, leaf, raw, owned = self._lookup()
        new = self.replacement(self._unwrap(raw))
        if isinstance(raw, staticmethod) and not isinstance(new, staticmethod):
            new = staticmethod(new)
        elif isinstance(raw, classmethod) and not isinstance(new, classmethod):
            new = classmethod(new)
        setattr(owner, leaf, new)
        self._raw, self._owned, self._new = raw, owned, new

    def revert(self) -> None:
        """Put back exactly the original object. A no-op when not applied."""
        if not self.applied:
            return
        owner, leaf = self._owner_and_leaf()
        current = getattr(owner, "__dict__", {}).get(leaf, _MISSING)
        if current is not self._new:
            raise self._fail(
                "was replaced by someone else since it was applied; not reverting over it "
                f"(found {current!r})"
            )
        if self._owned:
            setattr(owner, leaf, self._raw)
        else:
            delattr(owner, leaf)
        self._raw, self._owned, self._new = _MISSING, False, _MISSING

    @property
    def original(self) -> Any:
        """The original object while applied (unwrapped from static/classmethod)."""
        if not self.applied:
            raise self._fail("not applied")
        return self._unwrap(self._raw)


class PatchSet:
    """A named group of patches applied all together or not at all."""

    def __init__(self, name: str, patches: Iterable[Patch]):
        self.name = name
        self.patches: tuple[Patch, ...] = tuple(patches)
        names = [p.name for p in self.patches]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise PatchError(f"patch set {name!r}: duplicate patch names {dupes}")
        self._applied = False

    def __repr__(self) -> str:
        return f"PatchSet({self.name!r}, {len(self.patches)} patches, applied={self._applied})"

    def __iter__(self):
        return iter(self.patches)

    @property
    def applied(self) -> bool:
        return self._applied

    def check(self) -> None:
        """Check every patch; raise one :class:`PatchError` listing every failure."""
        errors = []
        for patch in self.patches:
            try:
                patch.check()
            except PatchError as exc:
                errors.append(str(exc))
        if errors:
            raise PatchError(
                f"patch set {self.name!r} does not fit the installed code, nothing applied:\n  "
                + "\n  ".join(errors)
            )

    def apply(self) -> None:
        """Check all patches, then apply them all. Nothing is applied if any check fails."""
        if self._applied:
            return
        self.check()
        done: list[Patch] = []
        try:
            for patch in self.patches:
                patch.apply()
                done.append(patch)
        except BaseException:
            for patch in reversed(done):
                patch.revert()
            raise
        self._applied = True

    def revert(self) -> None:
        """Revert in reverse order. Every patch is attempted; failures are raised together."""
        if not self._applied:
            return
        errors = []
        for patch in reversed(self.patches):
            try:
                patch.revert()
            except PatchError as exc:
                errors.append(str(exc))
        self._applied = False
        if errors:
            raise PatchError(f"patch set {self.name!r}: revert failed:\n  " + "\n  ".join(errors))
