"""The package's shape: no import cycle, no import running back up the layers, and a wheel that holds the library only.

The import graph is read from the source (every ``import``, at module level or inside a function, except those under
``if TYPE_CHECKING:``), so a cycle hidden in a function body counts too. It is checked twice: between modules, and
between the top-level rooms (``hf_mloss.<subpackage or module>``), where no circle may close either.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_mloss"

LAYERS = ["adapters", "loading", "methods", "spec", "output", "engine", "merging", "api", "moe", "cli"]
"""Folders (and top modules) from the bottom up: a module imports only its own layer and the layers below it.
``adapters`` (the family registry) is the lowest; ``loading`` reads the inputs; ``methods`` (the method registry and
the tensor math) sits below the recipe that names a method (``spec``), the outputs that describe one, the engine that
scores for one and the driver that runs one. The base utilities (errors, saving, parallel, ...) are below every
layer: they import only each other (:data:`BASE`)."""
BASE = ["errors", "saving", "distributed", "parallel", "_validation", "_yaml", "_logging", "_version"]


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(*, type_hints: bool = False) -> dict[str, set[str]]:
    """Module -> the hf_mloss modules it imports (TYPE_CHECKING blocks excluded, unless ``type_hints``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = set() if type_hints else {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
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
                submodules = [f"{target}.{alias.name}" for alias in node.names]
                # `from .. import parallel` reads the submodule; the package's own namespace only when a name in it
                # is not a submodule (the root package is imported first by any import of a submodule anyway)
                own = target != "hf_mloss" or not all(m in modules for m in submodules)
                candidates = [*([target] if own else []), *submodules]
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


def room(module: str) -> str:
    """The top-level room of a module: ``hf_mloss.engine.score`` → ``engine`` (the package itself: ``hf_mloss``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to rooms: room -> the other rooms its modules import."""
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    return rooms


def layer(module: str) -> int | None:
    name = room(module)
    return -1 if name in BASE else LAYERS.index(name) if name in LAYERS else None


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_top_level_rooms_form_no_circle() -> None:
    """No circle of rooms, however long: spec -> methods -> engine -> spec would be one, even through functions."""
    assert cycles(room_graph(import_graph())) == []


def test_no_room_holds_an_import_circle_even_through_type_hints() -> None:
    """Inside a room a dispatcher imports its workers and never the reverse, not even for a type: what both sides need
    (the merge driver's ``TensorMerger``, the MoE build's ``MoEResult``) lives below both."""
    graph = import_graph(type_hints=True)
    inside = {module: {t for t in targets if room(t) == room(module)} for module, targets in graph.items()}
    assert cycles(inside) == []


def test_cycle_detection_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_room_circles_are_found_through_modules_that_form_no_cycle() -> None:
    # no module cycle (a.x -> b.y -> c.z -> a.w), but the rooms a -> b -> c -> a close a circle
    graph = {"hf_mloss.a.x": {"hf_mloss.b.y"}, "hf_mloss.b.y": {"hf_mloss.c.z"}, "hf_mloss.c.z": {"hf_mloss.a.w"},
             "hf_mloss.a.w": set(), "hf_mloss.errors": set()}
    assert cycles(graph) == []
    assert cycles(room_graph(graph)) == [["a", "b", "c"]]


def test_no_import_runs_back_up_the_layers() -> None:
    upward = [f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
              if layer(module) is not None and layer(target) is not None and layer(target) > layer(module)]
    assert upward == []


def test_every_room_has_a_layer() -> None:  # a new room must be placed, or the checks above would skip it
    rooms = {room(module) for module in import_graph()} - {"hf_mloss"}
    assert sorted(rooms - set(LAYERS) - set(BASE)) == []


def test_every_layer_folder_exists() -> None:  # a renamed folder must not empty the check above
    assert all((PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file() for name in [*LAYERS, *BASE])


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
