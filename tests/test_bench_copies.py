"""bench.copies: copies of one plan beside bench.phases' contenders, each measured on its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.copies import parse_plan
from rematd.planner import Mode

ROOT = Path(__file__).resolve().parent.parent


def test_a_plan_is_read_letter_by_letter_and_a_bad_one_is_refused_naming_it() -> None:
    assert parse_plan("R.R.", 4) == (Mode.RECOMPUTE, Mode.STORE, Mode.RECOMPUTE, Mode.STORE)
    with pytest.raises(ValueError, match="4 letters"):
        parse_plan("R.R", 4)
    with pytest.raises(ValueError, match=r"'Rs\.\.'"):
        parse_plan("Rs..", 4)


def test_the_quick_run_measures_every_copy(tmp_path: Path) -> None:
    out = tmp_path / "copies.json"
    subprocess.run(
        [sys.executable, "-m", "bench.copies", "--quick", "--copies", "2", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=300,
        capture_output=True,
    )
    report = json.loads(out.read_text())
    names = {row["contender"] for row in report["rows"]}
    assert {"RR.. #1", "RR.. #2", "R.R. #1", "R.R. #2", "rematd 45%", "rematd 70%"} <= names
    assert all(row["ratio"] > 0 and row["interval"][0] <= row["ratio"] <= row["interval"][1] for row in report["rows"])
    assert set(report["copy_gaps"]) == {"RR..", "R.R."} and all(g >= 0 for g in report["copy_gaps"].values())


def test_one_copy_is_refused() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.copies", "--quick", "--copies", "1"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 2 and "--copies must be at least 2" in run.stderr
