from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def rematd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rematd.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_and_the_plan_moves(tmp_path: object) -> None:
    out = rematd("demo", "--no-serve", "--steps", "24", "--http-port", "0")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert len(rows) == 24
    seqs = [int(r[1]) for r in rows]
    assert max(seqs) > min(seqs), "the sequence length changes mid-run"
    long_modes = [r[2] for r in rows if int(r[1]) == max(seqs)]
    assert any(set(m) - {"."} for m in long_modes), "the long sequences are checkpointed"
    assert all(float(r[5]) <= float(r[6]) for r in rows[2:]), "every planned step fits the budget"
    # --no-serve stops the service with the training: no dashboard address that would not answer.
    assert "dashboard" not in out.stdout and "service stopped" in out.stdout, out.stdout


def test_usage_errors() -> None:
    out = rematd("frobnicate")
    assert out.returncode == 2 and "unknown command" in out.stderr
    out = rematd("serve", "--grpc-port", "70000")
    assert out.returncode == 2 and "grpc-port" in out.stderr
    out = rematd("demo", "--budget-mib", "-1")
    assert out.returncode == 2 and "budget-mib" in out.stderr
    assert rematd("--help").returncode == 0


def test_a_database_that_cannot_be_used_is_named_not_traced(tmp_path: Path) -> None:
    cases = {
        "foo://bar": "no database of that kind",
        "postgresql://rematd:secret@127.0.0.1:1/rematd": "cannot use the database",
        "/proc/nope/r.db": "No such file or directory",
    }
    procs = {
        db: subprocess.Popen(
            [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0", "--db", db],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for db in cases
    }
    for db, why in cases.items():
        out, err = procs[db].communicate(timeout=60)
        assert procs[db].returncode == 2, (db, out, err)
        assert "Traceback" not in err, err
        shown = db.replace("rematd:secret@", "***@")
        assert f"rematd serve: --db {shown}: " in err and why in err, err
        assert "secret" not in err
