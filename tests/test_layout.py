"""The packages' import graph: no module imports itself through others, and the service never imports the client.

Every import counts, a function's own included (it runs the first time the function does), except those under
``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "rematd": ROOT / "proto" / "rematd",
    "rematd.planner": ROOT / "planner",
    "rematd.client": ROOT / "client",
    "rematd.server": ROOT / "server",
    "rematd.integrations": ROOT / "integrations",
}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            if "_pb2" in path.name or "__pycache__" in rel.parts:
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            found[name] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import under ``node``, skipping the bodies of ``if TYPE_CHECKING:`` (their ``else`` still runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]))
        else:
            yield from _imports(child)


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                # ``from package import module`` imports the module; ``from module import name`` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                # ``import a.b.c`` of a module this project does not have: the nearest one it does.
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                found.append(_cycle_through(sorted(component), edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _cycle_through(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One path from the component's first module back to itself, for the failure message."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v] & members):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    return component


def test_the_graph_sees_what_the_packages_import() -> None:
    edges = graph()
    # A top-level import, a function's own import, and one under TYPE_CHECKING (not counted).
    assert "rematd.server.config" in edges["rematd.server.app"]
    assert "rematd.demo" in edges["rematd.cli"]
    assert "rematd.server.app" in edges["rematd.demo"]
    assert "rematd.client.blocks.compiled" not in edges["rematd.client.blocks.switchable"]
    assert len(edges) > 60


def test_no_module_imports_itself_through_others() -> None:
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle_and_names_its_path() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_service_never_imports_the_client() -> None:
    edges = graph()
    bad = sorted(
        f"{src} imports {dst}"
        for src, targets in edges.items()
        if src.startswith("rematd.server")
        for dst in targets
        if dst == "rematd.client" or dst.startswith("rematd.client.")
    )
    assert not bad, bad


def test_the_client_never_imports_the_service() -> None:
    """The demo's service start lives in ``rematd.demo``, above both: a training job needs no server extra."""
    edges = graph()
    bad = sorted(
        f"{src} imports {dst}"
        for src, targets in edges.items()
        if src == "rematd.client" or src.startswith("rematd.client.")
        for dst in targets
        if dst == "rematd.server" or dst.startswith("rematd.server.")
    )
    assert not bad, bad
