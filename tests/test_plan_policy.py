"""What a rank is sent, decided by the plan policy alone: no server, no record, a planner over a real profile."""

from __future__ import annotations

import dataclasses

import pytest

from rematd.planner import Mode, Plan, PlannerSession, Shape, ShapePlan
from rematd.planner.messages import MAX_INT, BlockProfile, Hello, InvalidMessage, open_planner
from rematd.server.core import plan_policy as policy

N = 6


def _planner(budget: int = 10_000, n: int = N) -> PlannerSession:
    hello = Hello(
        job_id="policy",
        blocks=tuple(
            BlockProfile(index=i, name=f"h.{i}", saved_bytes=1000, input_bytes=100, forward_seconds=0.01)
            for i in range(n)
        ),
        profile_shape=Shape(batch=1, seq_len=64, tokens=64),
        budget_bytes=budget,
    )
    return open_planner(hello)


def _warm(modes: list[str], *, job: str = "earlier", n: int = N, budget: int = 10**9) -> dict[str, object]:
    return {"job": job, "num_blocks": n, "modes": modes, "shape_plans": [], "budget_bytes": budget}


def test_mode_names_round_trip_and_unknown_names_are_refused_naming_the_field() -> None:
    modes = (Mode.STORE, Mode.RECOMPUTE, Mode.SELECTIVE, Mode.OFFLOAD)
    assert policy.modes_of(policy.mode_names(modes), "x") == modes
    with pytest.raises(InvalidMessage, match="pin_modes") as caught:
        policy.modes_of(["store", "swap"], "pin_modes")
    assert "swap" in str(caught.value)
    assert policy.letters(modes) == ".RsO"


def test_a_plan_row_keeps_every_blocks_mode_and_its_table() -> None:
    entry = ShapePlan(max_seq_len=32, max_tokens=32, modes=(Mode.STORE,) * 3, predicted_peak_bytes=5,
                      predicted_overhead_ratio=0.0)  # fmt: skip
    plan = Plan(version=3, blocks=(1,), checkpoint_every=0, predicted_peak_bytes=9, predicted_overhead_ratio=0.1,
                target_bytes=10, reason="r", shape_plans=(entry,))  # fmt: skip
    row = policy.plan_row(plan, 3)
    assert row["modes"] == ["store", "recompute", "store"] and row["blocks"] == [1] and row["version"] == 3
    assert [policy.shape_plan_of(e) for e in row["shape_plans"]] == [entry]


def test_the_entry_in_force_is_the_first_covering_the_length_or_the_last_past_the_table() -> None:
    short = {"max_seq_len": 32, "max_tokens": 64, "modes": ["store"], "predicted_peak_bytes": 1,
             "predicted_overhead_ratio": 0.0}  # fmt: skip
    long = {**short, "max_seq_len": 128, "max_tokens": 256, "modes": ["recompute"], "predicted_peak_bytes": 2}
    plan = {"modes": ["selective"], "predicted_peak_bytes": 3, "predicted_overhead_ratio": 0.5,
            "shape_plans": [short, long]}  # fmt: skip
    assert policy.entry_in_force(plan, 16)["modes"] == ["store"]
    assert policy.entry_in_force(plan, 16, tokens=100)["modes"] == ["recompute"], "too many tokens for the first"
    assert policy.entry_in_force(plan, 100)["max_seq_len"] == 128
    assert policy.entry_in_force(plan, 4096)["modes"] == ["recompute"], "past the table: its longest entry"
    own = policy.entry_in_force(plan, None)
    assert own == {"max_seq_len": None, "modes": ["selective"], "predicted_peak_bytes": 3,
                   "predicted_overhead_ratio": 0.5}  # fmt: skip
    assert policy.entry_in_force({**plan, "shape_plans": []}, 64)["modes"] == ["selective"]


def test_shape_buckets_group_sizes_within_a_factor_of_two() -> None:
    assert policy.shape_bucket(64) == policy.shape_bucket(127) != policy.shape_bucket(128)
    assert policy.shape_bucket(1) < policy.shape_bucket(2) < policy.shape_bucket(4)


def test_plans_the_record_cannot_hold_are_refused_naming_the_cause() -> None:
    plan = _planner().plan
    policy.check_fits(plan, "stats.shape")
    with pytest.raises(InvalidMessage, match=r"hello\.plan_version"):
        policy.check_fits(dataclasses.replace(plan, version=MAX_INT + 1), "stats.shape")
    with pytest.raises(InvalidMessage, match=r"stats\.shape.*more than"):
        policy.check_fits(dataclasses.replace(plan, predicted_peak_bytes=MAX_INT + 1), "stats.shape")


def test_a_pin_overrides_the_planner_at_the_version_the_rank_has() -> None:
    planner = _planner()
    none = policy.pinned_plan(planner, 4, N, pin_modes=None, pin_every=None, pin_blocks=None)
    assert none is None
    every = policy.pinned_plan(planner, 4, N, pin_modes=None, pin_every=2, pin_blocks=None)
    assert every is not None and every.version == 4 and every.blocks == (0, 2, 4) and every.checkpoint_every == 2
    assert "every 2 block(s)" in every.reason
    blocks = policy.pinned_plan(planner, 4, N, pin_modes=None, pin_every=None, pin_blocks=(1, 5, 9))
    assert blocks is not None and blocks.blocks == (1, 5), "blocks past the rank's are dropped"
    stores = policy.pinned_plan(planner, 4, N, pin_modes=None, pin_every=0, pin_blocks=None)
    assert stores is not None and stores.blocks == () and "every block stores" in stores.reason
    # A mode this profile does not offer becomes recomputation, and the reason says so.
    modes = policy.pinned_plan(planner, 4, N, pin_modes=(Mode.OFFLOAD, Mode.STORE), pin_every=None, pin_blocks=None)
    assert modes is not None and modes.block_modes(N) == (Mode.RECOMPUTE,) + (Mode.STORE,) * (N - 1)
    assert "offers no such mode" in modes.reason
    # Priced by the profile: recomputing more predicts a lower peak.
    assert every.predicted_peak_bytes < stores.predicted_peak_bytes


def test_a_new_plan_goes_out_only_when_modes_or_table_change_and_is_versioned_after_the_sent_one() -> None:
    planner = _planner()
    sent = dataclasses.replace(planner.plan, version=7)
    assert policy.next_plan(dataclasses.replace(sent, reason="other words", version=2), sent, N) is None
    pinned = policy.pinned_plan(planner, 7, N, pin_modes=None, pin_every=1, pin_blocks=None)
    assert pinned is not None
    out = policy.next_plan(pinned, sent, N)
    assert out is not None and out.version == 8 and out.blocks == tuple(range(N))


def test_warm_starts_are_taken_only_from_another_job_of_the_same_size_that_fits() -> None:
    planner = _planner(budget=10**9)
    version = planner.plan.version

    def warm(row: dict[str, object]) -> Plan | None:
        return policy.warm_start_plan(row, job="policy", num_blocks=N, planner=planner, version=version)

    every_other = ["recompute", "store"] * (N // 2)
    taken = warm(_warm(every_other))
    assert taken is not None and taken.version == version and taken.blocks == (0, 2, 4)
    assert taken.reason == "warm start from job earlier"
    assert warm(_warm(every_other, job="policy")) is None, "a job's own plan is no warm start"
    assert warm(_warm(every_other[:-1], n=N - 1)) is None, "another model size"
    # Another budget: a plan made for 4 MiB is no start for 1 GB, nor the other way round; within 10% it is.
    assert warm(_warm(every_other, budget=4 * 2**20)) is None
    assert warm(_warm(every_other, budget=10**10)) is None
    assert warm(_warm(every_other, budget=int(0.91 * 10**9))) is not None
    with pytest.raises(ValueError, match="unreadable"):
        warm(_warm(["store", "warp", *every_other[2:]]))
    with pytest.raises(ValueError, match="unreadable"):
        warm({**_warm(every_other), "shape_plans": [{"max_seq_len": 8}]})
    table = [policy.shape_plan_row(e) for e in planner.plan.shape_plans]
    same = warm({**_warm(policy.mode_names(planner.plan.block_modes(N))), "shape_plans": table})
    assert same is not None and same.reason.endswith("(same as planned)")
    # Under a tight budget, storing everything does not fit this job's target: planned afresh.
    tight = _planner(budget=3_000)
    assert tight.plan.blocks, "the tight budget needs recomputation"
    assert policy.warm_start_plan(_warm(["store"] * N, budget=3_000), job="policy", num_blocks=N, planner=tight,
                                  version=1) is None  # fmt: skip


def test_steady_ranks_with_low_risk_may_fold_their_reports() -> None:
    quiet = {"quiet_steps": 50, "max_interval_seconds": 2.0}
    assert policy.report_interval(steps_on_plan=50, steady=True, oom_risk=0.0, **quiet) == 2.0
    assert policy.report_interval(steps_on_plan=49, steady=True, oom_risk=0.0, **quiet) == 0.0
    assert policy.report_interval(steps_on_plan=50, steady=False, oom_risk=0.0, **quiet) == 0.0
    assert policy.report_interval(steps_on_plan=50, steady=True, oom_risk=policy.QUIET_RISK, **quiet) == 0.0
