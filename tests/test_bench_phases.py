"""bench/phases.py's race: which static plans go on from the warm-up to the measured rounds, and the quick
run end to end on real CPU steps."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

from bench.common import median_interval
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


def test_the_medians_interval_covers_it_as_often_as_it_says() -> None:
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None, "four values cannot bound a median at 90%"
    # Five: the smallest and the largest, which miss the median only when all five fall on one side (1 in 16).
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == (1.0, 5.0)
    # 160 values: the 70th and 91st smallest, a 90% interval from the binomial distribution.
    assert median_interval([float(i) for i in range(160)]) == (69.0, 90.0)
    rng = random.Random(0)
    tries = 2000
    for level, n in ((0.9, 41), (0.9, 160), (0.5, 25)):
        covered = 0
        for _ in range(tries):
            found = median_interval([rng.lognormvariate(0.0, 0.5) for _ in range(n)], level)
            assert found is not None
            low, high = found
            covered += low <= 1.0 <= high  # the lognormal's median is 1
        # The exact coverage of the interval's ranks (k-th smallest to k-th largest) is at least the level, and
        # the draws cover as often, within 4 standard errors of sampling.
        ranks = median_interval([float(i) for i in range(n)], level)
        assert ranks is not None
        k = int(ranks[0]) + 1
        exact = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
        assert exact >= level
        assert abs(covered / tries - exact) <= 4 * math.sqrt(exact * (1 - exact) / tries), (level, n, covered / tries)


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
        assert row["plan_trials_voided"] >= 0 and row["plan_trials_disputed"] >= 0 and row["plan_trials_reverted"] >= 0
        if row["vs_chosen_interval"] is not None:
            low, high = row["vs_chosen_interval"]
            assert low <= row["vs_chosen_static"] <= high
