"""Solvers: which blocks to recompute so that the predicted peak fits a target."""

from __future__ import annotations

from dataclasses import dataclass

from rematd.planner.cost import predict_peak_bytes
from rematd.planner.model import Profile


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """A solver's answer before it becomes a versioned plan."""

    blocks: tuple[int, ...]
    """Blocks to recompute, ascending."""
    predicted_peak_bytes: int
    """Predicted peak of the choice."""
    fits: bool
    """Whether the predicted peak is within the target."""


def every_k_blocks(num_blocks: int, k: int) -> tuple[int, ...]:
    """Blocks recomputed by "every k-th block": the indices divisible by k; none for k == 0."""
    if k < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {k}")
    if k == 0:
        return ()
    return tuple(range(0, num_blocks, k))


def frequency_of(num_blocks: int, blocks: tuple[int, ...]) -> int:
    """The k for which ``blocks`` is "every k-th block", or 0 when it is no such set."""
    if not blocks:
        return 0
    for k in range(1, num_blocks + 1):
        if every_k_blocks(num_blocks, k) == blocks:
            return k
    return 0


def _choice(profile: Profile, blocks: tuple[int, ...], target: int, static: int) -> Choice:
    peak = predict_peak_bytes(profile, frozenset(blocks), static_bytes=static)
    return Choice(blocks=blocks, predicted_peak_bytes=peak, fits=peak <= target)


def solve_none(profile: Profile, target: int, *, static_bytes: int = 0) -> Choice:
    return _choice(profile, (), target, static_bytes)


def solve_full(profile: Profile, target: int, *, static_bytes: int = 0) -> Choice:
    return _choice(profile, tuple(range(profile.num_blocks)), target, static_bytes)


def solve_every(profile: Profile, k: int, target: int, *, static_bytes: int = 0) -> Choice:
    return _choice(profile, every_k_blocks(profile.num_blocks, k), target, static_bytes)


def _greedy(profile: Profile, target: int, static: int) -> Choice:
    """Recompute the blocks that free the most bytes first until the plan fits."""
    order = sorted(
        range(profile.num_blocks),
        key=lambda i: (-(profile.blocks[i].saved_bytes - profile.blocks[i].input_bytes), i),
    )
    chosen: list[int] = []
    best = _choice(profile, (), target, static)
    for i in order:
        if best.fits:
            break
        chosen.append(i)
        best = _choice(profile, tuple(sorted(chosen)), target, static)
    return best


def solve_min_recompute(profile: Profile, target: int, *, static_bytes: int = 0) -> Choice:
    """The plan with the fewest recomputed blocks that fits ``target``.

    Uniform "every k-th block" plans are preferred (they are what people and
    the protocol's frequency describe); an irregular set wins only when it
    recomputes strictly fewer blocks. When nothing fits, full recomputation.
    """
    uniform: Choice | None = None
    for k in (0, *range(profile.num_blocks, 0, -1)):
        candidate = solve_every(profile, k, target, static_bytes=static_bytes)
        if candidate.fits:
            uniform = candidate
            break
    greedy = _greedy(profile, target, static_bytes)
    if uniform is None:
        return greedy if greedy.fits else solve_full(profile, target, static_bytes=static_bytes)
    if greedy.fits and len(greedy.blocks) < len(uniform.blocks):
        return greedy
    return uniform
