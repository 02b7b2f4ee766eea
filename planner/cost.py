"""The cost model: predicted peak memory and recompute overhead of a plan."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rematd.planner.model import Option, Profile
from rematd.planner.units import Mode, Shape

# Backward costs about twice the forward, so a step is about three forwards.
STEP_FORWARDS = 3.0
NO_MOMENT = -(2**62)
"""Below any moment of backward: a stage whose blocks bring nothing back."""


def peak_of(
    chosen: Sequence[Option], static_bytes: int = 0, *, outside_bytes: int = 0, outside_in_backward: float = True
) -> int:
    """The peak in the order of backward: static memory plus the largest of what is held at the end of
    forward (every block's kept bytes and ``outside_bytes``) and, for each block that rematerialises,
    what is held while its backward runs (the kept bytes of the blocks before it, its own, and what it
    brings back; the blocks after it have released theirs by then). ``outside_in_backward``: the fraction
    of the memory outside the blocks still held then (on CUDA gradients and optimizer state are; the saved
    tensors of the head and the loss are not). On a pipeline stage the other microbatches alive at once
    hold what they keep (``Option.others``) at every moment of it; on a rank that runs several stages
    (``Option.stage``) the backward runs through the later stages first, so while it runs in one stage the
    others' blocks hold what they keep (the later ones, released, are kept by as many other microbatches)."""
    moments = [(o.kept, o.transient, o.others, o.stage) for o in chosen]
    return peak_in_order(moments, static_bytes, outside_bytes=outside_bytes, outside_in_backward=outside_in_backward)


Moment = tuple[int, int, int, int]
"""One block's part in :func:`peak_in_order`: (kept, transient, others, stage), as :class:`Option`'s fields."""


def peak_in_order(
    moments: Sequence[Moment], static_bytes: int = 0, *, outside_bytes: int = 0, outside_in_backward: float = True
) -> int:
    """:func:`peak_of` on plain tuples, one per block: for a caller that sizes blocks at other rows or shapes
    than an :class:`Option` holds (the client's guard on a step's routed rows)."""
    before = worst = others = 0
    stage, done = moments[0][3] if moments else 0, NO_MOMENT
    for kept, transient, other, at in moments:
        if at != stage:
            # A stage's moments hold what every stage after it keeps: counted from where it ended.
            done, worst, stage = max(done, worst - before) if worst else done, 0, at
        if transient:
            worst = max(worst, before + kept + transient)
        before += kept
        others += other
    worst = max(worst, before + done)
    backward = worst + int(outside_bytes * outside_in_backward)
    return static_bytes + others + max(before + outside_bytes, backward)


def bound_of(chosen: Sequence[Option], static_bytes: int = 0) -> int:
    """What the knapsack bounds: every kept byte and the largest rematerialisation as if all were
    held at once; never below :func:`peak_of`."""
    return static_bytes + sum(o.kept + o.others for o in chosen) + max((o.transient for o in chosen), default=0)


def overhead_of(chosen: Sequence[Option], forward_seconds: float) -> float:
    """Extra step time as a fraction of a step without recomputation."""
    return overhead_ratio(sum(o.seconds for o in chosen), forward_seconds)


def overhead_ratio(extra_seconds: float, forward_seconds: float) -> float:
    """``extra_seconds`` as a fraction of a step without recomputation."""
    if forward_seconds <= 0:
        return extra_seconds
    return extra_seconds / (STEP_FORWARDS * forward_seconds)


def choose(options: list[list[Option]], modes: Sequence[Mode]) -> list[Option]:
    """The options that ``modes`` pick, one per block."""
    out = []
    for i, (opts, mode) in enumerate(zip(options, modes, strict=True)):
        for o in opts:  # a plain loop: the solvers pick a thousand blocks' options several times a solve
            if o.mode == mode:
                out.append(o)
                break
        else:
            raise ValueError(f"block {i} has no {mode.name} option")
    return out


def predict_peak_bytes(
    profile: Profile, recompute: Collection[int], *, static_bytes: int = 0, shape: Shape | None = None
) -> int:
    """Predicted peak when ``recompute`` blocks recompute and the others store."""
    modes = [Mode.RECOMPUTE if i in recompute else Mode.STORE for i in range(profile.num_blocks)]
    return peak_of(choose(profile.options_at(shape), modes), static_bytes)


def predict_overhead_ratio(profile: Profile, recompute: Collection[int], *, shape: Shape | None = None) -> float:
    """Extra step time when ``recompute`` blocks recompute, as a fraction of the step."""
    modes = [Mode.RECOMPUTE if i in recompute else Mode.STORE for i in range(profile.num_blocks)]
    return overhead_of(choose(profile.options_at(shape), modes), profile.forward_seconds_at(shape))
