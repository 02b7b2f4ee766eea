"""One seam for parallelism in the client: outside ``client/parallel`` (the modules that implement a backend,
``fsdp``, ``tensor``, ``zero``, ``pipeline``, the seam itself, ``base``, and the one that picks among them,
``pick``), no client module names FSDP, ZeRO, DeepSpeed, DTensor or pipelining: not in its imports, names and
strings, and not in its docstrings and comments either (they say "a sharded set-up", "stages", "the engine"). The
rest of the client asks the seam (:class:`rematd.client.parallel.base.SetUp`) and the picker, so a new backend is
a module in ``parallel/`` and a line in ``pick``."""

from __future__ import annotations

import re
from pathlib import Path

CLIENT = Path(__file__).resolve().parent.parent / "client"
SEAM = "parallel"
"""The folder where backends are implemented and picked: the only one that may name them."""
BACKEND = re.compile(
    r"(?i:fsdp|fully_shard|deepspeed|pipelin|distributed\.tensor|(?<![a-z])dtensor|\bzero[-_]?(?:[123]|stage|param|optim|init))"
    r"|\bZeRO\b"
)
"""A backend's name in a word: ``SavedTensor`` names no DTensor, ``zero_grad`` and ``zeros`` no ZeRO."""
WORD = re.compile(r"\w+(?:[.-]\w+)*")
PUBLIC = {"handle.py": frozenset({"pipeline"}), "step_triggers.py": frozenset({"pipeline"})}
"""Words a module may use because the public API spells them so: ``h.pipeline`` (the README's and docs'),
which its setter's errors (and the handle's check of the schedule it finds) name as the setting to change."""


def named(path: Path, root: Path = CLIENT) -> list[str]:
    """Where ``path`` names a backend, code, docstring or comment alike: ``file:line: word``."""
    rel = path.relative_to(root)
    allowed = PUBLIC.get(str(rel), frozenset())
    # ``pipeline.setter`` and ``h.pipeline`` spell the public attribute too; ``pipelines`` does not.
    public = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(allowed))) + r")\b") if allowed else None
    found = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        for word in WORD.findall(line):
            if BACKEND.search(public.sub("", word) if public else word):
                found.append(f"{rel}:{number}: {word!r}")
    return found


def outside_the_seam(root: Path = CLIENT) -> list[Path]:
    """Every client module but those of ``parallel/``."""
    return sorted(
        p for p in root.rglob("*.py") if "__pycache__" not in p.parts and p.relative_to(root).parts[0] != SEAM
    )


def test_no_client_module_outside_the_seam_names_a_parallel_backend() -> None:
    modules = outside_the_seam()
    rels = {str(p.relative_to(CLIENT)) for p in modules}
    # The walk reaches the client's folders, and leaves the seam out.
    assert {"handle.py", "steps/boundaries.py", "blocks/switchable.py"} <= rels, sorted(rels)
    assert not any(r.startswith(f"{SEAM}/") for r in rels)
    assert (CLIENT / SEAM / "pick.py").exists()
    found = [hit for p in modules for hit in named(p)]
    assert not found, "\n".join(found)


def test_the_check_finds_a_backend_in_code_docstrings_and_comments(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        '"""About FSDP2."""\n'
        "from torch.distributed.fsdp import FSDPModule\n"
        'x = "ZeRO-3"  # as DeepSpeed does\n'
        "import torch.distributed.pipelining\n"
        "from torch.distributed.tensor import DTensor\n"
        "def f(m):\n    return has_dtensors(m)\n"
    )
    words = [h.split(": ", 1)[1] for h in named(module, tmp_path)]
    assert words == [
        "'FSDP2'",
        "'torch.distributed.fsdp'",
        "'FSDPModule'",
        "'ZeRO-3'",
        "'DeepSpeed'",
        "'torch.distributed.pipelining'",
        "'torch.distributed.tensor'",
        "'DTensor'",
        "'has_dtensors'",
    ]


def test_the_check_leaves_look_alike_words_and_the_public_attribute(tmp_path: Path) -> None:
    module = tmp_path / "handle.py"
    module.write_text(
        "class SavedTensorAccounting: ...\n"
        "opt.zero_grad(set_to_none=True)\n"
        "x = torch.zeros(3)\n"
        "def pipeline(self): ...\n"
        "@pipeline.setter\n"
        'raise ValueError("set h.pipeline first")\n'
    )
    assert named(module, tmp_path) == []
    module.write_text("pipelines = 2\n")
    assert named(module, tmp_path) == ["handle.py:1: 'pipelines'"]
    other = tmp_path / "other.py"
    other.write_text("def pipeline(self): ...\n")
    assert named(other, tmp_path) == ["other.py:1: 'pipeline'"]
