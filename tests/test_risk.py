"""The caching allocator's fragmentation and the device's free memory shrink what a step can use: the
plan tightens and the OOM risk rises. At H100 magnitudes (tests/data/h100_gpt2.json: GPT-2 24 x 1024,
batch 8 x 1024, as rematd profiled it on the GPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rematd.planner import BlockCost, Mode, PlannerSession, Profile, Shape, StepObservation
from rematd.planner.messages import MEMORY_CUDA, BlockProfile, Hello, StepStats, observation
from rematd.planner.risk import GRAIN, device_room_bytes, fragmented_bytes, oom_risk, usable_bytes

DATA = json.loads((Path(__file__).parent / "data" / "h100_gpt2.json").read_text())
GiB = 2**30
SHAPE = Shape(batch=8, seq_len=1024, tokens=8192)
STATIC = int(DATA["static_bytes"])
SAVED = int(DATA["profiled_block_bytes"]["saved"])
INPUT = int(DATA["profiled_block_bytes"]["input"])
TOTAL = 80 * GiB
# Static memory and half of what the blocks save: the 50% budget of the H100 runs.
BUDGET = STATIC + 12 * SAVED


def profile() -> Profile:
    block = BlockCost(saved_bytes=SAVED, input_bytes=INPUT, forward_seconds=0.006)
    return Profile(blocks=(block,) * 24, shape=SHAPE)


def step(peak: int, **allocator: int) -> StepObservation:
    return StepObservation(
        step=0, peak_bytes=peak, budget_bytes=BUDGET, static_bytes=STATIC, shape=SHAPE, plan_version=1, **allocator
    )


def clean(peak: int) -> StepObservation:
    """A CUDA step whose allocator holds little beyond its peak, none of it fragmented, alone on the device."""
    return step(
        peak,
        allocated_bytes=STATIC,
        reserved_bytes=peak + 256 * 2**20,
        peak_reserved_bytes=peak + 256 * 2**20,
        free_bytes=TOTAL - peak - 2 * GiB,
        total_bytes=TOTAL,
    )


def test_without_the_allocators_figures_the_budget_is_what_a_step_can_use() -> None:
    assert usable_bytes(step(9 * GiB)) == BUDGET, "an older client sends none of them"
    cpu = step(9 * GiB, total_bytes=64 * GiB)  # what the CPU client reports: host memory, nothing else
    assert usable_bytes(cpu) == BUDGET and fragmented_bytes(cpu) == 0 and device_room_bytes(cpu) is None
    odd = step(9 * GiB, reserved_bytes=20 * GiB, free_bytes=70 * GiB, total_bytes=TOTAL)
    assert device_room_bytes(odd) is None, "free and reserved past the device's total are not believed"


def test_fragmentation_is_the_inactive_split_bytes_within_what_the_allocator_held_spare() -> None:
    peak = 12 * GiB
    roomy = dataclasses.replace(clean(peak), inactive_split_bytes=3 * GiB, peak_reserved_bytes=peak + 4 * GiB)
    assert fragmented_bytes(roomy) == 0, "with room to grow its reserve, split blocks cost no allocation anything"
    heavy = dataclasses.replace(roomy, alloc_retries=1)  # the allocator was short: it freed its cache and retried
    assert fragmented_bytes(heavy) == 3 * GiB
    full = dataclasses.replace(roomy, free_bytes=0, reserved_bytes=peak + 4 * GiB)  # its reserve is all there is
    assert fragmented_bytes(full, device_room_bytes(full)) == 3 * GiB
    # At the peak the allocator held only 1 GiB beyond the allocations: fragmentation cost it no more.
    capped = dataclasses.replace(heavy, peak_reserved_bytes=peak + GiB)
    assert fragmented_bytes(capped) == GiB
    grain = BUDGET // GRAIN
    assert BUDGET - 3 * GiB - grain < usable_bytes(heavy) <= BUDGET - 3 * GiB
    assert usable_bytes(capped) > usable_bytes(heavy)


def test_another_process_on_the_device_bounds_the_budget() -> None:
    peak = 10 * GiB
    roomy = clean(peak)
    assert device_room_bytes(roomy) == TOTAL - 2 * GiB + 256 * 2**20 and usable_bytes(roomy) == BUDGET
    crowded = dataclasses.replace(roomy, free_bytes=GiB)  # what is neither free nor its own belongs to others
    room = crowded.free_bytes + crowded.reserved_bytes
    assert device_room_bytes(crowded) == room < BUDGET
    assert room - BUDGET // GRAIN < usable_bytes(crowded) <= room


@pytest.mark.parametrize(
    "trouble",
    [
        {"inactive_split_bytes": 3 * GiB, "peak_reserved_bytes_over": 4 * GiB, "alloc_retries": 1},
        {"free_bytes_left": GiB // 2},
    ],
    ids=["fragmented", "crowded"],
)
def test_same_allocated_peak_a_troubled_rank_gets_a_tighter_plan_and_a_higher_risk(trouble: dict[str, int]) -> None:
    calm, troubled = (PlannerSession(profile(), budget_bytes=BUDGET, static_bytes=STATIC) for _ in range(2))
    peak = calm.plan.predicted_peak_bytes  # the step measures what the plan predicted
    assert calm.plan.target_bytes == troubled.plan.target_bytes and peak <= calm.plan.target_bytes
    base = clean(peak)
    if "inactive_split_bytes" in trouble:
        bad = dataclasses.replace(
            base,
            inactive_split_bytes=trouble["inactive_split_bytes"],
            peak_reserved_bytes=peak + trouble["peak_reserved_bytes_over"],
            reserved_bytes=peak + trouble["peak_reserved_bytes_over"],
            alloc_retries=trouble["alloc_retries"],
        )
    else:
        bad = dataclasses.replace(base, free_bytes=trouble["free_bytes_left"])
    assert bad.peak_bytes == base.peak_bytes and bad.allocated_bytes == base.allocated_bytes

    assert calm.observe(base) is None, "a clean step at the predicted peak changes nothing"
    tighter = troubled.observe(bad)
    assert tighter is not None and tighter.reason.startswith("tighten")
    assert tighter.target_bytes < calm.plan.target_bytes
    assert tighter.predicted_peak_bytes <= tighter.target_bytes and tighter.predicted_peak_bytes < peak
    recomputed = sum(m == Mode.RECOMPUTE for m in tighter.modes)
    assert recomputed > sum(m == Mode.RECOMPUTE for m in calm.plan.modes)
    assert troubled.capacity_bytes < calm.capacity_bytes
    assert troubled.oom_risk > calm.oom_risk


def test_risk_rises_with_fragmentation_at_the_same_prediction() -> None:
    peak = BUDGET - 2 * GiB
    base = dataclasses.replace(clean(peak), alloc_retries=1)  # short, with and without fragmentation
    frag = dataclasses.replace(base, inactive_split_bytes=2 * GiB, peak_reserved_bytes=peak + 3 * GiB)

    def risk(obs: StepObservation) -> float:
        return oom_risk(obs, predicted_next_bytes=peak, capacity_bytes=usable_bytes(obs), margin_ratio=0.1)

    assert 0.0 <= risk(base) < risk(frag) <= 1.0
    crowded = dataclasses.replace(base, free_bytes=GiB // 2)
    assert risk(base) < risk(crowded) <= 1.0, "others hold the device: only its own cache and 512 MiB are left"


def test_the_wire_fields_reach_the_planner() -> None:
    hello = Hello(
        job_id="j",
        rank=0,
        world_size=1,
        device_name="H100",
        device_total_bytes=TOTAL,
        model_fingerprint="f",
        blocks=(BlockProfile(index=0, name="h.0", saved_bytes=SAVED, input_bytes=INPUT, forward_seconds=0.006),),
        profile_shape=SHAPE,
        budget_bytes=BUDGET,
        static_bytes=STATIC,
        memory_source=MEMORY_CUDA,
    )
    stats = StepStats(
        step=1,
        peak_allocated_bytes=9 * GiB,
        peak_reserved_bytes=11 * GiB,
        allocated_bytes=STATIC,
        reserved_bytes=10 * GiB,
        inactive_split_bytes=GiB,
        alloc_retries=2,
        free_bytes=60 * GiB,
        total_bytes=TOTAL,
        budget_bytes=BUDGET,
        static_bytes=STATIC,
        shape=SHAPE,
    )
    obs = observation(hello, stats)
    assert (obs.peak_reserved_bytes, obs.inactive_split_bytes, obs.free_bytes, obs.total_bytes) == (
        11 * GiB,
        GiB,
        60 * GiB,
        TOTAL,
    )
    assert obs.alloc_retries == 2 and fragmented_bytes(obs) == GiB and device_room_bytes(obs) == 70 * GiB


def test_bad_allocator_figures_are_named() -> None:
    for name in ("inactive_split_bytes", "free_bytes", "total_bytes", "peak_reserved_bytes"):
        with pytest.raises(ValueError, match=name):
            step(GiB, **{name: -1})


def test_jitter_in_the_figures_within_a_grain_keeps_the_same_capacity() -> None:
    grain = BUDGET // GRAIN
    base = dataclasses.replace(
        clean(10 * GiB), inactive_split_bytes=5 * grain + 1, peak_reserved_bytes=14 * GiB, alloc_retries=1
    )
    jittered = [
        dataclasses.replace(base, inactive_split_bytes=5 * grain + d) for d in (1, grain // 3, grain - 1, grain)
    ]
    assert {usable_bytes(o) for o in jittered} == {BUDGET - 6 * grain}, "the planner's target, and caches, hold"
    assert usable_bytes(dataclasses.replace(base, inactive_split_bytes=6 * grain + 1)) == BUDGET - 7 * grain


def test_an_idle_cache_does_not_ratchet_the_plan_tighter() -> None:
    """After a spike the allocator keeps its reserve: a tighter plan leaves more of it idle, and split. With
    room on the device that costs no allocation anything, so it must not tighten the plan again and again."""
    s = PlannerSession(profile(), budget_bytes=BUDGET, static_bytes=STATIC)
    first = s.plan.predicted_peak_bytes
    reserved = BUDGET + 2 * GiB  # what a spike left reserved
    planned = []
    for i in range(1, 13):
        peak = s.plan.predicted_peak_bytes
        planned.append(peak)
        obs = dataclasses.replace(
            clean(peak),
            step=i,
            plan_version=s.plan.version,
            reserved_bytes=reserved,
            peak_reserved_bytes=reserved,
            inactive_split_bytes=(reserved - peak) // 2,
            free_bytes=TOTAL - reserved - 2 * GiB,
        )
        s.observe(obs)
    # (Peaks that settle on the model may loosen it, under the smaller margin they earn.)
    assert min(planned) >= first and s.capacity_bytes == BUDGET, "no capacity lost, the plan never tighter"
