"""The memory model of a pipeline stage: what the other microbatches alive at once keep is held at every moment
of the backward of the one whose backward runs; the solvers plan under it, exactly for small models."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from rematd.planner import Mode
from rematd.planner.cost import choose, peak_of
from rematd.planner.knapsack import Knapsack
from rematd.planner.messages import BlockProfile, Hello
from rematd.planner.model import BlockCost, ModeCost, Profile, Size
from rematd.planner.solvers import solve_prepared


def _block(saved: int, inp: int, m: int, stage: int = 0) -> BlockCost:
    return BlockCost(
        saved_bytes=saved,
        input_bytes=inp,
        forward_seconds=0.01,
        in_flight=m,
        stage=stage,
        modes=(
            ModeCost(mode=Mode.STORE, kept=Size.linear(saved)),
            ModeCost(mode=Mode.RECOMPUTE, kept=Size.linear(inp), transient=Size.linear(saved), extra_seconds=0.01),
        ),
    )


def _truth(profile: Profile, modes: tuple[Mode, ...]) -> int:
    """The peak walked by hand: each microbatch's kept bytes held until its backward passes the block; the oldest
    microbatch's backward runs while every other one alive holds all it kept. On a rank with several stages its
    backward releases a stage's blocks only as it passes them: while it runs in one, the others' are held."""
    opts = choose(profile.options_at(), modes)
    others = sum((b.in_flight - 1) * o.kept for b, o in zip(profile.blocks, opts, strict=True))
    outside = profile.other_at()
    held_back = int(outside * profile.other_in_backward)
    total = sum(o.kept for o in opts)
    moments = [total + outside]
    for i, o in enumerate(opts):
        if o.transient:
            later = sum(p.kept for j, p in enumerate(opts) if j > i and p.stage == o.stage)
            moments.append(total - later + o.transient + held_back)
    return others + max(moments)


def test_the_other_microbatches_hold_what_they_keep_through_the_backward() -> None:
    # Stage 0 of 2 under 1F1B: two microbatches alive; four alike blocks, the first two recompute.
    profile = Profile(blocks=tuple(_block(100, 10, 2) for _ in range(4)))
    modes = (Mode.RECOMPUTE, Mode.RECOMPUTE, Mode.STORE, Mode.STORE)
    opts = choose(profile.options_at(), modes)
    # End of forward: both microbatches' kept bytes; the first block's recompute holds less than that.
    assert peak_of(opts) == 2 * (10 + 10 + 100 + 100)
    # All recompute: the other microbatch keeps 4 inputs; this one 4 inputs and the last block's activations.
    everything = choose(profile.options_at(), (Mode.RECOMPUTE,) * 4)
    assert peak_of(everything) == 4 * 10 + 4 * 10 + 100
    assert peak_of(everything) == _truth(profile, (Mode.RECOMPUTE,) * 4)


def test_on_a_rank_with_two_stages_the_backward_in_the_first_holds_the_second_stages_blocks() -> None:
    # Stage 0 (2 microbatches alive) and stage 2 (1 alive) on one rank, two alike blocks each. The oldest
    # microbatch's backward runs stage 2, then stage 0: while it recomputes stage 0's last block, stage 2's blocks
    # are released by it but still kept by none other; stage 0's first block is held by it and by the other one.
    profile = Profile(
        blocks=(_block(100, 10, 2, 0), _block(100, 10, 2, 0), _block(100, 10, 1, 1), _block(100, 10, 1, 1))
    )
    modes = (Mode.STORE, Mode.RECOMPUTE, Mode.STORE, Mode.STORE)
    opts = choose(profile.options_at(), modes)
    # End of forward: 2 x (100 + 10) + 200; stage 0's recompute: the other's 110, 100 + 10 and 100 back, and 200.
    assert peak_of(opts) == max(2 * 110 + 200, 110 + 110 + 100 + 200) == 520 == _truth(profile, modes)
    # Taken for one stage, the recompute would count stage 2's blocks as released: the end of forward's 420.
    flat = Profile(blocks=tuple(_block(100, 10, m, 0) for m in (2, 2, 1, 1)))
    assert peak_of(choose(flat.options_at(), modes)) == 420


def test_a_hello_carries_the_microbatches_in_flight_into_the_profile() -> None:
    hello = Hello(
        job_id="pp",
        blocks=(
            BlockProfile(index=0, name="layers.0", saved_bytes=8, input_bytes=2, forward_seconds=0.1, in_flight=3),
        ),
        budget_bytes=100,
        other_activations=Size.linear(5),
        other_in_flight=3,
    )
    hello.validate()
    profile = hello.profile()
    assert profile.blocks[0].in_flight == 3 and profile.other_at() == 15
    # On the CPU the saved tensors outside the blocks of the two other microbatches stay through this one's backward.
    assert profile.other_in_backward == 2 / 3
    # A client before pipelines sends 0: one microbatch.
    old = Hello(
        job_id="pp",
        blocks=(BlockProfile(index=0, name="b", saved_bytes=8, input_bytes=2, forward_seconds=0.1, in_flight=0),),
        budget_bytes=100,
    )
    old.validate()
    assert old.profile().blocks[0].in_flight == 1 and old.profile().other_in_flight == 1


@settings(max_examples=40, deadline=None)
@given(
    saved=st.lists(st.integers(20, 400), min_size=2, max_size=6),
    flights=st.lists(st.integers(1, 4), min_size=6, max_size=6),
    other=st.integers(0, 200),
    other_flight=st.integers(1, 4),
    cut=st.floats(0.2, 1.0),
    split=st.integers(0, 6),
)
def test_the_exact_solver_plans_the_cheapest_plan_under_the_pipelined_peak(
    saved: list[int], flights: list[int], other: int, other_flight: int, cut: float, split: int
) -> None:
    # Blocks from ``split`` on run in the rank's second stage (when it holds any).
    profile = Profile(
        blocks=tuple(_block(s, max(1, s // 8), flights[i], int(i >= split)) for i, s in enumerate(saved)),
        other=Size.linear(other),
        other_in_flight=other_flight,
        other_in_backward=(other_flight - 1) / other_flight,
    )
    options = profile.options_at()
    plans = list(itertools.product((Mode.STORE, Mode.RECOMPUTE), repeat=len(saved)))
    for modes in plans:
        assert peak_of(
            choose(options, modes), outside_bytes=profile.other_at(), outside_in_backward=profile.other_in_backward
        ) == _truth(profile, modes)
    outside = profile.other_at()
    target = int(cut * max(_truth(profile, m) for m in plans)) - outside
    choice = solve_prepared(
        Knapsack(options), options, target, outside_bytes=outside, outside_in_backward=profile.other_in_backward
    )
    fitting = [m for m in plans if _truth(profile, m) - outside <= target]
    if not fitting:
        assert not choice.fits
        return
    assert choice.fits and _truth(profile, choice.modes) - outside <= target
    cheapest = min(sum(o.seconds for o in choose(options, m)) for m in fitting)
    assert sum(o.seconds for o in choose(options, choice.modes)) <= cheapest + 1e-9
