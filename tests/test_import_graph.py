"""The package's import graph, read from the source (every import statement, also those inside
functions and under TYPE_CHECKING): no module takes part in an import cycle, and each layer
imports only the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import paged_backend

PACKAGE = "paged_backend"
ROOT = Path(paged_backend.__file__).resolve().parent
# paged_backend.adapters is installed from the folder beside the package
SOURCES = {PACKAGE: ROOT, f"{PACKAGE}.adapters": ROOT.parent / "adapters"}
SKIP_DIRS = {"triton_model_repository", "__pycache__"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if SKIP_DIRS & set(rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([pkg, *parts])
            if pkg == PACKAGE and parts and parts[0] == "adapters":
                continue
            mods[name] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (``from a import b`` counts ``a.b`` when it is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    found.add(full)
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_the_whole_package() -> None:
    graph = import_graph()
    assert {"paged_backend.core.scheduler", "paged_backend.engine.llm_engine", "paged_backend.kernels.paged_attention",
            "paged_backend.adapters.openai_server", "paged_backend.worker.model_runner"} <= set(graph)
    assert "paged_backend.core.kv_cache_manager" in graph["paged_backend.core.scheduler"]


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


# layer -> the package layers it may import (a layer always may import itself)
ALLOWED = {
    "kernels": set(),
    "core": {"sampling_params", "errors"},
    "attention": {"kernels"},
    "models": {"kernels", "attention", "distributed", "config"},
    "quantization": {"kernels", "models", "distributed"},
    "sample": {"core", "sampling_params", "outputs", "kernels"},
    "worker": {"kernels", "attention", "models", "quantization", "core", "distributed", "config", "errors"},
    "spec_decode": set(),
    "engine": {"core", "worker", "sample", "models", "config", "errors", "outputs", "sampling_params", "spec_decode"},
}


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def test_layers_import_only_layers_below() -> None:
    bad = []
    for module, deps in import_graph().items():
        layer = _layer(module)
        if layer not in ALLOWED:
            continue
        for dep in deps:
            other = _layer(dep)
            if other != layer and other not in ALLOWED[layer]:
                bad.append(f"{module} -> {dep}")
    assert bad == []


def test_only_the_cli_reaches_the_benchmarks() -> None:
    users = {m for m, deps in import_graph().items()
             if any(_layer(d) == "benchmarks" for d in deps) and _layer(m) != "benchmarks"}
    assert users == {"paged_backend.cli"}
