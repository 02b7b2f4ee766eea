"""Solvers: a mode per block so that the predicted peak fits a target at least cost.

The peak is static + sum(kept) + max(transient): additive but for the one
largest rematerialisation. The optimum is found by trying each distinct
transient as a cap and solving the remaining multiple-choice knapsack
(minimise extra seconds subject to kept bytes <= target - static - cap):
exactly, by a Pareto-frontier dynamic programme, for small models; over
classes of identical blocks along each class's convex hull for large ones,
which is optimal up to rounding one class's count.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rematd.planner.cost import peak_of
from rematd.planner.model import Mode, Option, Profile, Shape

# Up to this many blocks the exact frontier programme is cheap.
EXACT_BLOCKS = 12
# Large heterogeneous models: try at most this many transient caps.
MAX_CAPS = 12


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


def frequency_of(num_blocks: int, blocks: tuple[int, ...]) -> int:
    """The k for which ``blocks`` is "every k-th block", or 0 when it is no such set."""
    if not blocks or blocks[0] != 0:
        return 0
    k = blocks[1] - blocks[0] if len(blocks) > 1 else num_blocks
    return k if every_k_blocks(num_blocks, k) == blocks else 0


def spread(indices: Sequence[int], count: int) -> list[int]:
    """``count`` of ``indices`` spread evenly, as "every k-th" when some k gives exactly that many."""
    n = len(indices)
    if count >= n:
        return list(indices)
    if count <= 0:
        return []
    for k in range(1, n + 1):
        if math.ceil(n / k) == count:
            return [indices[j] for j in range(0, n, k)]
    return [indices[(j * n) // count] for j in range(count)]


def _finish(options: list[list[Option]], modes: Sequence[Mode], target: int, static: int) -> Choice:
    chosen = [next(o for o in opts if o.mode == m) for opts, m in zip(options, modes, strict=True)]
    peak = peak_of(chosen, static)
    return Choice(
        modes=tuple(modes), predicted_peak_bytes=peak, extra_seconds=sum(o.seconds for o in chosen), fits=peak <= target
    )


def _exact(options: list[list[Option]], cap: int, budget: int) -> tuple[float, list[Mode]] | None:
    """Minimum extra seconds with every transient <= cap and kept <= budget (Pareto frontier DP)."""
    frontier: list[tuple[int, float, tuple[Mode, ...]]] = [(0, 0.0, ())]
    for opts in options:
        grown = [
            (kept + o.kept, secs + o.seconds, (*picked, o.mode))
            for kept, secs, picked in frontier
            for o in opts
            if o.transient <= cap and kept + o.kept <= budget
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


def _hull(opts: list[Option]) -> list[Option]:
    """The lower convex hull of (kept, seconds), from most kept (cheapest) to least kept."""
    pruned: list[Option] = []
    best = math.inf
    for o in sorted(opts, key=lambda o: (o.kept, o.seconds)):
        if o.seconds < best - 1e-15:  # else some option keeps no more and is no slower
            pruned.append(o)
            best = o.seconds
    pruned.reverse()
    hull: list[Option] = []
    for o in pruned:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is above the segment a -> o: never worth stopping at.
            if (b.seconds - a.seconds) * (a.kept - o.kept) >= (o.seconds - a.seconds) * (a.kept - b.kept):
                hull.pop()
            else:
                break
        hull.append(o)
    return hull


def _classes(options: list[list[Option]], cap: int) -> list[tuple[list[int], list[Option]]]:
    """Blocks with identical byte costs, each class with its options (seconds averaged)."""
    groups: dict[tuple[tuple[int, int, int], ...], list[int]] = {}
    for i, opts in enumerate(options):
        key = tuple((int(o.mode), o.kept, o.transient) for o in opts if o.transient <= cap)
        groups.setdefault(key, []).append(i)
    out = []
    for idx in groups.values():
        first = options[idx[0]]
        avg = []
        for j, o in enumerate(first):
            if o.transient > cap:
                continue
            secs = sum(options[i][j].seconds for i in idx) / len(idx)
            avg.append(Option(o.mode, o.kept, o.transient, secs))
        out.append((idx, avg))
    return out


def _greedy(options: list[list[Option]], cap: int, budget: int) -> tuple[float, list[Mode]] | None:
    """Walk every class down its convex hull, cheapest seconds per freed byte first."""
    classes = [(idx, _hull(opts)) for idx, opts in _classes(options, cap)]
    need = sum(len(idx) * hull[0].kept for idx, hull in classes) - budget
    # counts[c][v]: blocks of class c at hull vertex v
    counts = [[len(idx)] + [0] * (len(hull) - 1) for idx, hull in classes]
    heap: list[tuple[float, int, int]] = []

    def push(c: int, v: int) -> None:
        hull = classes[c][1]
        if v + 1 < len(hull):
            freed = hull[v].kept - hull[v + 1].kept
            cost = hull[v + 1].seconds - hull[v].seconds
            heapq.heappush(heap, (cost / freed if freed > 0 else math.inf, c, v))

    for c in range(len(classes)):
        push(c, 0)
    while need > 0 and heap:
        _, c, v = heapq.heappop(heap)
        hull = classes[c][1]
        freed = hull[v].kept - hull[v + 1].kept
        if freed <= 0:
            continue
        movable = counts[c][v]
        k = min(movable, -(-need // freed))
        counts[c][v] -= k
        counts[c][v + 1] += k
        need -= k * freed
        if k == movable:
            push(c, v + 1)
    if need > 0:
        return None
    modes: list[Mode] = [Mode.STORE] * len(options)
    secs = 0.0
    for (idx, hull), cnt in zip(classes, counts, strict=True):
        remaining = list(idx)
        # The most-recomputing vertex first, spread evenly over the class's blocks.
        for v in range(len(hull) - 1, -1, -1):
            picked = spread(remaining, cnt[v]) if v else remaining
            for i in picked:
                modes[i] = hull[v].mode
            secs += cnt[v] * hull[v].seconds
            taken = set(picked)
            remaining = [i for i in remaining if i not in taken]
    return secs, modes


def _respread(options: list[list[Option]], modes: list[Mode]) -> list[Mode]:
    """The same count of each mode within each class of identical blocks, placed evenly
    (as "every k-th" where a k gives that count) rather than wherever the search put them."""
    groups: dict[tuple[tuple[int, int, int], ...], list[int]] = {}
    for i, opts in enumerate(options):
        groups.setdefault(tuple((int(o.mode), o.kept, o.transient) for o in opts), []).append(i)
    out = list(modes)
    for idx in groups.values():
        if len(idx) < 2:
            continue
        counts: dict[Mode, int] = {}
        for i in idx:
            counts[modes[i]] = counts.get(modes[i], 0) + 1
        remaining = list(idx)
        # Modes that keep least go first: recompute before selective before store.
        for mode in sorted(counts, key=lambda m: min(o.kept for o in options[idx[0]] if o.mode == m)):
            picked = spread(remaining, counts[mode]) if mode != Mode.STORE else list(remaining)
            for i in picked:
                out[i] = mode
            taken = set(picked)
            remaining = [i for i in remaining if i not in taken]
    return out


def _caps(options: list[list[Option]], exact: bool) -> list[int]:
    caps = sorted({o.transient for opts in options for o in opts})
    if exact or len(caps) <= MAX_CAPS:
        return caps
    step = (len(caps) - 1) / (MAX_CAPS - 1)
    return sorted({caps[round(j * step)] for j in range(MAX_CAPS)})


def solve(options: list[list[Option]], target: int, *, static_bytes: int = 0, exact: bool | None = None) -> Choice:
    """The cheapest modes (least extra seconds) whose predicted peak fits ``target``.

    Ties go to fewer blocks that do not store. When nothing fits, the choice
    with the smallest predicted peak, marked ``fits=False``.
    """
    if exact is None:
        exact = len(options) <= EXACT_BLOCKS
    best: tuple[float, int, int, list[Mode]] | None = None
    for cap in _caps(options, exact):
        budget = target - static_bytes - cap
        if budget < 0:
            break
        found = _exact(options, cap, budget) if exact else _greedy(options, cap, budget)
        if found is None:
            continue
        secs, modes = found
        choice = _finish(options, modes, target, static_bytes)
        key = (round(secs, 12), len(choice.blocks), choice.predicted_peak_bytes, modes)
        if best is None or key[:3] < best[:3]:
            best = key
    if best is not None:
        return _finish(options, _respread(options, best[3]), target, static_bytes)
    return smallest_peak(options, target, static_bytes=static_bytes)


def smallest_peak(options: list[list[Option]], target: int, *, static_bytes: int = 0) -> Choice:
    """The modes with the least predicted peak, whatever they cost."""
    best: Choice | None = None
    for cap in sorted({o.transient for opts in options for o in opts}):
        modes = []
        for opts in options:
            allowed = [o for o in opts if o.transient <= cap]
            modes.append(min(allowed, key=lambda o: (o.kept, o.seconds)).mode if allowed else opts[-1].mode)
        choice = _finish(options, modes, target, static_bytes)
        if best is None or choice.predicted_peak_bytes < best.predicted_peak_bytes:
            best = choice
    assert best is not None
    return best


def _uniform(profile: Profile, blocks: tuple[int, ...], target: int, static: int, shape: Shape | None) -> Choice:
    chosen = set(blocks)
    modes = [Mode.RECOMPUTE if i in chosen else Mode.STORE for i in range(profile.num_blocks)]
    return _finish(profile.options_at(shape), modes, target, static)


def solve_none(profile: Profile, target: int, *, static_bytes: int = 0, shape: Shape | None = None) -> Choice:
    return _uniform(profile, (), target, static_bytes, shape)


def solve_full(profile: Profile, target: int, *, static_bytes: int = 0, shape: Shape | None = None) -> Choice:
    return _uniform(profile, tuple(range(profile.num_blocks)), target, static_bytes, shape)


def solve_every(profile: Profile, k: int, target: int, *, static_bytes: int = 0, shape: Shape | None = None) -> Choice:
    return _uniform(profile, every_k_blocks(profile.num_blocks, k), target, static_bytes, shape)


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
