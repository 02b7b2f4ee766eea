"""The import graph: layers import downwards, and no modules import each other. Read from the source with ``ast``,
so no module is imported to check it.

Every module of the package (its folders as ``pyproject.toml`` maps them) and of ``bench/`` is parsed; an import
anywhere in a module counts (a function's own included: it runs on the first call), except under
``if TYPE_CHECKING:``, which never runs. The cycle check takes both kinds too: an import deferred into a function
so that two modules can each reach the other is still a cycle, only one that breaks later (``bench.compiled`` and
``bench.compiled_budget`` were one such pair).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The folders of the package, as pyproject.toml's package-dir maps them, and bench/.
SOURCES = {
    "rematd": ROOT / "proto" / "rematd",
    "rematd.cli": ROOT / "cli",
    "rematd.planner": ROOT / "planner",
    "rematd.client": ROOT / "client",
    "rematd.server": ROOT / "server",
    "rematd.integrations": ROOT / "integrations",
    "bench": ROOT / "bench",
}
# Generated code (protoc's): it imports only its own kind.
SKIP_FILES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target, resolved to a dotted module name."""

    target: str
    """The most specific module it names: ``from a import b`` is ``a.b`` when ``b`` is a module of ``a``."""
    line: int
    """Where it stands in the importing module."""
    top_level: bool
    """Whether it runs while the module itself is imported (not inside a function)."""


@dataclass(slots=True)
class Module:
    name: str
    path: Path
    is_package: bool
    imports: list[Import] = field(default_factory=list)


def _module_name(prefix: str, root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


def _walk() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for prefix, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            if path.name.endswith(SKIP_FILES) or "__pycache__" in path.parts:
                continue
            name = _module_name(prefix, root, path)
            modules[name] = Module(name=name, path=path, is_package=path.name == "__init__.py")
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: list[ast.stmt], *, top_level: bool) -> Iterator[tuple[ast.stmt, bool]]:
    """Each statement of ``body`` and the statements nested in it, with whether it runs at import time."""
    for node in body:
        yield node, top_level
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.orelse, top_level=top_level)
            continue
        inner_top = top_level and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, name, None)
            if not isinstance(children, list):
                continue
            for child in children:
                if isinstance(child, (ast.ExceptHandler, ast.match_case)):
                    yield from _statements(child.body, top_level=inner_top)
                elif isinstance(child, ast.stmt):
                    yield from _statements([child], top_level=inner_top)


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.name.split(".")
    # A package's relative import starts from the package itself; a module's from the package holding it.
    drop = node.level - 1 if module.is_package else node.level
    if drop > len(base) - 1:
        raise AssertionError(f"{module.path}:{node.lineno}: relative import beyond the top package")
    base = base[: len(base) - drop]
    return ".".join([*base, node.module] if node.module else base)


def _targets(module: Module, node: ast.stmt, known: set[str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        source = _resolve(module, node)
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            yield sub if sub in known else source


def _read(module: Module, source: str, known: set[str]) -> None:
    tree = ast.parse(source, filename=str(module.path))
    for node, top_level in _statements(tree.body, top_level=True):
        for target in dict.fromkeys(_targets(module, node, known)):  # `from a import b, c`: a once
            module.imports.append(Import(target=target, line=node.lineno, top_level=top_level))


def _graph() -> dict[str, Module]:
    modules = _walk()
    for module in modules.values():
        _read(module, module.path.read_text(encoding="utf-8"), set(modules))
    return modules


GRAPH = _graph()


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _offences(importer: str, forbidden: str) -> list[str]:
    """Each import of a module under ``forbidden`` by a module under ``importer``, as ``path:line: target``."""
    found = []
    for module in GRAPH.values():
        if not _within(module.name, importer):
            continue
        for imp in module.imports:
            if _within(imp.target, forbidden):
                found.append(f"{module.path.relative_to(ROOT)}:{imp.line}: imports {imp.target}")
    return found


def test_the_reader_counts_what_runs() -> None:
    source = """
from __future__ import annotations
from typing import TYPE_CHECKING
from . import sibling
from .sibling import name
import rematd.server.app
if TYPE_CHECKING:
    from rematd.client import typed_only
else:
    import at_runtime
def later():
    from ..other import thing
class Holder:
    import in_class_body
"""
    module = Module(name="rematd.pkg.mod", path=ROOT / "mod.py", is_package=False)
    _read(module, source, {"rematd.pkg.sibling", "rematd.other.thing"})
    seen = {(i.target, i.top_level) for i in module.imports}
    assert ("rematd.pkg.sibling", True) in seen and ("rematd.server.app", True) in seen
    assert ("at_runtime", True) in seen and ("in_class_body", True) in seen
    assert ("rematd.other.thing", False) in seen, "a function's import counts, as run later"
    assert not any("typed_only" in t or t == "rematd.client" for t, _ in seen), "TYPE_CHECKING's never runs"


def test_the_walk_finds_every_layer() -> None:
    # A moved folder would leave a rule below checking nothing.
    for package in (
        "rematd",
        "rematd.cli",
        "rematd.planner",
        "rematd.client",
        "rematd.server",
        "rematd.integrations",
        "bench",
    ):
        assert package in GRAPH, f"{package} not found under {SOURCES[package]}"
    assert "rematd.server.metrics" in GRAPH and "rematd.server.core" in GRAPH
    assert len(GRAPH) > 100, sorted(GRAPH)


def test_the_planner_imports_only_itself_and_the_standard_library() -> None:
    outside = []
    for module in GRAPH.values():
        if not _within(module.name, "rematd.planner"):
            continue
        for imp in module.imports:
            top = imp.target.split(".")[0]
            if _within(imp.target, "rematd.planner") or (top != "rematd" and top in sys.stdlib_module_names):
                continue
            outside.append(f"{module.path.relative_to(ROOT)}:{imp.line}: imports {imp.target}")
    assert not outside, "the planner imports outside itself and the standard library:\n" + "\n".join(outside)


def test_server_metrics_does_not_import_server_core() -> None:
    # core records into metrics; metrics reading core back makes the two one layer.
    found = _offences("rematd.server.metrics", "rematd.server.core")
    assert not found, "rematd.server.metrics imports rematd.server.core:\n" + "\n".join(found)


def test_the_server_does_not_import_the_client() -> None:
    found = _offences("rematd.server", "rematd.client")
    assert not found, "rematd.server imports rematd.client:\n" + "\n".join(found)


def test_the_client_does_not_import_the_server() -> None:
    # The client runs inside the training job, which installs rematd[client] only.
    found = _offences("rematd.client", "rematd.server")
    assert not found, "rematd.client imports rematd.server:\n" + "\n".join(found)


def test_benchmarks_do_not_import_the_tests() -> None:
    found = _offences("bench", "tests")
    assert not found, "bench imports tests (move what both need into bench/):\n" + "\n".join(found)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a long chain of imports cannot reach the recursion limit.
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
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
                if len(component) > 1 or node in edges[node]:
                    found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _edges() -> dict[str, set[str]]:
    """Who imports whom among the modules walked (rematd's and bench's)."""
    edges: dict[str, set[str]] = {name: set() for name in GRAPH}
    for module in GRAPH.values():
        for imp in module.imports:
            if imp.target in GRAPH and imp.target != module.name:
                edges[module.name].add(imp.target)
    return edges


def _describe(component: list[str]) -> str:
    """The modules of one cycle, and the import lines that close it."""
    members = set(component)
    lines = [" <-> ".join(component)]
    for name in component:
        for imp in GRAPH[name].imports:
            if imp.target in members and imp.target != name:
                where = "" if imp.top_level else " (inside a function)"
                lines.append(f"  {GRAPH[name].path.relative_to(ROOT)}:{imp.line}: imports {imp.target}{where}")
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    cycles = _cycles(_edges())
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c) for c in cycles)


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"], ["d"]]),
    ],
)
def test_the_cycle_finder_names_each_cycle(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert sorted(_cycles(edges)) == expected


SERVER_LAYERS = (
    ("rematd.server.config", "rematd.server.credentials", "rematd.server.figures"),
    ("rematd.server.runtime", "rematd.server.store", "rematd.server.metrics"),
    ("rematd.server.core",),
    ("rematd.server.transport",),
)
"""The service's folders from the bottom up: configuration as plain data (and the figures computed alike
everywhere), what the core stands on (the store,
the metrics, the process's runtime), the transport-neutral core, the transports. The modules at the top
(``app``, ``run``, ``workers``, ``cli``) assemble them all."""

SHARED_ROWS = "rematd.server.store.rows"
"""The store's row types: what a read returns, shared by every layer that shows one."""


def _server_layer(name: str) -> int | None:
    for level, folders in enumerate(SERVER_LAYERS):
        if any(_within(name, folder) for folder in folders):
            return level
    return None


def test_the_servers_folders_import_downwards_only() -> None:
    upward = []
    for module in GRAPH.values():
        level = _server_layer(module.name)
        if level is None:
            continue
        for imp in module.imports:
            target = _server_layer(imp.target)
            if target is None:
                # The package itself is the top too: its __init__ imports the app.
                if _within(imp.target, "rematd.server"):
                    upward.append(f"{module.path.relative_to(ROOT)}:{imp.line}: imports {imp.target} (the top)")
                continue
            if target > level:
                upward.append(f"{module.path.relative_to(ROOT)}:{imp.line}: imports {imp.target}")
            # The transports reach the store through the core; its row types are shared.
            is_store = _within(imp.target, "rematd.server.store") and not _within(imp.target, SHARED_ROWS)
            if is_store and _within(module.name, "rematd.server.transport"):
                upward.append(f"{module.path.relative_to(ROOT)}:{imp.line}: imports {imp.target} past the core")
    assert not upward, "server imports against its layers:\n" + "\n".join(upward)
