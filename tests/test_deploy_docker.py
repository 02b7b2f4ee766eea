"""The service image: Docker cannot run here, so its Dockerfile's invariants are checked by
parsing it, and what the image runs (the service without torch) is run for real."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.served import stop

from .deploy_helpers import DEPLOY, ROOT

DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"


@dataclass(frozen=True, slots=True)
class Instruction:
    op: str
    arg: str

    def exec_form(self) -> list[str]:
        """The JSON (exec) form's words; shell form is split like a shell would."""
        if self.arg.startswith("["):
            words: list[str] = json.loads(self.arg)
            return words
        return shlex.split(self.arg)


def parse(text: str) -> list[list[Instruction]]:
    """Stages of a Dockerfile, each a list of instructions (continuations joined, comments dropped)."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a line continuation"
    stages: list[list[Instruction]] = []
    for line in logical:
        op, _, arg = line.partition(" ")
        ins = Instruction(op.upper(), arg.strip())
        if ins.op == "FROM":
            stages.append([])
        elif ins.op != "ARG":
            assert stages, f"{line!r} before the first FROM"
        if stages:
            stages[-1].append(ins)
    return stages


def shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, split at ``&&``, ``||``, ``;`` and ``|`` outside quotes."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def final_stage() -> list[Instruction]:
    return parse(DOCKERFILE.read_text(encoding="utf-8"))[-1]


def one(stage: list[Instruction], op: str) -> Instruction:
    found = [i for i in stage if i.op == op]
    assert len(found) == 1, f"expected one {op} in the final stage, found {len(found)}"
    return found[0]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves ``path`` out, by .dockerignore's rules (last match wins)."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        candidates = [pat, pat.removeprefix("**/")] if pat.startswith("**/") else [pat]
        hit = any(
            fnmatch.fnmatchcase(p, c) or fnmatch.fnmatchcase(p.split("/")[-1], c) for p in prefixes for c in candidates
        )
        if hit:
            result = not negate
    return result


def test_final_stage_runs_as_a_non_root_numeric_user() -> None:
    stage = final_stage()
    user = [i for i in stage if i.op == "USER"]
    assert user, "the final stage must set USER"
    name = user[-1].arg.split(":")[0]
    assert name.isdigit() and int(name) != 0, f"USER {user[-1].arg}: numeric and not root, for runAsNonRoot"
    # Nothing after the USER line switches back.
    assert stage.index(user[-1]) > max(i for i, ins in enumerate(stage) if ins.op in ("RUN", "COPY"))


def test_image_installs_the_server_and_postgres_extras_and_never_torch() -> None:
    stages = parse(DOCKERFILE.read_text(encoding="utf-8"))
    installs = []
    for stage in stages:
        for ins in stage:
            if ins.op != "RUN":
                continue
            for words in shell_commands(ins.arg):
                if words and words[0].endswith("pip") and "install" in words:
                    installs.append(words[words.index("install") + 1 :])
    assert installs == [[".[server,postgres]"]], (
        f"the image installs exactly the server and postgres extras, got {installs}"
    )
    for stage in stages:
        for ins in stage:
            if ins.op in ("RUN", "COPY", "ADD"):
                spec = ins.arg.replace("find_spec('torch')", "")
                assert not re.search(r"torch|\[client|\[dev|,client|,dev", spec), f"{ins.op} {ins.arg}"
    assert stages[0][0].arg.startswith("${PYTHON_IMAGE}")
    base = re.search(r"PYTHON_IMAGE=(\S+)", DOCKERFILE.read_text(encoding="utf-8"))
    assert base and "slim" in base.group(1), "a slim Python base image"


def test_healthcheck_ports_and_command() -> None:
    stage = final_stage()
    health = one(stage, "HEALTHCHECK").arg
    assert "--interval=" in health and "CMD" in health
    probe = health.split("CMD", 1)[1].strip()
    assert "http://127.0.0.1:8080/healthz" in probe
    exposed = {p for ins in stage if ins.op == "EXPOSE" for p in ins.arg.split()}
    assert {"50051", "8080"} <= exposed
    command = one(stage, "ENTRYPOINT").exec_form() + one(stage, "CMD").exec_form()
    assert command == ["rematd", "serve", "--grpc-host", "0.0.0.0", "--http-host", "0.0.0.0", "--db", "/data/rematd.db"]
    volume = one(stage, "VOLUME").exec_form()
    assert volume == ["/data"], "the store lives on the volume"


def test_dockerignore_keeps_the_sources_the_build_copies() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for stage in parse(DOCKERFILE.read_text(encoding="utf-8")):
        for ins in stage:
            if ins.op == "COPY" and "--from" not in ins.arg:
                sources += ins.exec_form()[:-1]
    assert sources, "the build copies the sources"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
        assert not ignored(src, patterns), f"COPY {src}: excluded by {DOCKERIGNORE.name}"
    for heavy in (".venv", ".git", "tests", "build", "server/__pycache__", "rematd.db"):
        assert ignored(heavy, patterns), f"{heavy} should stay out of the build context"


def test_the_service_runs_without_torch(tmp_path: Path) -> None:
    """What the image runs: ``rematd serve`` with torch impossible to import."""
    script = (
        "import sys; sys.modules['torch'] = None\nfrom rematd.server.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    args = ["serve", "--grpc-port", "0", "--http-port", "0", "--db", str(tmp_path / "rematd.db")]
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        http = None
        deadline = time.monotonic() + 30
        lines = []
        while http is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"REST on http://([^/\s]+)/", line):
                http = m.group(1)
        assert http, "rematd serve did not start without torch:\n" + "".join(lines)
        assert httpx.get(f"http://{http}/healthz", timeout=5).json()["status"] == "ok"
        assert "rematd_active_streams" in httpx.get(f"http://{http}/metrics", timeout=5).text
    finally:
        stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()
