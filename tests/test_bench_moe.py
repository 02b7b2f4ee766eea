"""``bench.moe``'s arguments and what it counts, on records shaped as ``bench.torchtitan_cpu`` writes them (a run
of the benchmark itself trains a mixture of experts on 2 ranks for minutes: it is run by hand, docs/torchtitan.md)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import moe

MiB = 2**20


def step(
    measured_mib: float,
    ran: str = "",
    plan: tuple[str, ...] = ("recompute",) * 3 + ("store",) * 3,
    overhead: float = 0.5,
    priced: dict[str, float] | None = None,
) -> Any:
    return [
        {
            "measured": int(measured_mib * MiB),
            "predicted": 0,
            "routed": 0,
            "ran": ran,
            "ran_reason": "",
            "modes": list(plan),
            "overhead": overhead,
            "priced": priced or {},
        }
    ]


def test_the_arguments_name_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in (
        (["--stored", "1"], "--stored must lie between 2 and 5"),
        (["--stored", "6"], "--stored must lie between 2 and 5"),
        (["--headroom", "1.5"], "--headroom must lie in [0, 1)"),
        (["--skew", "2"], "--skew must name steps from 4"),
    ):
        with pytest.raises(SystemExit):
            moe.parse(argv)
        assert words in capsys.readouterr().err, argv
    args = moe.parse(["--steps", "6", "--skew", "5"])
    assert args.skewed == [5] and args.stored == 3 and args.headroom == 0.02


def test_a_step_over_on_either_rank_counts_once_and_skewed_steps_apart() -> None:
    args = moe.parse(["--steps", "6", "--skew", "4,6"])
    # Rank 0 crosses on both skewed steps, rank 1 on the second too: two steps over, not three.
    zero = [step(120), step(290), step(295), step(310), step(296), step(320)]
    one = [step(120), step(291), step(294), step(299), step(297), step(309, ran="RRRR.R")]
    records = [{"steps": r, "seconds": [1.0, 2.0, 2.0, 3.0, 2.0, 3.0]} for r in (zero, one)]
    row = moe.summary("static", records, args, budget=300 * MiB)
    assert row["over"] == 2
    assert row["held_mib"] == 320
    assert moe.measured(records, skewed=False, args=args) == 297 * MiB
    assert row["balanced_recomputing"] == "3 + 0" and row["skewed_recomputing"] == "3 + 0"
    assert row["balanced_recompute"] == 0.5
    # The first skewed step is left out of the skewed steps' times (its own plan may still be settling).
    assert row["balanced_s"] == 2.0 and row["skewed_s"] == 3.0
    assert [s["rank1"]["ran"] for s in row["steps"]][-1] == "RRRR.R"
    assert row["steps"][3]["skewed"] and not row["steps"][2]["skewed"]


def test_parts_count_apart_from_whole_blocks_and_the_verdict_weighs_recompute() -> None:
    args = moe.parse(["--steps", "4", "--skew", "4"])
    priced = {"RRRR..": 0.45}
    planning = [step(120, priced=priced), step(280, ran="mRmRR.", overhead=0.4, priced=priced)]
    planning += [
        step(281, ran="mRmRR.", overhead=0.4, priced=priced),
        step(290, ran="RRRRR.", overhead=0.6, priced=priced),
    ]
    records = [{"steps": planning, "seconds": [1.0, 2.0, 2.2, 2.4]} for _ in range(2)]
    row = moe.summary("rematd planning", records, args, budget=300 * MiB)
    assert row["balanced_recomputing"] == "3 + 2" and row["skewed_recomputing"] == "5 + 0"
    assert row["balanced_recompute"] == 0.4 and row["skewed_recompute"] == 0.6
    made = {**row, "contender": "rematd pinned to RRR...", "over": 1}
    fitting = {**row, "contender": "rematd pinned to RRRR..", "balanced_recompute": 0.5, "balanced_s": 2.0}
    text = moe.verdict([made, fitting, row])
    assert "rematd pinned to RRR... 1" in text and "rematd planning 0" in text
    assert row["balanced_priced"] == {"RRRR..": 0.45}
    assert "rematd planning 40.0% of a forward (RRRR.. 45.0% as the same planners price it)" in text
    assert "rematd pinned to RRRR.. 50.0%" in text
    assert "1.050x" in text
