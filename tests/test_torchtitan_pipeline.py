"""Pipeline parallel (degree 2) through ``activation-checkpoint:rematd``.

torchtitan's own pipeline run works on the same CPU ranks (with the schedule stand-in in
``bench/torchtitan_cpu.py``); rematd's must then train bitwise as it does, pinned and planned, without a hang,
under the budget from its first planned step, one handle per rank following torchtitan's interleaved schedule.
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
    # Each rank runs two stages of the interleaved schedule (layers 0 and 3-4, 1-2 and 5): one handle follows the
    # schedule and plans both, each block pinned by its layer number.
    for record, layers in zip(pinned, ([0, 3, 4], [1, 2, 5]), strict=True):
        (part,) = record["steps"][-1]
        assert part["modes"] == [PIN[i] for i in layers], part
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
