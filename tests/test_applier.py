"""The step-boundary applier: a step like the last costs nothing, and every change still lands."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from rematd.client.plans.applier import NO_PLAN, PlanApplier
from rematd.planner import Mode, Shape
from rematd.planner.plan import ShapePlan

S, R, K = Mode.STORE, Mode.RECOMPUTE, Mode.SELECTIVE


class CountingBlock(SimpleNamespace):
    """Stands for a switchable block: counts how often its mode is set."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "mode":
            super().__setattr__("sets", getattr(self, "sets", 0) + 1)
        super().__setattr__(name, value)


def shape(seq: int) -> Shape:
    return Shape(batch=2, seq_len=seq, tokens=2 * seq)


def table_plan(version: int) -> Any:
    short = ShapePlan(max_seq_len=64, max_tokens=128, modes=(S, S), predicted_peak_bytes=1, predicted_overhead_ratio=0)
    long = ShapePlan(max_seq_len=256, max_tokens=512, modes=(R, K), predicted_peak_bytes=2, predicted_overhead_ratio=0)
    return dataclasses.replace(NO_PLAN, version=version, modes=(R, R), shape_plans=(short, long))


def modes(blocks: list[CountingBlock]) -> tuple[Mode, ...]:
    return tuple(b.mode for b in blocks)


def test_same_plan_same_shape_sets_nothing_and_every_change_lands() -> None:
    blocks = [CountingBlock(mode=S), CountingBlock(mode=S)]
    applier = PlanApplier(blocks)  # type: ignore[arg-type]
    applier.receive(table_plan(1))
    applier.apply_pending(shape(32))
    assert modes(blocks) == (S, S)
    sets = [b.sets for b in blocks]

    for _ in range(5):  # steady steps: no work on the blocks
        assert applier.apply_pending(shape(32)) is None
    assert [b.sets for b in blocks] == sets

    applier.apply_pending(shape(200))  # a longer step takes the table's other entry
    assert modes(blocks) == (R, K)

    applier.pinned = (K, K)
    applier.invalidate()
    applier.apply_pending(shape(200))
    assert modes(blocks) == (K, K)

    applier.pinned = None
    applier.invalidate()
    applier.apply_pending(shape(200))
    assert modes(blocks) == (R, K)

    # Modes set behind the applier's back (safe mode) are set again once invalidated.
    for b in blocks:
        b.mode = R
    applier.invalidate()
    applier.apply_pending(shape(32))
    assert modes(blocks) == (S, S)

    newer = dataclasses.replace(table_plan(2), shape_plans=())
    applier.receive(newer)
    assert applier.apply_pending(shape(32)) == newer
    assert modes(blocks) == (R, R)


def test_a_step_past_the_table_runs_every_block_at_its_leanest_until_the_table_covers_it() -> None:
    # The largest entry was fitted to fewer activations than such a step saves.
    blocks = [CountingBlock(mode=S, offer=(S, K)), CountingBlock(mode=S, offer=(S, K, R))]
    applier = PlanApplier(blocks)  # type: ignore[arg-type]
    applier.receive(table_plan(1))
    applier.apply_pending(shape(2048))
    assert modes(blocks) == (K, R), "longer than any entry: each block keeps the least its offer allows"
    applier.apply_pending(Shape(batch=4, seq_len=200, tokens=800))
    assert modes(blocks) == (K, R), "more tokens than any entry covers"
    applier.apply_pending(shape(200))
    assert modes(blocks) == (R, K)
    applier.apply_pending(shape(32))
    assert modes(blocks) == (S, S)
    longer = ShapePlan(max_seq_len=4096, max_tokens=8192, modes=(K, S), predicted_peak_bytes=3,
                       predicted_overhead_ratio=0)  # fmt: skip
    applier.receive(dataclasses.replace(table_plan(2), shape_plans=(*table_plan(2).shape_plans, longer)))
    applier.apply_pending(shape(2048))
    assert modes(blocks) == (K, S), "once the table covers the length, its entry runs"


def test_past_a_table_that_a_newer_plan_still_does_not_reach_the_longest_entry_runs_again() -> None:
    # The planner answered a step past its table with a plan that does not cover it either (its ladder
    # capped, say): no longer lean for steps no larger than that one, lean again for a larger one.
    blocks = [CountingBlock(mode=S, offer=(S, K)), CountingBlock(mode=S, offer=(S, K, R))]
    applier = PlanApplier(blocks)  # type: ignore[arg-type]
    applier.receive(table_plan(1))
    applier.apply_pending(shape(1024))
    assert modes(blocks) == (K, R)
    applier.receive(table_plan(2))
    applier.apply_pending(shape(1024))
    assert modes(blocks) == (R, K), "the same step under a newer plan: its longest entry"
    applier.apply_pending(shape(512))
    assert modes(blocks) == (R, K)
    applier.apply_pending(shape(2048))
    assert modes(blocks) == (K, R), "longer than any step seen past the table: lean again"


def test_a_step_of_the_same_shape_object_still_sees_a_plan_a_pin_or_a_cut_answered() -> None:
    """The steady step's check reads no lock and builds nothing: each change it must not miss, met with the very
    shape object the last step had (``shape_of`` hands the same one back for a step like the last)."""
    offer = frozenset({S, K, R})
    blocks = [CountingBlock(mode=S, offer=offer), CountingBlock(mode=S, offer=offer)]
    applier = PlanApplier(blocks)  # type: ignore[arg-type]
    same = shape(32)
    applier.receive(table_plan(1))
    applier.apply_pending(same)
    sets = [b.sets for b in blocks]
    assert applier.apply_pending(same) is None
    assert [b.sets for b in blocks] == sets

    # A budget cut the planner's thread has not taken in: the leanest modes, then the plan's once it answers
    # (answered() flips the flag alone, invalidating nothing).
    assert applier.hold_until_answered(same, target_bytes=0)
    applier.apply_pending(same)
    assert modes(blocks) == (R, R)
    applier.answered()
    applier.apply_pending(same)
    assert modes(blocks) == (S, S)

    applier.pin([K, R])
    applier.apply_pending(same)
    assert modes(blocks) == (K, R)
    applier.pin(None)
    applier.apply_pending(same)
    assert modes(blocks) == (S, S)

    newer = dataclasses.replace(table_plan(2), shape_plans=())
    applier.receive(newer)
    assert applier.apply_pending(same) == newer
    assert modes(blocks) == (R, R)
