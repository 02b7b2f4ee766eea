from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rematd.planner import (
    BlockCost,
    ControllerConfig,
    PlannerSession,
    Profile,
    Shape,
    StepObservation,
    every_k_blocks,
    frequency_of,
    predict_peak_bytes,
    solve_min_recompute,
)


def uniform(n: int, saved: int = 100, kept: int = 10) -> Profile:
    return Profile(
        blocks=tuple(BlockCost(saved_bytes=saved, input_bytes=kept, forward_seconds=0.01) for _ in range(n)),
        shape=Shape(batch=1, seq_len=64, tokens=64),
    )


profiles = st.lists(
    st.builds(
        lambda a, x, t: BlockCost(saved_bytes=a, input_bytes=min(x, a), forward_seconds=t),
        st.integers(0, 10_000),
        st.integers(0, 2_000),
        st.floats(0.0, 1.0),
    ),
    min_size=1,
    max_size=10,
).map(lambda blocks: Profile(blocks=tuple(blocks)))


def test_every_k_and_frequency_round_trip() -> None:
    assert every_k_blocks(8, 0) == ()
    assert every_k_blocks(8, 1) == tuple(range(8))
    assert every_k_blocks(8, 3) == (0, 3, 6)
    for k in range(1, 9):
        assert frequency_of(8, every_k_blocks(8, k)) == k
    assert frequency_of(8, (1, 2)) == 0
    with pytest.raises(ValueError, match="checkpoint_every"):
        every_k_blocks(8, -1)


def test_peak_counts_stored_kept_and_transient() -> None:
    p = uniform(4)
    assert predict_peak_bytes(p, frozenset()) == 400
    # two stored (200) + two kept inputs (20) + one block rematerialised (100)
    assert predict_peak_bytes(p, frozenset({0, 2}), static_bytes=5) == 5 + 200 + 20 + 100


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="saved_bytes"):
        BlockCost(saved_bytes=-1, input_bytes=0, forward_seconds=0.0)
    with pytest.raises(ValueError, match="forward_seconds"):
        BlockCost(saved_bytes=1, input_bytes=0, forward_seconds=float("nan"))
    with pytest.raises(ValueError, match="margin_ratio"):
        ControllerConfig(margin_ratio=1.5)
    with pytest.raises(ValueError, match="budget_bytes"):
        PlannerSession(uniform(2), budget_bytes=0)


@settings(max_examples=200, deadline=None)
@given(profiles, st.integers(0, 120_000))
def test_chosen_plan_fits_whenever_some_plan_fits(profile: Profile, target: int) -> None:
    choice = solve_min_recompute(profile, target)
    n = profile.num_blocks
    feasible = [
        set(c)
        for r in range(n + 1)
        for c in itertools.combinations(range(n), r)
        if predict_peak_bytes(profile, frozenset(c)) <= target
    ]
    if feasible:
        assert choice.fits
        assert choice.predicted_peak_bytes <= target
    assert choice.predicted_peak_bytes == predict_peak_bytes(profile, frozenset(choice.blocks))


@settings(max_examples=200, deadline=None)
@given(profiles, st.integers(0, 60_000), st.integers(0, 60_000))
def test_lower_budget_never_recomputes_fewer_blocks(profile: Profile, a: int, b: int) -> None:
    low, high = sorted((a, b))
    lo = solve_min_recompute(profile, low)
    hi = solve_min_recompute(profile, high)
    if lo.fits and hi.fits:
        assert len(lo.blocks) >= len(hi.blocks)


def observe(session: PlannerSession, step: int, seq: int, peak: int, budget: int) -> object:
    return session.observe(
        StepObservation(
            step=step,
            peak_bytes=peak,
            budget_bytes=budget,
            shape=Shape(batch=1, seq_len=seq, tokens=seq),
            plan_version=session.plan.version,
        )
    )


def measured(session: PlannerSession, seq: int) -> int:
    """What a step would measure: the model's prediction less the transient it cannot see."""
    p = session.profile.scaled_to(Shape(batch=1, seq_len=seq, tokens=seq))
    blocks = session.plan.blocks
    transient = max((p.blocks[i].saved_bytes for i in blocks), default=0)
    return predict_peak_bytes(p, frozenset(blocks)) - transient


def test_tightens_at_once_and_loosens_after_dwell() -> None:
    session = PlannerSession(
        uniform(8), budget_bytes=1000, config=ControllerConfig(margin_ratio=0.1, loosen_after_steps=3)
    )
    assert session.plan.blocks == ()  # 800 bytes fit a 900-byte target
    plan = observe(session, 0, 128, measured(session, 128), 1000)  # twice the tokens: 1600 bytes
    assert plan is not None and session.plan.blocks, "a peak over the target must tighten on the same step"
    assert "tighten" in session.plan.reason
    tight = session.plan
    versions = []
    for step in range(1, 4):
        versions.append(observe(session, step, 64, measured(session, 64), 1000))
    assert versions[:2] == [None, None], "loosening must wait for the dwell"
    assert versions[2] is not None and len(session.plan.blocks) < len(tight.blocks)
    assert session.plan.version == tight.version + 1


def test_budget_cut_tightens_and_raise_loosens() -> None:
    session = PlannerSession(uniform(8), budget_bytes=1000, config=ControllerConfig(loosen_after_steps=2))
    assert observe(session, 0, 64, measured(session, 64), 500) is not None
    assert session.plan.target_bytes == 450
    assert observe(session, 1, 64, measured(session, 64), 1000) is None
    assert observe(session, 2, 64, measured(session, 64), 1000) is not None
    assert session.plan.blocks == ()


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 16), st.integers(200, 5000), st.integers(0, 5), st.integers(1, 4))
def test_no_flapping_on_steady_input(n: int, budget: int, noise: int, dwell: int) -> None:
    session = PlannerSession(uniform(n), budget_bytes=budget, config=ControllerConfig(loosen_after_steps=dwell))
    changes = []
    for step in range(40):
        plan = observe(session, step, 64, measured(session, 64) + (step % 2) * noise, budget)
        if plan is not None:
            changes.append(step)
    # On steady input the plan settles: at most one tightening and one loosening.
    assert len(changes) <= 2
    assert all(b - a > 1 for a, b in itertools.pairwise(changes))


def test_oom_tightens() -> None:
    session = PlannerSession(uniform(4), budget_bytes=10_000)
    assert session.plan.blocks == ()
    plan = session.report_oom()
    assert plan is not None and plan.blocks and "out-of-memory" in plan.reason
