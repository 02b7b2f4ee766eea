"""The prepared knapsack: bounds that hold, a cap search that finds what scanning every cap finds,
and plans that fit whenever one can."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rematd.planner import BlockCost, Mode, Option, Profile, letters, peak_of
from rematd.planner.cost import bound_of, choose
from rematd.planner.knapsack import INF, Knapsack
from rematd.planner.runs import RUN, Runs
from rematd.planner.shapes import at_shape
from rematd.planner.solvers import solve

from .test_planner import REF, four_modes


def block(saved: int, sel: int, x: int, t: float, off: float) -> BlockCost:
    """A block with the four modes, its selective and recomputed costs drawn independently."""
    return four_modes(saved, min(saved, max(sel, x)), min(x, saved), t, off)


blocks_st = st.builds(
    block,
    st.integers(1, 5_000),
    st.integers(0, 5_000),
    st.integers(0, 1_000),
    st.floats(0.0, 1.0),
    st.floats(0.0, 2.0),
)


def every_cap(knapsack: Knapsack, budget: int) -> float:
    """The rounded greedy with every cap scanned: what the cap search has to find."""
    return min((knapsack.greedy(j, budget - knapsack.caps[j]) for j in knapsack.feasible(budget)), default=INF)


def least_peak_by_brute_force(options: list[list[Option]]) -> int:
    return min(bound_of(combo) for combo in itertools.product(*options))


@settings(max_examples=100, deadline=None)
@given(st.lists(blocks_st, min_size=1, max_size=5), st.floats(0.0, 1.0))
def test_least_peak_is_the_least_of_any_choice(blocks: list[BlockCost], _: float) -> None:
    options = Profile(blocks=tuple(blocks), shape=REF).options_at()
    knapsack = Knapsack(options)
    least, j = knapsack.least_peak()
    assert least == least_peak_by_brute_force(options)
    chosen = [next(o for o in opts if o.mode == m) for opts, m in zip(options, knapsack.leanest(j), strict=True)]
    assert bound_of(chosen) == least


@settings(max_examples=60, deadline=None)
@given(st.lists(blocks_st, min_size=8, max_size=60), st.floats(0.05, 1.0))
def test_bound_never_exceeds_any_plan_and_plans_fit_when_one_can(blocks: list[BlockCost], frac: float) -> None:
    options = Profile(blocks=tuple(blocks), shape=REF).options_at()
    knapsack = Knapsack(options)
    budget = int(sum(b.saved_bytes for b in blocks) * frac)
    found = knapsack.solve(budget)
    if knapsack.least_peak()[0] > budget:
        assert found is None
        return
    assert found is not None
    chosen = [next(o for o in opts if o.mode == m) for opts, m in zip(options, found.modes, strict=True)]
    # The knapsack's bound holds every kept byte and the largest rematerialisation at once: never below
    # the peak in backward order.
    assert peak_of(chosen) <= bound_of(chosen) <= budget
    assert found.kept + found.transient == bound_of(chosen)
    assert knapsack.bound(budget) <= found.seconds + 1e-9
    # Every cap: the bound holds below the rounded greedy there too.
    for j in knapsack.feasible(budget):
        cap = knapsack.caps[j]
        assert cap <= budget
        assert knapsack.bound(budget - cap) <= knapsack.greedy(j, budget - cap) + 1e-9


def test_cap_search_finds_what_scanning_every_cap_finds() -> None:
    """Blocks all unlike (hundreds of distinct caps): the search scans a few dozen of them."""
    ratios = []
    for seed in range(60):
        rng = random.Random(seed)
        blocks = [
            block(rng.randint(1, 5000), rng.randint(0, 5000), rng.randint(0, 1000), rng.random(), 2 * rng.random())
            for _ in range(rng.choice([40, 80, 150]))
        ]
        knapsack = Knapsack(Profile(blocks=tuple(blocks), shape=REF).options_at())
        store = sum(b.saved_bytes for b in blocks)
        for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
            budget = int(store * frac)
            best = every_cap(knapsack, budget)
            found = knapsack.solve(budget)
            if best == INF:
                assert found is None
                continue
            assert found is not None
            ratios.append(found.seconds / best if best > 0 else 1.0)
    assert len(ratios) > 200
    assert sum(r > 1 + 1e-9 for r in ratios) <= len(ratios) // 50  # at most 2% of budgets miss...
    assert max(ratios) <= 1.10  # ...and by little


def test_identical_blocks_form_one_class_with_recomputation_first() -> None:
    profile = Profile(blocks=(block(1000, 400, 100, 0.01, 0.05),) * 12, shape=REF)
    # Selective measured at a quarter of its price (until measured it costs what recomputing does).
    options = at_shape(profile, None, scales=((Mode.SELECTIVE, 0.25),)).options
    # Recompute frees 900 bytes for 0.01 s per block, selective 600 for 0.0025: the target asks for
    # 12 x 1000 - 9000 = 3000 bytes freed (+ the recompute transient): selective everywhere is cheapest.
    choice = solve(options, 9000, exact=False)
    assert choice.fits and set(choice.modes) <= {Mode.SELECTIVE, Mode.STORE}
    tight = solve(options, 3000, exact=False)
    assert tight.fits
    recomputed = [i for i, m in enumerate(tight.modes) if m == Mode.RECOMPUTE]
    # The blocks that bring most back in backward go first, where the fewest kept bytes are still held.
    assert recomputed and recomputed == list(range(len(recomputed))), letters(tight.modes)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 100), st.integers(1, 4), st.floats(0.0, 1.0), st.integers(0, 50), st.integers(1, 60)),
        min_size=1,
        max_size=80,
    ),
    st.integers(0, 120),
)
def test_runs_sum_what_holds_at_a_cap(raw: list[tuple[int, int, float, int, int]], cap: int) -> None:
    """A run's sums at a cap are those of its segments that hold there, each taken whole."""
    segments = [(freed, w, added, lo, float("inf") if span > 50 else lo + span) for freed, w, added, lo, span in raw]
    runs = Runs(segments)
    for r in range(len(runs)):
        held = [s for s in segments[r * RUN : (r + 1) * RUN] if s[3] <= cap < s[4]]
        freed, added = runs.at(r, cap)
        assert freed == sum(s[0] * s[1] for s in held)
        assert added == pytest.approx(sum(s[2] * s[1] for s in held), abs=1e-9)


@pytest.mark.parametrize("exact", [True, False])
def test_blocks_alike_on_two_pipeline_stages_recompute_at_the_start_of_each(exact: bool) -> None:
    # On a rank running two stages, a moment of the first stage's backward still holds what the second
    # keeps: two recomputed blocks go one at the start of each stage, not both on the first, and the
    # predicted peak is the peak in backward order.
    blocks = tuple(BlockCost(saved_bytes=100, input_bytes=10, forward_seconds=1.0, stage=s) for s in (0, 0, 1, 1))
    options = Profile(blocks=blocks, shape=REF).options_at()
    choice = solve(options, 250, exact=exact)
    assert letters(choice.modes) == "R.R." and choice.fits
    assert choice.predicted_peak_bytes == peak_of(choose(options, choice.modes)) <= 250


def test_a_front_loaded_placement_that_would_not_fit_is_not_taken() -> None:
    # One class split by another block, whose two modes keep little and bring back much (compress) or
    # bring back least (selective): the compressed block first would peak at 104; the search's own
    # placement fits the target of 103.
    alike = [
        Option(Mode.STORE, 30, 0, 0.0),
        Option(Mode.SELECTIVE, 3, 1, 2.0),
        Option(Mode.COMPRESS, 4, 5, 1.0),
    ]
    options = [alike, [Option(Mode.RECOMPUTE, 80, 20, 0.0)], alike]
    choice = solve(options, 103, exact=True)
    assert choice.fits and peak_of(choose(options, choice.modes)) <= 103, letters(choice.modes)
