"""What modes really cost: rematerialisations timed in backward, and a planner that believes them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rematd import client, wire
from rematd.planner import (
    Controller,
    ControllerConfig,
    Mode,
    ModeSeconds,
    PlannerSession,
    Profile,
    Shape,
    StepObservation,
)
from rematd.planner.messages import InvalidMessage, StepStats
from rematd.planner.timing import HOLD, MIN_BLOCKS, STEP, TimeScales, scales_of

from .alike_blocks import alike_blocks
from .helpers import tiny_model, train_step

REF = Shape(batch=2, seq_len=64, tokens=128)


def test_scales_follow_measurements_once_there_are_enough() -> None:
    t = TimeScales()
    t.observe([ModeSeconds(Mode.RECOMPUTE, 2, 0.04)], {Mode.RECOMPUTE: 0.01})
    assert t.scales == (), f"fewer than {MIN_BLOCKS} blocks timed: the profile stands"
    for _ in range(5):
        t.observe([ModeSeconds(Mode.RECOMPUTE, 2, 0.04)], {Mode.RECOMPUTE: 0.01})
    scales = dict(t.scales)
    assert scales[Mode.RECOMPUTE] == pytest.approx(2.0, rel=0.05)
    assert t.measured_modes == {Mode.RECOMPUTE}
    t.observe([ModeSeconds(Mode.SELECTIVE, 8, 1e9)], {Mode.SELECTIVE: 0.01})
    assert dict(t.scales)[Mode.SELECTIVE] == pytest.approx(10.0, rel=0.05), "far-off measurements are capped"


def test_an_untried_mode_never_gets_a_discount_and_shares_the_worst_surcharge() -> None:
    t = TimeScales()
    for _ in range(3):
        t.observe([ModeSeconds(Mode.SELECTIVE, 4, 0.02)], {Mode.SELECTIVE: 0.01})  # half the profile's
    scales = dict(t.scales)
    assert scales[Mode.SELECTIVE] == pytest.approx(0.5, rel=0.05)
    assert Mode.RECOMPUTE not in scales and Mode.OFFLOAD not in scales, "untried: the profile's price, no discount"
    for _ in range(30):
        t.observe([ModeSeconds(Mode.RECOMPUTE, 4, 0.12)], {Mode.RECOMPUTE: 0.01})  # tried: dearer
    scales = dict(t.scales)
    assert scales[Mode.RECOMPUTE] > 2 and scales[Mode.SELECTIVE] == pytest.approx(0.5, rel=0.05)
    assert scales[Mode.OFFLOAD] == scales[Mode.RECOMPUTE], "untried: as dear as the dearest tried mode"


def test_forward_costs_count_against_the_stored_blocks_forward() -> None:
    t = TimeScales()
    for _ in range(3):
        t.observe(
            [
                # Stored blocks' forward: 10 ms each. Selective's: 16 ms each, and 4 ms to rematerialise.
                ModeSeconds(Mode.STORE, 4, 0.0, 0.040),
                ModeSeconds(Mode.SELECTIVE, 4, 0.016, 0.064),
            ],
            {Mode.SELECTIVE: 0.005},
            forward_per_block=0.01,
        )
    assert dict(t.scales)[Mode.SELECTIVE] == pytest.approx(2.0, rel=0.05), "(6 + 4) ms a block, against 5"
    # With no stored block in the step, the baseline carries over from the steps that had one.
    for _ in range(30):
        t.observe([ModeSeconds(Mode.SELECTIVE, 8, 0.032, 0.128)], {Mode.SELECTIVE: 0.005}, forward_per_block=0.01)
    assert dict(t.scales)[Mode.SELECTIVE] == pytest.approx(2.0, rel=0.05)


def _profile() -> Profile:
    # Selective: cheaper by the profile (5 ms for 600 of 1000 bytes freed, against 10 ms for 900).
    return alike_blocks(selective=0.005)


def _run(session: PlannerSession, steps: int, selective_s: float, first: int = 0) -> list[int]:
    changed = []
    for step in range(first, first + steps):
        modes = session.plan.modes_for(REF, 8)
        timed = [
            ModeSeconds(m, modes.count(m), modes.count(m) * (selective_s if m == Mode.SELECTIVE else 0.01))
            for m in (Mode.SELECTIVE, Mode.RECOMPUTE)
            if m in modes
        ]
        kept = sum(400 if m == Mode.SELECTIVE else 100 if m == Mode.RECOMPUTE else 1000 for m in modes)
        plan = session.observe(
            StepObservation(
                step=step, peak_bytes=kept, budget_bytes=6000, shape=REF, plan_version=session.plan.version,
                mode_seconds=tuple(timed),
            )
        )  # fmt: skip
        if plan is not None:
            changed.append(step)
    return changed


def test_a_mode_is_priced_by_its_profile_then_by_what_it_measures() -> None:
    # No trials here (tests/test_explore.py has them): a mode is measured only when a plan runs it.
    config = ControllerConfig(loosen_after_steps=2, explore_share=0.0)
    session = PlannerSession(_profile(), budget_bytes=6000, config=config)
    assert Mode.SELECTIVE in session.plan.modes, "priced by its profile (5 ms against 10), selective is planned"
    _run(session, 10, 0.005)
    assert Mode.SELECTIVE in session.plan.modes, "measured as the profile said: it stays"
    timing = session.controller.timing
    assert Mode.SELECTIVE in timing.measured_modes
    cheap = dict(timing.scales_at(REF.seq_len)).get(Mode.SELECTIVE, 1.0)
    # Then it measures 20 ms: the plan gives it up for recomputation as soon as its price says so, and
    # with no step running it, no measurement lowers that price again: it is never chosen again.
    changed = _run(session, 40, 0.02, first=10)
    assert Mode.SELECTIVE not in session.plan.modes, "dominated by recomputation"
    assert dict(timing.scales_at(REF.seq_len)).get(Mode.SELECTIVE, 1.0) > cheap, "priced higher than it was"
    assert len(changed) <= 2, f"it settles: {changed}"


@pytest.mark.parametrize("mode", [Mode.SELECTIVE, Mode.RECOMPUTE], ids=lambda m: m.name.lower())
def test_the_handle_reports_how_long_rematerialisation_took(mode: Mode) -> None:
    model = tiny_model(n_layer=4, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=10**12)
    train_step(model, opt, 32)  # the profiling step
    h.pin_modes([mode] * 4)
    train_step(model, opt, 32, seed=1)  # the pinned modes apply from this step
    train_step(model, opt, 32, seed=2)
    assert h.last_stats is not None
    ((timed,),) = (h.last_stats.mode_seconds,)
    assert timed.mode == mode and timed.blocks == 4 and 0 < timed.seconds < 10 and 0 < timed.forward_seconds < 10
    h.pin_modes([Mode.STORE] * 4)
    train_step(model, opt, 32, seed=3)
    train_step(model, opt, 32, seed=4)
    assert h.last_stats is not None
    ((stored,),) = (h.last_stats.mode_seconds,)
    assert stored.mode == Mode.STORE and stored.blocks == 4, "stored blocks' forward: the baseline"
    assert stored.seconds == 0 and stored.forward_seconds > 0, "nothing rematerialised"
    h.close()


def test_mode_seconds_cross_the_wire_and_bad_ones_are_named() -> None:
    stats = StepStats(step=3, budget_bytes=10, mode_seconds=(ModeSeconds(Mode.RECOMPUTE, 4, 0.25, 0.5),))
    assert wire.stats_from_pb(wire.stats_to_pb(stats)) == stats
    msg = wire.stats_to_pb(stats)
    msg.mode_seconds[0].seconds = math.nan
    with pytest.raises(InvalidMessage, match=r"stats\.mode_seconds\[0\]\.seconds"):
        wire.stats_from_pb(msg)
    msg.mode_seconds[0].seconds = 0.1
    msg.mode_seconds[0].forward_seconds = -1.0
    with pytest.raises(InvalidMessage, match=r"stats\.mode_seconds\[0\]\.forward_seconds"):
        wire.stats_from_pb(msg)
    msg.mode_seconds[0].forward_seconds = 0.1
    msg.mode_seconds[0].mode = 0
    with pytest.raises(InvalidMessage, match=r"stats\.mode_seconds\[0\]\.mode"):
        wire.stats_from_pb(msg)


def test_a_mode_whose_forward_cannot_yet_be_compared_counts_as_unmeasured() -> None:
    t = TimeScales()
    for _ in range(3):  # every block selective: no plain forward to compare its forward with
        t.observe([ModeSeconds(Mode.SELECTIVE, 8, 0.008, 0.2)], {Mode.SELECTIVE: 0.005}, forward_per_block=0.01)
    assert Mode.SELECTIVE not in t.measured_modes and t.scales == ()
    # A step with stored blocks shows a plain forward (10 ms): selective's earlier steps now price at
    # (25 - 10) + 1 ms a block, against 5.
    t.observe([ModeSeconds(Mode.STORE, 8, 0.0, 0.08)], {}, forward_per_block=0.01)
    assert dict(t.scales)[Mode.SELECTIVE] == pytest.approx(16 / 5, rel=0.06)


def _learnt_controller() -> tuple[PlannerSession, Profile]:
    session = PlannerSession(_profile(), budget_bytes=10**12)
    # Recomputing measured at 50 ms a block where the profile says 10.
    session.controller.timing.observe([ModeSeconds(Mode.RECOMPUTE, 8, 0.4)], {Mode.RECOMPUTE: 0.01})
    return session, session.controller.profile


def test_measured_prices_survive_a_restart_of_the_planner() -> None:
    session, profile = _learnt_controller()
    learnt = session.controller.timing.scales
    assert learnt and dict(learnt)[Mode.RECOMPUTE] > 1, "recompute measured dearer than profiled"
    state = json.loads(json.dumps(session.controller.export_state()))
    fresh = Controller(profile, ControllerConfig())
    assert fresh.timing.scales == ()
    fresh.restore_state(state)
    assert fresh.timing.scales == learnt
    assert fresh.timing.measured_modes == session.controller.timing.measured_modes
    assert fresh.export_state() == state


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("last_loosen_step", math.inf),
        ("last_loosen_step", math.nan),
        ("last_loosen_step", 10**400),
        ("headroom_steps", 10**30),
        ("dwell", math.inf),
        ("batch", -math.inf),
        ("buckets", 5),
        ("timing", {"remat": {"recompute": math.inf}}),
        ("timing", {"remat": {"recompute": math.nan}}),
        ("timing", {"remat": {"recompute": 1e300}}),
        ("timing", {"remat": {"teleport": 1.0}}),
        ("timing", {"base": [1.0]}),
        ("timing", "fast"),
    ],
)
def test_a_malformed_planner_state_is_a_value_error_naming_the_field(field: str, value: object) -> None:
    session, profile = _learnt_controller()
    state = session.controller.export_state()
    fresh = Controller(profile, ControllerConfig())
    before = fresh.export_state()
    with pytest.raises(ValueError, match=field):
        fresh.restore_state({**state, field: value})
    assert fresh.export_state() == before, "a refused state changes nothing"


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e309, 10**400])
def test_a_bucket_with_a_number_out_of_range_is_refused(value: object) -> None:
    session, profile = _learnt_controller()
    state = session.controller.export_state()
    fresh = Controller(profile, ControllerConfig())
    with pytest.raises(ValueError, match="boost"):
        fresh.restore_state({**state, "buckets": [[128, [1.0], value, 1.0, 0, None]]})


def test_a_scale_holds_its_power_until_the_ratio_is_well_past_the_edge() -> None:
    levels: dict[Mode, int] = {}
    at = scales_of({Mode.RECOMPUTE: STEP**2.4}, levels)
    assert dict(at)[Mode.RECOMPUTE] == pytest.approx(STEP**2)
    # Past the rounding edge (2.5) but within HOLD of the power in force: the price stays.
    wobble = scales_of({Mode.RECOMPUTE: STEP ** (2 + HOLD - 0.05)}, levels)
    assert wobble == at
    assert scales_of({Mode.RECOMPUTE: STEP ** (2 + HOLD - 0.05)}) != at, "plain rounding moves it"
    moved = scales_of({Mode.RECOMPUTE: STEP ** (2 + HOLD + 0.05)}, levels)
    assert dict(moved)[Mode.RECOMPUTE] == pytest.approx(STEP**3)
    assert scales_of({Mode.RECOMPUTE: STEP**2.4}, levels) == moved, "and holds the new power the same way"


def test_wobbling_measurements_move_the_prices_only_when_they_move_far() -> None:
    """A ratio that wobbles around the edge between two powers flipped every price, and re-solved every plan,
    each time it crossed; held, it changes the scales only where it moves a whole power or more."""
    t = TimeScales()
    changes = 0
    before = t.scales
    for i in range(60):
        # Measured/profiled alternates around 1.1**2.5, the edge between two powers.
        ratio = STEP ** (2.5 + (0.2 if i % 2 else -0.2))
        t.observe([ModeSeconds(Mode.RECOMPUTE, 8, 8 * 0.01 * ratio)], {Mode.RECOMPUTE: 0.01})
        changes += t.scales != before
        before = t.scales
    assert changes <= 2, f"the scales changed {changes} times on a wobble"


def test_restored_scales_are_the_plain_rounding_of_the_restored_sums() -> None:
    t = TimeScales()
    for ratio in (STEP**2.3, *(STEP**2.7,) * 3):
        t.observe([ModeSeconds(Mode.RECOMPUTE, 8, 8 * 0.01 * ratio)], {Mode.RECOMPUTE: 0.01})
    again = TimeScales()
    again.restore_state(json.loads(json.dumps(t.export_state())))
    assert again.ratios == pytest.approx(t.ratios)
    assert again.scales == scales_of(t.ratios)


def test_a_stall_in_one_step_moves_a_price_little_and_a_lasting_change_is_followed() -> None:
    t = TimeScales()
    for _ in range(20):  # half the profile's price
        t.observe([ModeSeconds(Mode.SELECTIVE, 4, 0.02)], {Mode.SELECTIVE: 0.01})
    # One step stalled (a collection, another job's burst): 25 times what the mode takes.
    t.observe([ModeSeconds(Mode.SELECTIVE, 4, 0.5)], {Mode.SELECTIVE: 0.01})
    assert t.ratios[Mode.SELECTIVE] < 0.6, "counted at twice what the running ratio expects, not 25 times"
    for _ in range(40):  # the mode now costs what the profile says, step after step
        t.observe([ModeSeconds(Mode.SELECTIVE, 4, 0.04)], {Mode.SELECTIVE: 0.01})
    assert t.ratios[Mode.SELECTIVE] == pytest.approx(1.0, rel=0.05)


def test_a_stall_in_the_stored_blocks_forward_leaves_the_other_prices_alone() -> None:
    t = TimeScales()

    def step(store_forward: float) -> None:
        t.observe(
            [
                # Stored blocks' forward: 10 ms each. Selective's: 14 ms each, and 4 ms to rematerialise; an MLP
                # part's forward as a stored block's, and 2 ms to rematerialise.
                ModeSeconds(Mode.STORE, 4, 0.0, store_forward),
                ModeSeconds(Mode.SELECTIVE, 4, 0.016, 0.056),
                ModeSeconds(Mode.MLP, 4, 0.008, 0.041),
            ],
            {Mode.SELECTIVE: 0.008, Mode.MLP: 0.004},
            forward_per_block=0.01,
        )

    for _ in range(20):
        step(0.040)
    before = dict(t.ratios)
    assert before[Mode.SELECTIVE] == pytest.approx(1.0, rel=0.02), "(4 + 4) ms a block, against 8"
    assert before[Mode.MLP] == pytest.approx(0.5, rel=0.02), "its rematerialisation alone: 2 ms, against 4"
    step(0.400)  # one stored forward stalled 10 times over
    after = dict(t.ratios)
    # Counted as 20 ms a block, it makes the plain forward 11 ms for a while: selective's forward excess
    # shrinks by that, and the MLP part, priced by its own rematerialisation, does not move.
    assert after[Mode.SELECTIVE] > 0.8 * before[Mode.SELECTIVE]
    assert after[Mode.MLP] == pytest.approx(before[Mode.MLP], rel=0.01)
