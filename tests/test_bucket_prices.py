"""Mode prices per length bucket: a mode is priced at a length by what it measured there, by what it
measured over the whole job where it was not timed there often enough, and the prices survive a restart
of the planner. Fake observations only: nothing here sleeps or reads a clock."""

from __future__ import annotations

import json
import math

import pytest

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
from rematd.planner.cost import choose, peak_of
from rematd.planner.learned import Learned
from rematd.planner.solvers import Choice
from rematd.planner.timing import MAX_BUCKETS, MIN_BLOCKS, BucketTimes

from .alike_blocks import alike_blocks

S, K, R = Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE
N = 8
REF = Shape(batch=2, seq_len=64, tokens=128)
SHORT, LONG = 32, 128
FORWARD = 0.01
BUDGET = 6000


def profile() -> Profile:
    """Eight alike blocks of fixed sizes; selective is profiled at 4 ms, recomputing at 10."""
    return alike_blocks(scaled=False)


def shape(seq: int) -> Shape:
    return Shape(batch=2, seq_len=seq, tokens=2 * seq)


def selective_seconds(seq: int) -> float:
    """What selective truly adds per block: 2 ms on short steps, 30 ms on long ones."""
    return 0.002 if seq <= SHORT else 0.03


def run(session: PlannerSession, steps: int, seq: int, first: int) -> int:
    """``steps`` steps of length ``seq`` under the plan in force, from step ``first``; the next step."""
    for step in range(first, first + steps):
        modes = session.plan.modes_for(shape(seq), N)
        per_block = {S: 0.0, K: selective_seconds(seq), R: FORWARD}
        timed = tuple(
            ModeSeconds(m, modes.count(m), modes.count(m) * per_block[m], forward_seconds=modes.count(m) * FORWARD)
            for m in (S, K, R)
            if m in modes
        )
        peak = peak_of(choose(session.profile.options_at(shape(seq)), modes))
        session.observe(
            StepObservation(
                step=step,
                peak_bytes=peak,
                budget_bytes=BUDGET,
                shape=shape(seq),
                plan_version=session.plan.version,
                mode_seconds=timed,
            )
        )
    return first + steps


def trained() -> PlannerSession:
    session = PlannerSession(profile(), budget_bytes=BUDGET, config=ControllerConfig())
    step = 0
    for seq in (SHORT, LONG, SHORT, LONG, SHORT, LONG):
        step = run(session, 40, seq, step)
    return session


def test_a_mode_cheap_on_short_steps_and_dear_on_long_ones_is_planned_so_at_each_length() -> None:
    session = trained()
    timing = session.controller.timing
    short, long = dict(timing.scales_at(SHORT)), dict(timing.scales_at(LONG))
    assert short[K] == pytest.approx(0.5, rel=0.06), "2 ms against the 4 the profile says"
    assert long[K] == pytest.approx(7.5, rel=0.06), "30 ms against 4"
    assert K in timing.measured_modes_at(SHORT) and K in timing.measured_modes_at(LONG)
    at_short = session.plan.modes_for(shape(SHORT), N)
    at_long = session.plan.modes_for(shape(LONG), N)
    assert K in at_short and R not in at_short, at_short
    assert R in at_long and K not in at_long, at_long
    # Either plan fits at either length (the bytes are the same, and both lengths' peaks settled on the
    # model): the prices alone tell them apart.
    controller = session.controller
    target = controller.config.settled_target(session.plan.target_bytes)
    for seq in (SHORT, LONG):
        assert controller.learned.settled(seq)
        for modes in (at_short, at_long):
            assert peak_of(choose(session.profile.options_at(shape(seq)), modes)) <= target
    # What the plans believe: at each length, selective's time as measured there.
    assert controller.pricing.extra(at_short, SHORT) < controller.pricing.extra(at_long, SHORT)
    assert controller.pricing.extra(at_long, LONG) < controller.pricing.extra(at_short, LONG)


def test_a_length_never_timed_is_priced_by_the_whole_jobs_measurements() -> None:
    session = trained()
    timing = session.controller.timing
    assert timing.buckets == [SHORT, LONG]
    assert timing.measured_modes >= {K, R}
    for seq in (64, 90, 1000):
        assert timing.scales_at(seq) == timing.scales, seq
        assert timing.measured_modes_at(seq) == frozenset() and timing.timed_blocks(K, seq) == 0


def learned_timing() -> BucketTimes:
    return Learned(config=ControllerConfig(), batch=1, seqs=set()).timing


def test_a_bucket_takes_its_own_scale_only_from_enough_timed_blocks() -> None:
    t = learned_timing()
    # Recomputing measured twice the profile at length 32; selective timed on 2 blocks at 128, at half.
    for step in range(3):
        t.observe([ModeSeconds(R, 4, 0.08)], {R: 0.01}, seq=32, step=step)
    t.observe([ModeSeconds(K, 2, 0.01)], {K: 0.01}, seq=128, step=3)
    assert dict(t.scales_at(32))[R] == pytest.approx(2.0, rel=0.06)
    assert t.scales_at(128) == t.scales, f"fewer than {MIN_BLOCKS} blocks at 128: the pooled scales"
    assert t.measured_modes_at(128) == frozenset() and t.timed_blocks(K, 128) == 2
    # Untried anywhere: no discount, as dear as the dearest measured mode.
    assert dict(t.scales_at(128))[K] == dict(t.scales_at(128))[Mode.OFFLOAD] == dict(t.scales)[R]
    # Selective timed cheap at 32: it is measured there, and over the job (6 blocks), so 128 borrows it.
    t.observe([ModeSeconds(K, 4, 0.02)], {K: 0.01}, seq=32, step=4)
    assert dict(t.scales_at(32))[K] == pytest.approx(0.5, rel=0.06)
    assert K not in t.measured_modes_at(128) and K in t.measured_modes
    assert dict(t.scales_at(128))[K] == dict(t.scales)[K] < 1
    # Then dear at 128, often enough for its own scale there; 32 keeps its own.
    for step in range(5, 25):
        t.observe([ModeSeconds(K, 2, 0.06)], {K: 0.01}, seq=128, step=step)
    assert dict(t.scales_at(128))[K] == pytest.approx(3.0, rel=0.06)
    assert dict(t.scales_at(32))[K] == pytest.approx(0.5, rel=0.06)
    assert t.timed_blocks(K, 128) == 42 and t.timed_blocks(K) == 46
    assert t.last_timed(K, 128) == 24 and t.last_timed(K, 32) == 4 and t.last_timed(R, 128) is None
    assert t.last_timed(R) == 2 and t.last_timed(Mode.OFFLOAD) is None


def test_at_most_so_many_buckets_are_kept_the_least_recently_timed_dropped() -> None:
    t = learned_timing()
    lengths = [t.bucket_of(9 * 2**k) for k in range(MAX_BUCKETS + 2)]
    assert len(set(lengths)) == len(lengths)
    for step, seq in enumerate(lengths):
        t.observe([ModeSeconds(R, 4, 0.08)], {R: 0.01}, seq=seq, step=step)
        if step == 3:
            # The first length timed again: now the second and third are the least recently timed.
            t.observe([ModeSeconds(R, 4, 0.08)], {R: 0.01}, seq=lengths[0], step=step)
    assert len(t.buckets) == MAX_BUCKETS
    assert lengths[0] in t.buckets and lengths[1] not in t.buckets and lengths[2] not in t.buckets
    assert t.scales_at(lengths[1]) == t.scales, "a dropped bucket is priced by the pooled scales"


def test_bucket_prices_survive_a_restart_of_the_planner() -> None:
    session = trained()
    state = json.loads(json.dumps(session.controller.export_state()))
    assert [top for top, _ in state["timing"]["buckets"]] == [SHORT, LONG], "least recently timed first"
    fresh = Controller(session.profile, ControllerConfig())
    fresh.restore_state(state)
    for seq in (SHORT, LONG, 64):
        assert fresh.timing.scales_at(seq) == session.controller.timing.scales_at(seq)
        assert fresh.timing.measured_modes_at(seq) == session.controller.timing.measured_modes_at(seq)
        assert fresh.timing.last_timed(K, seq) == session.controller.timing.last_timed(K, seq)
    assert fresh.export_state() == state


def test_a_state_saved_before_bucket_prices_restores_the_pooled_ones() -> None:
    session = trained()
    state = json.loads(json.dumps(session.controller.export_state()))
    old = {k: v for k, v in state["timing"].items() if k not in ("buckets", "last_step")}
    fresh = Controller(session.profile, ControllerConfig())
    fresh.restore_state({**state, "timing": old})
    timing = fresh.timing
    assert timing.buckets == [] and timing.scales == session.controller.timing.scales
    assert timing.scales_at(SHORT) == timing.scales_at(LONG) == timing.scales
    assert timing.last_timed(K) is None and timing.timed_blocks(K) == session.controller.timing.timed_blocks(K)


def _bucket(**changes: object) -> list[object]:
    sums = {"remat": {"recompute": 0.1}, "forward": {"recompute": 0.0}, "forward_profiled": {"recompute": 0.0}}
    sums |= {"predicted": {"recompute": 0.1}, "blocks": {"recompute": 8}, "last_step": {"recompute": 3}}
    return [128, {**sums, "base": [0.0, 0.0], **changes}]


@pytest.mark.parametrize(
    ("buckets", "named"),
    [
        (5, r"timing\.buckets"),
        ([_bucket()] * 2, r"timing\.buckets.*repeated"),
        ([[0, _bucket()[1]]], r"timing\.buckets"),
        ([[True, _bucket()[1]]], r"timing\.buckets"),
        ([[128]], r"timing\.buckets"),
        ([[2**k, _bucket()[1]] for k in range(1, MAX_BUCKETS + 2)], r"timing\.buckets"),
        ([_bucket(remat={"recompute": math.nan})], r"timing\.buckets\[128\]\.remat\.recompute"),
        ([_bucket(remat={"teleport": 1.0})], r"timing\.buckets\[128\]\.remat"),
        ([_bucket(blocks={"selective": 4})], r"timing\.buckets\[128\]'s sums"),
        ([_bucket(last_step={"recompute": -1})], r"timing\.buckets\[128\]\.last_step\.recompute"),
        ([_bucket(last_step={"recompute": 2.5})], r"timing\.buckets\[128\]\.last_step\.recompute"),
        ([_bucket(last_step={"selective": 2})], r"timing\.buckets\[128\]\.last_step"),
        ([_bucket(base=[1.0])], r"timing\.buckets\[128\]\.base"),
        ([[128, "fast"]], r"timing\.buckets\[128\]"),
    ],
)
def test_a_malformed_bucket_price_is_refused_naming_it_and_changes_nothing(buckets: object, named: str) -> None:
    session = trained()
    state = json.loads(json.dumps(session.controller.export_state()))
    fresh = Controller(session.profile, ControllerConfig())
    fresh.restore_state(state)
    before = fresh.export_state()
    with pytest.raises(ValueError, match=named):
        fresh.restore_state({**state, "timing": {**state["timing"], "buckets": buckets}})
    assert fresh.export_state() == before, "a refused state changes nothing"
    # A well-formed bucket restores.
    fresh.restore_state({**state, "timing": {**state["timing"], "buckets": [_bucket()]}})
    assert fresh.timing.buckets == [128] and fresh.timing.last_timed(R, 128) == 3


def test_how_sure_each_price_is_per_length_bucket() -> None:
    session = trained()
    by_mode = {p["mode"]: p for p in session.prices()}
    selective = by_mode["selective"]
    assert selective["state"] == "measured"
    buckets = selective["buckets"]
    assert isinstance(buckets, list)
    short, long = buckets
    assert short["max_seq_len"] == SHORT and long["max_seq_len"] == LONG
    assert short["state"] == long["state"] == "measured"
    assert short["scale"] == pytest.approx(0.5, rel=0.06) and long["scale"] == pytest.approx(7.5, rel=0.06)
    assert isinstance(long["timed_blocks"], int) and long["timed_blocks"] >= MIN_BLOCKS
    assert isinstance(short["last_step"], int) and isinstance(long["last_step"], int)
    assert long["last_step"] < short["last_step"], "selective has not run on long steps since it measured dear"


def test_a_length_never_timed_is_repriced_now_and_then_and_refit_to_a_new_budget_at_once() -> None:
    """The table holds plans for lengths the job has not run yet, priced by the scales pooled over every
    length: those move with each step's timings, and re-solving every such length on every move cost the
    training thread milliseconds a step. They are re-priced every ``REPRICE_LOOKS`` looks; what decides
    whether they fit (budget, measured peaks) is re-checked at every look."""
    session = PlannerSession(profile(), budget_bytes=BUDGET, config=ControllerConfig())
    controller = session.controller
    untimed = max(controller.learned.ladder())
    priced: list[int] = []
    choose_at = controller.planner.choose

    def counted(at: Shape, target: int, static: int) -> Choice:
        if at.seq_len == untimed:
            priced.append(len(priced))
        return choose_at(at, target, static)

    controller.planner.choose = counted  # type: ignore[method-assign]
    budget = BUDGET
    for step in range(64):
        if step == 48:
            budget = BUDGET // 2
            before, priced[:] = session.plan.modes_for(shape(untimed), N), []
        modes = session.plan.modes_for(shape(SHORT), N)
        # Recomputing measured at one then three times its profiled seconds, turn about: the pooled scales
        # move by whole powers every step.
        scale = 1.0 if step % 2 else 3.0
        timed = (ModeSeconds(R, modes.count(R), modes.count(R) * FORWARD * scale),) if R in modes else ()
        session.observe(
            StepObservation(
                step=step,
                peak_bytes=peak_of(choose(session.profile.options_at(shape(SHORT)), modes)),
                budget_bytes=budget,
                shape=shape(SHORT),
                plan_version=session.plan.version,
                mode_seconds=timed,
            )
        )
        if step == 47:
            assert untimed not in controller.timing.buckets
            # Once per 16 looks, and where a measured peak moved the correction (the first steps).
            assert len(priced) <= 8, f"re-priced {len(priced)} times in 48 steps"
    after = session.plan.modes_for(shape(untimed), N)
    assert priced, "a new budget re-solves the lengths never timed at once"
    assert after.count(S) < before.count(S), (before, after)
    target = controller.config.target_bytes(budget)
    assert peak_of(choose(session.profile.options_at(shape(untimed)), after)) <= target


def test_a_capped_ladder_drops_its_shortest_rungs_and_still_reaches_past_the_longest_length_seen() -> None:
    learned = Learned(config=ControllerConfig(), batch=2, seqs={8, 2048})
    ladder = learned.ladder()
    assert len(ladder) == ControllerConfig().max_entries
    assert max(ladder) >= 4 * 2048, "a step 4 times the longest seen is planned for"
    assert min(ladder) > 8, "the shortest lengths run the shortest rung's plan, made for more activations"
    learned.seqs = {16, 256}
    assert min(learned.ladder()) == 16 and max(learned.ladder()) >= 1024, "uncapped: from the shortest up"


def test_the_longest_length_the_wire_carries_gets_a_table_the_wire_carries() -> None:
    from rematd import wire
    from rematd.planner.learned import MAX_SEQ_LEN

    session = PlannerSession(profile(), budget_bytes=BUDGET, config=ControllerConfig())
    for step, seq in enumerate((SHORT, MAX_SEQ_LEN)):
        session.observe(
            StepObservation(step=step, peak_bytes=BUDGET // 2, budget_bytes=BUDGET, shape=shape(seq), plan_version=1)
        )
    table = session.plan.shape_plans
    assert table and max(e.max_seq_len for e in table) == MAX_SEQ_LEN, table
    assert wire.plan_from_pb(wire.plan_to_pb(session.plan)) == session.plan
