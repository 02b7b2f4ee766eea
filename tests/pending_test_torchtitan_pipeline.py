"""Pipeline parallel (degree 2) through ``activation-checkpoint:rematd``: not collected yet.

Rename this file to ``test_torchtitan_pipeline.py`` once the client runs pipeline schedules: today a pipeline
run of rematd's mode hangs at the first step, as each rank agrees on one plan per model part at that part's first
forward, and under a pipeline schedule the ranks reach their parts at different times (and each rank holds two
parts under torchtitan's interleaved schedule). torchtitan's own pipeline run on the same CPU ranks works (with
the schedule stand-in in ``tests/torchtitan_cpu.py``); this is what rematd's must then do: train bitwise as it
does, pinned and planned, without a hang, each part's steps under the budget from its first planned step.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_torchtitan import PIN, STEPS, assert_bitwise, assets, train

PIPELINE = ("--parallelism.pipeline-parallel-degree", "2", "--training.disable-cuda-graphs")

__all__ = ["assets"]  # the fixture, for pytest


def test_pipeline_degree_2_trains_as_torchtitan(tmp_path: Path, assets: tuple[Path, Path]) -> None:
    reference = train(
        tmp_path, assets, ranks=2, module="torchtitan.train", checkpointing=["activation-checkpoint:none"],
        parallelism=PIPELINE,
    )  # fmt: skip
    rematd = ["activation-checkpoint:rematd", "--activation-checkpoint.margin", "0.02"]
    pinned = train(
        tmp_path, assets, ranks=2, module="rematd.integrations.torchtitan",
        checkpointing=[*rematd, "--activation-checkpoint.pin", ",".join(PIN)], parallelism=PIPELINE,
    )  # fmt: skip
    assert_bitwise(reference, pinned, "pinned plan, pipeline")
    # Each rank holds two stages of the interleaved schedule, each stage its own handle with its layers' pins.
    for record in pinned:
        parts = record["steps"][-1]
        assert len(parts) == 2 and all(set(p["modes"]) <= set(PIN) for p in parts)
    budgets = []
    for record in pinned:
        profiled, *later = record["steps"]
        for i, part in enumerate(profiled):
            storing = part["measured"] - part["static"] + later[0][i]["static"]
            mixed = max(step[i]["measured"] for step in later)
            budgets.append((mixed + storing) // 2)
    budget = min(budgets)
    planned = train(
        tmp_path, assets, ranks=2, module="rematd.integrations.torchtitan",
        checkpointing=[*rematd, "--activation-checkpoint.budget-bytes", str(budget)], parallelism=PIPELINE,
    )  # fmt: skip
    assert_bitwise(reference, planned, "planned, pipeline")
    for record in planned:
        assert len(record["steps"]) == STEPS
        over = [(k, p) for k, step in enumerate(record["steps"][1:], 2) for p in step if p["measured"] > budget]
        assert not over, over
