"""The project's layering, checked from the source: no import cycles, and model internals stay in models/.

Imports are read with `ast`, including those inside functions (a lazy import that closes a cycle
is still a cycle: it only moves the failure from import time to call time).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("afd_engine", "comm", "kernels")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (`from pkg import sub` names pkg.sub)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _absolute(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    modules = project_modules()
    known = set(modules)
    graph = {name: imports_of(name, path, known) for name, path in modules.items()}
    assert "afd_engine.engine" in graph and graph["afd_engine.engine"], "the import parser found nothing"
    assert import_cycles(graph) == []


# What only models/ and kernels/ may know: a MoE layer's parts and the stacked expert weights.
MOE_INTERNALS = re.compile(r"\.mlp\b|shared_experts|\bw13\b|\bw2\b")
OUTSIDE_MODELS = ("afd_engine/distributed", "afd_engine/server", "afd_engine/control", "afd_engine/engine.py")


def test_modes_do_not_reach_into_layers_or_kernels():
    offenders = []
    for where in OUTSIDE_MODELS:
        target = ROOT / where
        for path in sorted(target.rglob("*.py") if target.is_dir() else [target]):
            text = path.read_text()
            rel = path.relative_to(ROOT)
            offenders += [f"{rel}: mentions {m.group(0)!r}" for m in MOE_INTERNALS.finditer(text)]
            offenders += [
                f"{rel}: imports {m}"
                for m in imports_of(module_name(path), path, set(project_modules()))
                if m == "kernels" or m.startswith("kernels.")
            ]
    assert offenders == []
