"""The exact solver's filter of partial plans: the n log n path (no pipeline stage before) keeps exactly
what the pairwise test keeps."""

from __future__ import annotations

import random

import pytest

from rematd.planner.ordered import _pareto, _State
from rematd.planner.units import Mode


def pairwise(states: list[_State]) -> list[_State]:
    """The definition: sorted by bytes kept, a state is dropped where one kept before it peaks, costs, has
    its other microbatches keep, and peaked before, no more."""
    states = sorted(states, key=lambda s: (s[0], s[1], s[2], s[4], s[5]))
    out: list[_State] = []
    for s in states:
        if any(o[1] <= s[1] and o[2] <= s[2] + 1e-15 and o[4] <= s[4] and o[0] + o[5] <= s[0] + s[5] for o in out):
            continue
        out.append(s)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_fast_filter_keeps_what_the_pairwise_one_keeps(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    # Few distinct values, so that ties (equal kept, worst or seconds) are common.
    states: list[_State] = [
        (rng.randint(0, 20) * 100, rng.randint(0, 30) * 50, rng.randint(0, 40) * 0.001, (Mode.STORE,) * (i % 3), 0, 0)
        for i in range(n)
    ]
    fast = _pareto(list(states))
    assert sorted(fast) == sorted(pairwise(states))


def test_states_of_a_later_pipeline_stage_take_the_pairwise_path() -> None:
    states: list[_State] = [(100, 50, 0.01, (), 0, 10), (100, 50, 0.01, (), 0, 0), (200, 10, 0.005, (), 5, 0)]
    assert sorted(_pareto(list(states))) == sorted(pairwise(states))
