"""README.md stays a short guide; its links and docs/'s resolve; its commands are the ones the Makefile and CI run."""

from __future__ import annotations

import itertools
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def prose(text: str) -> str:
    """``text`` without code blocks and code spans, where a link is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text(encoding="utf-8"))) if not re.match(r"[a-z][a-z+.-]*:", t)]


def test_the_readme_is_a_short_guide() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move reference material to docs/"


def test_the_slug_is_githubs() -> None:
    assert slug("Sharded training (FSDP2)") == "sharded-training-fsdp2"
    assert slug("GPU: H100, with the earlier planner") == "gpu-h100-with-the-earlier-planner"
    assert slug("Labels: job and exported_job") == "labels-job-and-exported_job"
    assert slug("`attach`") == "attach"


# docs/deepspeed.md and docs/planner.md come from other branches: the README links them already, and this
# test fails until those branches are merged (no file of those names is made here to silence it).
@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    broken = []
    for target in links(path):
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{path.relative_to(ROOT)}: {broken}"


def test_the_docs_are_linked_from_the_readme() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    assert not [d.name for d in DOCS if d.resolve() not in linked]


def commands(text: str, section: str) -> list[str]:
    """The shell commands of the first ``sh`` block under the heading ``section``, comments dropped."""
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", body, re.S)
    assert block, f"no sh block under ## {section}"
    return [" ".join(shlex.split(line, comments=True)) for line in block[1].splitlines() if line.strip()]


def test_the_readme_test_command_is_what_ci_runs() -> None:
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    run = [line for line in ci if not line.startswith(("set ", "cd "))]
    assert run == ["make test"], run
    setup = commands(README.read_text(encoding="utf-8"), "Set-up")
    assert setup == ["make demo", "make test"], setup
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"the Makefile has no {target} target"
    assert re.search(r"^demo:.*\n\t\$\(BIN\)/rematd demo$", makefile, re.M), "make demo runs rematd demo"


STARTS = (".venv/bin/", "make ", "python", "torchrun", "rematd ", "deepspeed ", "pytest")
"""How a command a reader would paste begins (after any VAR=value): what the check below reads."""


def pasted_commands() -> list[tuple[str, str]]:
    """(where, command) for every command in the README's and docs' ``sh`` blocks, in inline code spans, and
    in the examples' headers; continuation lines joined."""
    found: list[tuple[str, str]] = []
    for path in [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT).as_posix()
        lines: list[str] = []
        if path.suffix == ".md":
            for block in re.findall(r"```sh\n(.*?)```", text, re.S):
                lines += block.replace("\\\n", " ").splitlines()
            # Inline, a full invocation (prose names commands too: `rematd serve`, `python -m bench.fsdp`).
            spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
            lines += [span for span in spans if span.startswith((".venv/bin/", "make ")) or re.match(r"[A-Z_]+=", span)]
        else:
            header = text.split('"""')[1] if '"""' in text else ""
            lines += [line for line in header.splitlines() if line.startswith("    ")]  # its indented commands
        for line in lines:
            words = line.strip().split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            command = " ".join(words)
            if command.startswith(STARTS) and "..." not in command:  # not "torchrun ... -m MODULE"
                found.append((name, command))
    return found


def test_every_documented_command_runs_as_written_on_a_fresh_clone() -> None:
    """Each command names a program the set-up installs, by the path it has after ``make demo``/``make test``
    (nothing puts .venv/bin on the PATH), a make target that exists, and modules and files that exist."""
    import importlib.util

    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    found = pasted_commands()
    assert len(found) > 20, found
    for where, command in found:
        words = shlex.split(command, comments=True)
        program = words[0]
        if program == "make":
            assert len(words) == 1 or words[1] in targets, (where, command)
            continue
        assert program.startswith(".venv/bin/"), f"{where}: {command!r} needs .venv/bin/{program} on a fresh clone"
        assert (ROOT / program).exists(), (where, command)
        for flag, value in itertools.pairwise(words):
            if flag == "-m":
                assert importlib.util.find_spec(value) is not None, (where, command)
        for word in words[1:]:
            if word.endswith(".py") and "/" in word:
                assert (ROOT / word).exists(), (where, command)
