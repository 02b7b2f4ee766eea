"""The checkpoint's own work around a region: measured once per process on the CPU, carried in the profile as a
share of each checkpointing mode's price, and left out of what the measured scales and the shape move."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from rematd.client.blocks import region_cost as region_cost_module
from rematd.client.blocks.region_cost import RegionCost, region_cost
from rematd.planner import (
    BlockCost,
    ControllerConfig,
    Mode,
    ModeCost,
    ModeSeconds,
    Profile,
    Shape,
    Size,
    StepObservation,
)
from rematd.planner.learned import Learned
from rematd.planner.shapes import at_shape
from rematd.planner.timing import MIN_BLOCKS

REF = Shape(batch=2, seq_len=64, tokens=128)
RECOMPUTE, FIXED = 0.010, 0.004
"""A block's price of recomputing it, and of that the checkpoint's own work."""


def profile(fixed: float = FIXED) -> Profile:
    modes = (
        ModeCost(mode=Mode.STORE, kept=Size.linear(1000)),
        ModeCost(
            mode=Mode.RECOMPUTE,
            kept=Size.linear(100),
            transient=Size.linear(1000),
            extra_seconds=RECOMPUTE,
            fixed_seconds=fixed,
        ),
    )
    block = BlockCost(saved_bytes=1000, input_bytes=100, forward_seconds=RECOMPUTE - fixed, modes=modes)
    return Profile(blocks=(block,) * 4, shape=REF)


def seconds(at: object, mode: Mode = Mode.RECOMPUTE) -> float:
    return next(o.seconds for o in at.options[0] if o.mode == mode)  # type: ignore[attr-defined]


def test_the_measured_cost_is_positive_and_grows_with_the_tensors_a_region_saves() -> None:
    cost = region_cost()
    # Each part is a difference of timings (clamped at nothing), the whole of a region saving some is not.
    assert cost.of(10) > 0, "a checkpoint on the CPU costs something"
    assert cost.of(40) >= cost.of(10) >= cost.of(10, backward_only=True) >= 0
    assert 0 <= cost.forward_share <= 1
    assert RegionCost(0.001, 0.0001).of(10) == pytest.approx(0.002)
    assert RegionCost(0.001, 0.0001, forward_share=0.25).of(10, backward_only=True) == pytest.approx(0.0015)
    assert RegionCost(0.001, 0.0001).of(-3) == 0.001, "a count below nothing is nothing"


def test_measuring_it_leaves_the_training_threads_hooks_and_random_stream_alone() -> None:
    seen: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    state = torch.get_rng_state()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        measured = region_cost.__wrapped__()
    assert measured.of(10) > 0
    assert seen == [], "its own thread: the caller's saved-tensor hooks never see its tensors"
    assert torch.equal(torch.get_rng_state(), state), "it neither draws from nor restores the global random stream"


def test_a_measurement_out_of_time_stops_and_prices_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(region_cost_module._Stopped):
        region_cost_module._measure(stop)
    monkeypatch.setattr(region_cost_module, "TIMEOUT", 0.0)
    assert region_cost.__wrapped__() == RegionCost(), "no time to measure: no region cost"


def test_the_fixed_share_moves_with_neither_the_shape_nor_the_measured_scales() -> None:
    p = profile()
    assert seconds(at_shape(p, None)) == pytest.approx(RECOMPUTE)
    # Twice the tokens: the stored bytes, and so the ops' time, double; the checkpoint's own work does not.
    double = Shape(batch=2, seq_len=128, tokens=256)
    assert seconds(at_shape(p, double)) == pytest.approx(2 * (RECOMPUTE - FIXED) + FIXED)
    # Rematerialisations measured three times their price: the ops' time triples, the fixed share stays.
    scaled = at_shape(p, None, scales=((Mode.RECOMPUTE, 3.0),))
    assert seconds(scaled) == pytest.approx(3 * (RECOMPUTE - FIXED) + FIXED)
    # Without a fixed share, the whole price scales (as every profile before it did).
    bare = at_shape(profile(fixed=0.0), None, scales=((Mode.RECOMPUTE, 3.0),))
    assert seconds(bare) == pytest.approx(3 * RECOMPUTE)


def test_a_rematerialisation_timed_at_its_ops_price_leaves_the_scale_at_one() -> None:
    """The steps time the region's rerun, not the checkpoint's work around it: compared with the whole price,
    a rerun timed exactly as profiled would read as cheaper than its price, and lower the scale."""
    p = profile()
    learned = Learned(config=ControllerConfig(), batch=2, seqs={64})
    blocks = len(p.blocks)
    rerun = RECOMPUTE - FIXED
    for step in range(MIN_BLOCKS):
        timed = (ModeSeconds(Mode.RECOMPUTE, blocks, blocks * rerun, forward_seconds=blocks * rerun),)
        obs = StepObservation(step=step, peak_bytes=1, budget_bytes=10, shape=REF, mode_seconds=timed)
        learned.learn_seconds(p, obs, (Mode.RECOMPUTE,) * blocks)
    assert dict(learned.timing.scales_at(64)).get(Mode.RECOMPUTE, 1.0) == 1.0


def test_a_fixed_share_above_the_price_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"recompute\.fixed_seconds .* must not exceed recompute\.extra_seconds"):
        ModeCost(mode=Mode.RECOMPUTE, kept=Size.linear(1), extra_seconds=0.001, fixed_seconds=0.002)
    with pytest.raises(ValueError, match=r"recompute\.fixed_seconds"):
        ModeCost(mode=Mode.RECOMPUTE, kept=Size.linear(1), extra_seconds=0.001, fixed_seconds=-1.0)
    ok = ModeCost(mode=Mode.RECOMPUTE, kept=Size.linear(1), extra_seconds=0.001, fixed_seconds=0.001)
    assert dataclasses.replace(ok, fixed_seconds=0.0).fixed_seconds == 0.0
