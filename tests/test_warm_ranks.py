"""Ranks forked from a process that has imported torch start as fresh interpreters would: their environment,
command line, working directory, output files and exit code are the ones given; ``REMATD_WARM_RANKS=0`` starts
fresh interpreters with the same interface."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import warm

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_a_rank_starts_as_a_fresh_interpreter_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked: bool
) -> None:
    monkeypatch.setenv("REMATD_WARM_RANKS", "1" if forked else "0")
    assert warm.enabled() is forked
    out, err = tmp_path / "out", tmp_path / "err"
    ranks = [
        warm.start(
            "tests.workers.describe",
            [str(code), "and", "more"],
            env={"PATH": "/usr/bin:/bin", "REMATD_DESCRIBE": f"rank {code}", "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stdout=out if code == 0 else tmp_path / "out3",
            stderr=err if code == 0 else tmp_path / "out3",
        )
        for code in (0, 3)
    ]
    assert warm.wait_all(ranks, 60.0, stop_on_failure=False)
    assert [r.returncode for r in ranks] == [0, 3]
    seen = json.loads(out.read_text())
    assert seen == {
        "argv": ["0", "and", "more"],
        "setting": "rank 0",
        "cwd": str(ROOT),
        "torch_before": forked,
        "main": "__main__",
        "launcher_imported": None,
    }
    assert err.read_text() == "to standard error\n"
    both = (tmp_path / "out3").read_text()  # one file for both streams
    assert '"setting": "rank 3"' in both and "to standard error" in both


def test_the_wait_kills_ranks_still_running_at_its_timeout(tmp_path: Path) -> None:
    log = tmp_path / "log"
    rank = warm.start(
        "tests.workers.describe", ["not a number"], env={"PATH": "/usr/bin:/bin"}, cwd=ROOT, stdout=log, stderr=log
    )
    assert warm.wait_all([rank], 60.0, stop_on_failure=True)
    assert rank.returncode == 1 and "ValueError" in log.read_text(), log.read_text()
    sleeper = warm.start("tests.workers.sleep", [], env={"PATH": "/usr/bin:/bin"}, cwd=ROOT, stdout=log, stderr=log)
    assert not warm.wait_all([sleeper], 1.0, stop_on_failure=True)
    assert sleeper.returncode == -9


def test_a_rank_runs_its_own_module_and_not_the_launchers_main() -> None:
    """A script that launches ranks, even one without a main guard, is not run again in them."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "launch_unguarded.py")],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "REMATD_DESCRIBE": "once"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines.count("launcher imported") == 1, done.stdout
    seen = json.loads(lines[-2])
    assert seen["setting"] == "once" and seen["main"] == "__main__" and seen["launcher_imported"] is None, seen
