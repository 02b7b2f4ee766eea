"""bench/phases.py's race: which static plans go on from the warm-up to the measured rounds, and the quick
run end to end on real CPU steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.phases import finalists

ROOT = Path(__file__).resolve().parent.parent


def test_the_warm_ups_fastest_plans_that_fit_each_budget_go_on() -> None:
    warm = {"a": 1.10, "b": 1.02, "c": 1.05, "d": 0.90, "e": 1.01}
    peaks = {"a": 10, "b": 30, "c": 10, "d": 99, "e": 20}
    # Budget 15: a and c fit, c faster. Budget 30: all but d fit, e and b fastest.
    assert finalists(warm, peaks, [15, 30], 2) == {"a", "c", "b", "e"}
    assert finalists(warm, peaks, [15, 30], 1) == {"c", "e"}
    assert "d" not in finalists(warm, peaks, [15, 30], 5), "over every budget: never a finalist, however fast"
    assert finalists(warm, peaks, [5], 3) == set(), "none fits"


def test_the_quick_run_races_finalists_and_keeps_the_plans_that_stopped(tmp_path: Path) -> None:
    out = tmp_path / "phases.json"
    subprocess.run(
        [sys.executable, "-m", "bench.phases", "--quick", "--finalists", "2", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=300,
        capture_output=True,
    )
    report = json.loads(out.read_text())
    assert len(report["rows"]) == 4
    for row in report["rows"]:
        static = row["static"]
        raced = {k for k, v in static.items() if v["ratio"] is not None and k != "no checkpointing"}
        stopped = {k: v for k, v in static.items() if v["ratio"] is None}
        assert 1 <= len(raced) <= 2 * 2, "at most 2 finalists per budget"
        assert stopped and all(v["dropped"] for v in stopped.values()), "the plans that stopped say why"
        if row["chosen_static"] != "no checkpointing":
            assert row["chosen_static"] in raced, "the warm-up's pick is always a finalist"
        assert row["steps_over_budget"] == 0
