"""Tier 1: the direction of dependency inside pitstop.

Every ``import`` under ``pitstop/`` is parsed, the lazy ones inside functions included,
and each must point to the same layer or a lower one; no set of modules may import
each other in a circle, and neither may pitstop's parts (``pitstop.runtime``,
``pitstop.emulation``, ...) taken as wholes. The layers, from the bottom up::

    0  data           errors, settings, layout, roster, plan, protocol (messages, sealing), patches
    1  communication  store, pg, groups, the virtual backend (virtual), the tensor-memory
                      tracker (memory), the warmup's records and replay oracle (record)
    2  runtime        the resilience runtime: worker, session, state, sandbox, ...
    3  emulation      the emulation pipeline (the rest of pitstop.emulation)
    4  integrations   Megatron-Core, DeepSpeed adapters
    5  control, CLI   pitstop.launch (controller, agents, CLI, benchmarks)

A lower layer that needs something of a higher one is handed it (the session gets its
framework adapter, the sandbox its teardown, the runtime its boundary hooks), as
torchft's ``Manager`` is handed its process group.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]

#: Module (or package) -> layer; the longest matching prefix decides.
LAYERS: Dict[str, int] = {
    "pitstop": 0,
    "pitstop.errors": 0, "pitstop.settings": 0, "pitstop.layout": 0, "pitstop.roster": 0, "pitstop.plan": 0, "pitstop.protocol": 0,
    "pitstop.patches": 0,
    "pitstop.store": 1, "pitstop.etcd_store": 1, "pitstop.pg": 1, "pitstop.groups": 1,
    "pitstop.virtual": 1, "pitstop.memory": 1, "pitstop.record": 1,
    "pitstop.runtime": 2,
    "pitstop.emulation": 3,
    "pitstop.integrations": 4,
    "pitstop.launch": 5,
    "pitstop.bench": 6, "pitstop.cli": 6,
}


def layer_of(mod: str) -> int:
    best = max((p for p in LAYERS if mod == p or mod.startswith(p + ".")), key=len)
    return LAYERS[best]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports() -> Dict[str, Set[Tuple[str, int]]]:
    """module -> {(imported pitstop module, line)}, every import statement anywhere in the file."""
    files = {module_name(p): p for p in (ROOT / "pitstop").rglob("*.py")}
    out: Dict[str, Set[Tuple[str, int]]] = defaultdict(set)

    def resolve(name: str) -> str:
        while name not in files and "." in name:  # `from pitstop.x import y`: y may be a name, not a module
            name = name.rsplit(".", 1)[0]
        return name

    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for t in targets:
                if t == "pitstop" or t.startswith("pitstop."):
                    dep = resolve(t)
                    if dep != mod:
                        out[mod].add((dep, node.lineno))
    for mod in files:
        out.setdefault(mod, set())
    return out


def test_the_parser_sees_lazy_imports_inside_functions():
    """A guard on the guard: an import inside a function body is found (the upward edges
    this test forbids were all lazy ones)."""
    found = imports()["pitstop.launch.cli"]
    assert any(dep.startswith("pitstop.launch.") for dep, _ in found), sorted(found)[:10]
    assert layer_of("pitstop.record") == 1 and layer_of("pitstop.emulation.hybrid") == 3
    assert layer_of("pitstop.runtime.session") == 2 and layer_of("pitstop.bench.recovery") == 6


def test_no_import_points_to_a_higher_layer():
    upward = [f"{mod} (layer {layer_of(mod)}) imports {dep} (layer {layer_of(dep)}) at line {line}"
              for mod, deps in imports().items() for dep, line in sorted(deps) if layer_of(dep) > layer_of(mod)]
    assert not upward, "imports that point upward:\n  " + "\n  ".join(upward)


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_modules_import_each_other_in_a_circle():
    found = cycles({m: {d for d, _ in deps} for m, deps in imports().items()})
    assert not found, "modules that import each other in a circle:\n  " + "\n  ".join(map(str, found))


def part(mod: str) -> str:
    """``pitstop.runtime.session`` -> ``pitstop.runtime``; a top-level module is its own part."""
    return ".".join(mod.split(".")[:2])


def test_no_parts_of_pitstop_import_each_other_in_a_circle():
    graph: Dict[str, Set[str]] = defaultdict(set)
    for mod, deps in imports().items():
        graph[part(mod)] |= {part(d) for d, _ in deps if part(d) != part(mod) and d != "pitstop"}
    found = cycles(dict(graph))
    assert not found, "parts that import each other in a circle:\n  " + "\n  ".join(map(str, found))


#: The session's pieces (:mod:`pitstop.runtime.host`) and the controller's rooms.
SESSION_PIECES = ("pitstop.runtime.buddy", "pitstop.runtime.vote", "pitstop.runtime.recovery",
                  "pitstop.runtime.drain", "pitstop.runtime.watch", "pitstop.runtime.host")


def _class_bases(path: Path, name: str) -> List[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [ast.unparse(b) for b in node.bases]
    raise AssertionError(f"no class {name} in {path}")


def test_the_session_composes_pieces_that_never_import_it():
    """``Session`` has no base classes: its pieces are objects it makes and hands what they
    use, and none of them imports the session back (it reaches the session through the
    ``Host`` protocol). A piece turned back into a mixin, or one that imports the session,
    fails here."""
    assert _class_bases(ROOT / "pitstop/runtime/session.py", "Session") == []
    deps = imports()
    back = [f"{p} imports {d} at line {line}" for p in SESSION_PIECES for d, line in sorted(deps[p])
            if d == "pitstop.runtime.session"]
    assert not back, back
    made = {d for d, _ in deps["pitstop.runtime.session"]}
    assert set(SESSION_PIECES) - {"pitstop.runtime.host"} <= made, sorted(made)


def test_the_controller_composes_its_drains_and_restarts():
    """``Controller`` has no base classes either; its drains and restarts are pieces it makes
    (``Drains`` owns the drains' state, which the controller persists through it)."""
    assert _class_bases(ROOT / "pitstop/launch/controller.py", "Controller") == []
    made = {d for d, _ in imports()["pitstop.launch.controller"]}
    assert {"pitstop.launch.drain", "pitstop.launch.restart"} <= made, sorted(made)
