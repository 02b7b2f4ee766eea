"""One seam for parallelism in the client: outside the modules that implement a backend (``client/parallel``'s
``fsdp``, ``tensor``, ``zero``, ``pipeline``) and the one that picks among them (``pick``), no client module's code
names FSDP, ZeRO, DeepSpeed, DTensor or pipelining: its imports, names and strings (docstrings and comments may
say what a set-up does, for the reader)."""

from __future__ import annotations

import ast
from pathlib import Path

CLIENT = Path(__file__).resolve().parent.parent / "client"
BACKENDS = {"parallel/fsdp.py", "parallel/tensor.py", "parallel/zero.py", "parallel/pipeline.py", "parallel/pick.py"}
WORDS = ("fsdp", "fully_shard", "deepspeed", "distributed.tensor", "pipelining", "zero3", "zero-3", "zero_param")
CASED = ("ZeRO", "DTensor")
"""Matched as they are spelt: ``SavedTensor`` names no DTensor."""


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
        # An attribute's docstring: a string statement right after an assignment.
        for field in ("body", "orelse"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                ids.update(id(s.value) for s in stmts if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    return ids


def named(path: Path) -> list[str]:
    """The backend words ``path``'s code names, with their lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = node.name
        elif isinstance(node, ast.ImportFrom):
            text = node.module or ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
        else:
            continue
        if any(w in text.lower() for w in WORDS) or any(w in text for w in CASED):
            found.append(f"{path.relative_to(CLIENT)}:{getattr(node, 'lineno', '?')}: {text[:60]!r}")
    return found


def test_only_the_backends_and_the_picker_name_a_parallel_backend() -> None:
    modules = sorted(p for p in CLIENT.rglob("*.py") if "__pycache__" not in p.parts)
    assert any(p.name == "pick.py" for p in modules)
    found = [hit for p in modules if str(p.relative_to(CLIENT)) not in BACKENDS for hit in named(p)]
    assert not found, "\n".join(found)


def test_the_check_finds_a_backend_named_in_code_and_not_in_a_docstring(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""About FSDP."""\nfrom torch.distributed.fsdp import FSDPModule\nx = "ZeRO-3"\n')
    assert [h.split(": ", 1)[1] for h in named_in(module)] == ["'torch.distributed.fsdp'", "'FSDPModule'", "'ZeRO-3'"]


def named_in(path: Path) -> list[str]:
    global CLIENT
    saved, CLIENT = CLIENT, path.parent
    try:
        return named(path)
    finally:
        CLIENT = saved
