"""The client's modules: none imports itself back (at module level, in a function or for type checking).

Stricter than the whole project's check in ``test_layout.py``, which leaves type-checking imports out; the
line limit for every module is in ``test_module_size.py``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CLIENT = Path(__file__).resolve().parent.parent / "client"
PACKAGE = "rematd.client"


def module_name(path: Path) -> str:
    """A client module's name under the package (``handle``, ``parallel.pick``; a package's ``__init__``)."""
    rel = path.relative_to(CLIENT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts) or "__init__"


def client_imports(path: Path) -> set[str]:
    """The modules of the client package that ``path`` imports anywhere in it."""
    names = {module_name(p) for p in CLIENT.rglob("*.py") if "__pycache__" not in p.parts}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE:
                found.add("__init__")
            elif target.startswith(PACKAGE + "."):
                parts = target[len(PACKAGE) + 1 :].split(".")
                # The longest module the target names (``parallel.pick.resolve``: ``parallel.pick``).
                name = next(
                    (".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in names), None
                )
                if name is not None:
                    found.add(name)
    if CLIENT in path.parents or path.parent == CLIENT:
        found.discard(module_name(path))
    found.discard(path.stem)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_a_loop_through_a_type_checking_import(tmp_path: Path) -> None:
    module = tmp_path / "guard.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rematd.client.handle import Handle\n"
        "def f():\n    from rematd.client.steps import phases\n"
    )
    assert client_imports(module) == {"handle", "steps", "steps.phases"}
    assert find_cycle({"guard": {"handle"}, "handle": {"hello", "guard"}, "hello": set()}) == [
        "guard",
        "handle",
        "guard",
    ]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_the_client() -> None:
    graph = {module_name(p): client_imports(p) for p in CLIENT.rglob("*.py") if "__pycache__" not in p.parts}
    assert "steps.oom" in graph and "handle" in graph["__init__"], "the client's modules were found"
    assert "parallel.pick" in graph["handle"], "the parallel package's modules were found"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_importing_the_client_leaves_torchs_heavy_packages_unimported() -> None:
    """Every process that attaches rematd imports it: Dynamo, DTensor's ops and the pipelines cost a second or more
    of start-up each, and rematd recognises their objects without importing them."""
    heavy = ("torch._dynamo", "torch._inductor", "torch.distributed.tensor", "torch.distributed.pipelining")
    code = f"import sys, rematd.client; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_sharded_and_pipelined_objects_are_recognised_once_their_packages_are_imported() -> None:
    import torch
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.tensor import DTensor

    from rematd.client.parallel.base import imported
    from rematd.client.parallel.fsdp import is_unit
    from rematd.client.parallel.pipeline import is_schedule
    from rematd.client.parallel.tensor import dtensor

    assert dtensor() is DTensor and imported("torch.distributed.fsdp", "FSDPModule") is not None
    assert imported("rematd.not_a_module", "Anything") is None
    assert imported("torch", "float32") is None, "only classes are looked up"
    # A schedule's own class, its stages left out (built bare: a real one needs a process group).
    schedule_class = type("Schedule", (_PipelineSchedule,), {"step": None, "_step_microbatches": None})
    assert is_schedule(schedule_class.__new__(schedule_class)) and not is_schedule(object())
    assert not is_unit(torch.nn.Linear(2, 2))
