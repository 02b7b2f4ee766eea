"""Solvers: a mode per block so that the predicted peak fits a target at least cost.

The knapsack bounds the peak by static + sum(kept) + max(transient): additive
but for the one largest rematerialisation. Each distinct transient is tried as
a cap on it, leaving a multiple-choice knapsack (least extra seconds with kept
bytes within target - static - cap). Small models get the exact optimum from a
Pareto-frontier dynamic programme per cap; larger ones the rounded greedy of
:mod:`rematd.planner.knapsack`, optimal up to rounding one class's count.
Both skip the caps a lower bound rules out.

The peak itself follows the order of backward (:func:`rematd.planner.cost.peak_of`):
a block rematerialises after the blocks behind it have released what they kept,
so the bound overstates it by up to one rematerialisation. The solve therefore
widens the knapsack's budget by as much of that as the real peak leaves
(bisected). Within each class of identical blocks the modes that bring most back
go first, where fewer kept bytes are held (:mod:`rematd.planner.spread`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rematd.planner.cost import choose, peak_of
from rematd.planner.knapsack import Knapsack
from rematd.planner.model import Option, Profile
from rematd.planner.ordered import TooManyStates, exact_ordered
from rematd.planner.spread import placed_first
from rematd.planner.units import Mode, Shape

# Up to this many blocks the exact frontier programme is cheap.
EXACT_BLOCKS = 12
LEAN_TIE = 0.01
"""Where nothing is predicted under the budget, plans whose predicted peak is within this fraction of the
least any plan reaches count as the leanest (their difference is within the prediction's error): the
fastest of them is chosen."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """A solver's answer before it becomes a versioned plan."""

    modes: tuple[Mode, ...]
    """One mode per block."""
    predicted_peak_bytes: int
    """Predicted peak of the choice."""
    extra_seconds: float
    """Predicted extra step seconds."""
    fits: bool
    """Whether the predicted peak is within the target."""
    under_budget: bool = True
    """Whether the predicted peak is within the budget (the limit the target keeps a margin under): a choice
    that does not fit the target is the fastest under the budget, where one is, else the leanest."""
    note: str = ""
    """Why this choice, where that is not simply "the cheapest that fits"."""

    @property
    def blocks(self) -> tuple[int, ...]:
        """Blocks that do not store everything."""
        return tuple(i for i, m in enumerate(self.modes) if m != Mode.STORE)


def every_k_blocks(num_blocks: int, k: int) -> tuple[int, ...]:
    """Blocks recomputed by "every k-th block": the indices divisible by k; none for k == 0."""
    if k < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {k}")
    if k == 0:
        return ()
    return tuple(range(0, num_blocks, k))


def checkpoint_every_of(modes: tuple[Mode, ...]) -> int:
    """The k for which ``modes`` recompute every k-th block and store the rest, or 0 when they are no such plan."""
    if any(m not in (Mode.STORE, Mode.RECOMPUTE) for m in modes):
        return 0
    return frequency_of(len(modes), tuple(i for i, m in enumerate(modes) if m == Mode.RECOMPUTE))


def frequency_of(num_blocks: int, blocks: tuple[int, ...]) -> int:
    """The k for which ``blocks`` is "every k-th block", or 0 when it is no such set."""
    if not blocks or blocks[0] != 0:
        return 0
    k = blocks[1] - blocks[0] if len(blocks) > 1 else num_blocks
    return k if every_k_blocks(num_blocks, k) == blocks else 0


@dataclass(frozen=True, slots=True)
class Outside:
    """Memory outside the blocks, as the peak in backward order counts it."""

    bytes: int = 0
    """Bytes outside the blocks at the end of forward (left out of the targets the solvers are given)."""
    in_backward: float = True
    """The fraction of them still held while the blocks' backward runs."""

    def peak(self, chosen: Sequence[Option], static: int) -> int:
        """The peak of ``chosen`` in backward order, less these bytes (what the targets compare with)."""
        return peak_of(chosen, static, outside_bytes=self.bytes, outside_in_backward=self.in_backward) - self.bytes


def _finish(
    options: list[list[Option]], modes: Sequence[Mode], target: int, static: int, outside: Outside = Outside()
) -> Choice:
    chosen = choose(options, modes)
    peak = outside.peak(chosen, static)
    return Choice(
        modes=tuple(modes), predicted_peak_bytes=peak, extra_seconds=sum(o.seconds for o in chosen), fits=peak <= target
    )


def front_loaded(
    options: list[list[Option]], modes: Sequence[Mode], alike: Sequence[Sequence[int]] | None = None
) -> list[Mode]:
    """The same count of each mode within each class of identical blocks, those that bring most back
    in backward first and the stored blocks last: each rematerialisation then runs when the fewest
    kept bytes are still held. ``alike``: those classes of two blocks or more, where already known."""
    out = list(modes)
    for idx in _byte_classes(options) if alike is None else alike:
        by_mode = {o.mode: o for o in options[idx[0]]}
        ordered = sorted(
            (modes[i] for i in idx), key=lambda m: (*placed_first(m, by_mode[m].transient, by_mode[m].kept), m)
        )
        for i, mode in zip(idx, ordered, strict=True):
            out[i] = mode
    return out


def _arranged(
    knapsack: Knapsack, options: list[list[Option]], choice: Choice, target: int, static: int, outside: Outside
) -> Choice | None:
    """``choice`` priced in backward order, as it is or front-loaded; None when neither fits ``target``."""
    found = _finish(options, choice.modes, target, static, outside)
    if not found.fits:
        loaded = tuple(front_loaded(options, choice.modes, knapsack.alike))
        # Nothing to rearrange where no two blocks are alike.
        found = _finish(options, loaded, target, static, outside) if loaded != choice.modes else found
    return dataclasses.replace(found, extra_seconds=choice.extra_seconds) if found.fits else None


def _ordered(
    knapsack: Knapsack,
    options: list[list[Option]],
    target: int,
    static: int,
    exact: bool | None,
    outside: Outside,
) -> Choice | None:
    """The cheapest choice whose peak in backward order fits ``target``: exact for small models
    (:func:`rematd.planner.ordered.exact_ordered`, seconds pooled as for the bound), else the knapsack
    solved under wider budgets (its bound overstates the peak by at most the largest
    rematerialisation), bisected."""
    if exact is None:
        exact = len(options) <= EXACT_BLOCKS
    if exact:
        pooled = pool_seconds(options)
        budget = target - static
        try:
            modes = exact_ordered(pooled, budget, budget + outside.bytes - int(outside.bytes * outside.in_backward))
        except TooManyStates:
            pass
        else:
            if modes is None:
                return None
            # Placed front-loaded where that fits too (the same seconds: the blocks are alike).
            loaded = _finish(pooled, front_loaded(pooled, modes), target, static, outside)
            return loaded if loaded.fits else _finish(pooled, modes, target, static, outside)
    best = None
    found = _solve_fitting(knapsack, options, target, static, exact)
    if found is not None:
        best = _arranged(knapsack, options, found, target, static, outside)

    def widened(extra: int) -> Choice | None:
        wider = _solve_fitting(knapsack, options, target + extra, static, exact)
        return _arranged(knapsack, options, wider, target, static, outside) if wider is not None else None

    lo, hi = 0, max((o.transient for opts in options for o in opts), default=0)
    # The widest first: where it fits (a plan that stores its last blocks), no search is needed.
    widest = widened(hi) if hi > 0 else None
    if widest is not None:
        return widest if best is None or widest.extra_seconds < best.extra_seconds - 1e-15 else best
    grain = max(1, hi // 64)
    while hi - lo > grain:
        mid = (lo + hi) // 2
        fitting = widened(mid)
        if fitting is None:
            hi = mid
            continue
        lo = mid
        if best is None or fitting.extra_seconds < best.extra_seconds - 1e-15:
            best = fitting
    return best


def _exact(options: list[list[Option]], cap: int, budget: int) -> tuple[float, list[Mode]] | None:
    """Minimum extra seconds with every transient <= cap and kept <= budget (Pareto frontier DP)."""
    frontier: list[tuple[int, float, tuple[Mode, ...]]] = [(0, 0.0, ())]
    for opts in options:
        grown = [
            (kept + o.kept + o.others, secs + o.seconds, (*picked, o.mode))
            for kept, secs, picked in frontier
            for o in opts
            if o.transient <= cap and kept + o.kept + o.others <= budget
        ]
        if not grown:
            return None
        grown.sort(key=lambda s: (s[0], s[1]))
        frontier = []
        best = math.inf
        for state in grown:
            if state[1] < best - 1e-15:
                frontier.append(state)
                best = state[1]
    _kept, secs, picked = min(frontier, key=lambda s: (s[1], s[0]))
    return secs, list(picked)


def _byte_classes(options: list[list[Option]]) -> list[list[int]]:
    """Blocks whose options are alike in everything but seconds (and in position group, where step-level
    prices tell groups apart; and in pipeline stage, whose peaks are apart)."""
    groups: dict[tuple[tuple[int, int, int, int, int, int], ...], list[int]] = {}
    for i, opts in enumerate(options):
        key = tuple((int(o.mode), o.kept, o.transient, o.others, o.group, o.stage) for o in opts)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def pool_seconds(options: list[list[Option]]) -> list[list[Option]]:
    """The options with each mode's seconds averaged over the blocks alike in bytes (as the
    knapsack does for large models): the cost model the solvers optimise."""
    out = list(options)
    for idx in _byte_classes(options):
        if len(idx) < 2:
            continue
        first = options[idx[0]]
        n = len(idx)
        pooled = [
            o.repriced(sum(options[i][j].seconds for i in idx) / n, fixed=sum(options[i][j].fixed for i in idx) / n)
            for j, o in enumerate(first)
        ]
        for i in idx:
            out[i] = pooled
    return out


def solve(
    options: list[list[Option]],
    target: int,
    *,
    static_bytes: int = 0,
    exact: bool | None = None,
    budget: int | None = None,
) -> Choice:
    """The cheapest modes (least extra seconds) whose predicted peak fits ``target``.

    Exact up to ``EXACT_BLOCKS`` blocks (or with ``exact=True``) under the seconds of
    :func:`pool_seconds`; otherwise the rounded greedy of :mod:`rematd.planner.knapsack`. When
    nothing fits, the cheapest choice under ``budget`` (default: ``target``), else the leanest, marked
    ``fits=False``, its ``note`` saying so.
    """
    return solve_prepared(Knapsack(options), options, target, static_bytes=static_bytes, exact=exact, budget=budget)


def solve_prepared(
    knapsack: Knapsack,
    options: list[list[Option]],
    target: int,
    *,
    static_bytes: int = 0,
    exact: bool | None = None,
    outside_bytes: int = 0,
    outside_in_backward: float = True,
    budget: int | None = None,
) -> Choice:
    """:func:`solve` with the knapsack already prepared from ``options`` (many targets, one shape).

    ``outside_bytes``: memory outside the blocks, which ``target`` and ``budget`` already leave out; held while
    the blocks' backward runs when ``outside_in_backward``. When nothing fits ``target``: the cheapest plan
    predicted under ``budget`` (the limit ``target`` keeps a margin under; default ``target``), and only when
    nothing is, the leanest (of plans within :data:`LEAN_TIE` of the least peak, the fastest).
    """
    outside = Outside(outside_bytes, outside_in_backward)
    found = _ordered(knapsack, options, target, static_bytes, exact, outside)
    if found is not None:
        return found
    limit = target if budget is None else max(target, budget)
    if limit > target:
        under = _ordered(knapsack, options, limit, static_bytes, exact, outside)
        if under is not None:
            peak = under.predicted_peak_bytes + outside_bytes
            return dataclasses.replace(
                _finish(options, under.modes, target, static_bytes, outside),
                extra_seconds=under.extra_seconds,
                note=f"no plan fits the target: the fastest under the budget, {_mib(peak)} predicted",
            )
    j = knapsack.least_peak()[1]
    leanest = _finish(options, knapsack.leanest(j), target, static_bytes, outside)
    front = _finish(options, front_loaded(options, leanest.modes, knapsack.alike), target, static_bytes, outside)
    leanest = front if front.predicted_peak_bytes < leanest.predicted_peak_bytes else leanest
    floor = leanest.predicted_peak_bytes
    tie = int(LEAN_TIE * (floor + outside_bytes))
    close = _ordered(knapsack, options, floor + tie, static_bytes, exact, outside) if tie > 0 else None
    if close is not None and close.extra_seconds < leanest.extra_seconds:
        leanest = dataclasses.replace(
            _finish(options, close.modes, target, static_bytes, outside), extra_seconds=close.extra_seconds
        )
    peak = leanest.predicted_peak_bytes
    return dataclasses.replace(
        leanest,
        under_budget=peak <= limit,
        note=(
            f"no plan fits the budget: the leanest, {_mib(peak + outside_bytes)} predicted, "
            f"{_mib(peak - limit)} over it"
        ),
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _solve_fitting(
    knapsack: Knapsack, options: list[list[Option]], target: int, static_bytes: int, exact: bool | None
) -> Choice | None:
    if exact is None:
        exact = len(options) <= EXACT_BLOCKS
    budget = target - static_bytes
    if exact:
        # Blocks alike in bytes are alike in time too, but for the noise of measuring them: with their
        # seconds pooled, which of them recompute is a free choice, made front-loaded.
        pooled = pool_seconds(options)
        modes = _exact_over_caps(knapsack, pooled, budget)
        if modes is not None:
            loaded = _finish(pooled, front_loaded(pooled, modes), target, static_bytes)
            return loaded if loaded.fits else _finish(pooled, modes, target, static_bytes)
    else:
        found = knapsack.solve(budget)
        if found is not None:
            peak = static_bytes + found.kept + found.transient
            return Choice(
                modes=found.modes, predicted_peak_bytes=peak, extra_seconds=found.seconds, fits=peak <= target
            )
    return None


def _exact_over_caps(knapsack: Knapsack, options: list[list[Option]], budget: int) -> list[Mode] | None:
    best: tuple[float, int, int, list[Mode]] | None = None
    for cap in knapsack.caps:
        if cap > budget:
            break
        if best is not None and knapsack.bound(budget - cap) >= best[0] - 1e-12:
            break  # the bound only grows with the cap
        found = _exact(options, cap, budget - cap)
        if found is None:
            continue
        secs, modes = found
        chosen = choose(options, modes)
        key = (round(secs, 12), sum(m != Mode.STORE for m in modes), peak_of(chosen), modes)
        if best is None or key[:3] < best[:3]:
            best = key
    return best[3] if best is not None else None


def solve_min_recompute(
    profile: Profile,
    target: int,
    *,
    static_bytes: int = 0,
    shape: Shape | None = None,
    allowed: frozenset[Mode] | None = None,
) -> Choice:
    """The least-overhead plan that fits ``target`` at ``shape`` (the profile's own by default)."""
    return solve(profile.options_at(shape, allowed), target, static_bytes=static_bytes)
