"""The package's shape: no import cycle, no import running back up the layers, and a wheel that holds the library only.

The import graph is read from the source (every ``import``, at module level or inside a function, except those under
``if TYPE_CHECKING:``), so a cycle hidden in a function body counts too.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_mloss"

LAYERS = ["spec", "output", "engine", "merging", "api", "cli"]
"""Folders (and top modules) from the bottom up: a module imports only its own layer and the layers below it.
``loading`` sits below ``spec`` (a recipe's loaders read the Hub); the base utilities (errors, saving, ...) and the
two registries (``adapters``, ``methods``, used by several layers) are outside the order."""
LAYERS = ["loading", *LAYERS]


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the hf_mloss modules it imports (TYPE_CHECKING blocks excluded)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                candidates = [target, *(f"{target}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in modules:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name:
                    edges.add(candidate)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(import_graph()) == []


def test_cycle_detection_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_runs_back_up_the_layers() -> None:
    upward = [f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
              if layer(module) is not None and layer(target) is not None and layer(target) > layer(module)]
    assert upward == []


def test_every_layer_folder_exists() -> None:  # a renamed folder must not empty the check above
    assert all((PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file() for name in LAYERS)


def test_the_wheel_holds_the_library_only() -> None:
    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=config["include"])
    assert packages and all(p == "hf_mloss" or p.startswith("hf_mloss.") for p in packages)
    assert not {"suites", "demo", "testing"} & {p.split(".")[1] for p in packages if "." in p}
    assert not any((PACKAGE / f"{name}.py").exists() for name in ("demo", "testing"))


@pytest.mark.parametrize("module", ["benchmarks.suites", "examples.demo", "examples.tiny"])
def test_the_tools_outside_the_wheel_import_from_a_clone(module: str) -> None:
    import importlib

    assert importlib.import_module(module).__name__ == module
