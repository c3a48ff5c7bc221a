"""The project's layering, checked from the source: no import cycles, and model internals stay in models/.

Imports are read with `ast`, including those inside functions (a lazy import that closes a cycle
is still a cycle: it only moves the failure from import time to call time).
"""

from __future__ import annotations

import ast
import re
import subprocess
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
OUTSIDE_MODELS = (
    "afd_engine/processes",
    "afd_engine/ranks",
    "afd_engine/server",
    "afd_engine/control",
    "afd_engine/engine.py",
)


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


def folder_of(module: str) -> str:
    """The room a module lives in: its folder under afd_engine/ (a file directly in afd_engine/ is a
    room of its own), or its top-level package outside it."""
    parts = module.split(".")
    if parts[0] != "afd_engine" or len(parts) == 1:
        return parts[0]
    path = project_modules()[module]
    return ".".join(parts[:2]) if path.name == "__init__.py" or len(parts) > 2 else module


def folder_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = folder_of(name)
        graph.setdefault(here, set())
        for dep in imports_of(name, path, known):
            graph.setdefault(folder_of(dep), set())
            if folder_of(dep) != here:
                graph[here].add(folder_of(dep))
    return graph


def test_no_folder_is_in_an_import_loop_with_another():
    graph = folder_graph()
    assert {"afd_engine.runtime", "afd_engine.models", "afd_engine.control"} <= set(graph)
    assert "afd_engine.runtime" in graph["afd_engine.engine"], "the folder graph found nothing"
    assert import_cycles(graph) == []


# The settings layer: what the CLI, YAML files and the planner read without building an engine.
SETTINGS = ("afd_engine.engine_args", "afd_engine.graph_sizes", "afd_engine.sampling_params", "afd_engine.model_config")


def test_the_settings_layer_imports_no_runtime_module():
    modules = project_modules()
    known = set(modules)
    offenders = {
        name: sorted(d for d in imports_of(name, modules[name], known) if d.startswith("afd_engine.runtime"))
        for name in SETTINGS
    }
    assert {k: v for k, v in offenders.items() if v} == {}


MAX_LINES = 900


def test_no_engine_file_is_longer_than_the_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "afd_engine").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_benchmark_or_test_edits_the_import_path():
    pattern = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=")
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("benchmarks", "tests")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if pattern.search(p.read_text())
    ]
    assert offenders == []


def repository_files() -> list[Path]:
    """The files a clone has: tracked ones (and new ones not ignored) where git can say, else the tree
    without what the setup and the tests build."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "site", "build", ".pytest_cache", "__pycache__"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


# A folder beside the checkout, or one machine's own paths: a user's clone has neither.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared\\b", r"\.\./\.library", "/" + "work/"]))


def test_no_file_names_a_path_outside_the_repository():
    offenders = []
    for path in repository_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # binary: checkpoints, images
            continue
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert offenders == []
