"""Step-level prices: what a mode on a block costs the whole step, fitted to measured step times.

Per-block timings see what a mode adds inside the block (the recomputation, the selective policy's
dispatch); they cannot see what a mode changes elsewhere in the step. On a CPU, activations stored in
forward come back from memory in backward while recomputed ones are still in cache, so storing costs time
that no block's timing shows, more for the first blocks (whose activations wait longest) than for the
last. On a GPU, recomputation hidden behind communication costs less than it does alone. The step's time
is the truth: this module fits, per length bucket, what each mode adds to the step on each group of
blocks by position (``groups`` contiguous groups), with the per-block prices as the prior.

The model: a step's time, scaled to the bucket's top length, is a baseline plus, per (mode, group), the
blocks running that mode there times what one costs (``c``). The baseline drifts (other work on the
machine, clocks, thermals), so the fit uses differences between consecutive steps of the bucket: a step
whose plan differs from the one before says how the changed blocks' costs compare, whatever the baseline
did, and two steps of the same plan say how noisy a difference is. The fit is Bayesian least squares:
each ``c`` has a normal prior centred on the per-block price with a spread of one block's
recomputation, so a mode or placement never run is priced as the per-block timings say, and one the
steps show to be dearer or cheaper (even cheaper than storing: a negative price) moves as far as the
evidence carries it. Only sums are kept (of the differences' products, decayed), so the per-block prices
may move under them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rematd.planner.restoring import MAX_SUM, restored_by_length, whole_number
from rematd.planner.timing import MAX_BUCKETS, PRICED
from rematd.planner.units import Mode

MAX_GAP = 4
"""Steps between two observations of a bucket beyond which their difference is not used: the baseline
may have drifted by more than the plans differ."""
DECAY = 0.98
"""Weight of the past pairs of differing plans, per new one: the fit follows a machine whose costs move."""
NOISE_DECAY = 0.95
"""Weight of the past pairs of equal plans in the noise estimate, per new one."""
NOISE_PRIOR = 0.05
"""A step's noise, as a fraction of its time, assumed before equal plans have measured it."""
NOISE_PRIOR_PAIRS = 2.0
"""How many pairs of equal plans that assumption counts as."""
NOISE_FLOOR = 0.002
"""The least noise, as a fraction of a step, ever assumed: no clock is better than that over a step."""
INFLATION = 2.0
"""A difference's variance as least squares takes it, over the noise of a pair of equal plans: successive
differences share a step, which least squares alone would take for independent evidence."""
CLIP = 3.0
"""Differences further than this many standard deviations (the noise's and the fit's own) from the fit's
prediction count as that far."""
MIN_PAIRS = 3.0
"""Pairs of differing plans (decayed) before the fit moves any price."""
MIN_NOISE_PAIRS = 3.0
"""Pairs of equal plans (decayed) before the fit moves any price."""
PRIOR_SPREAD = 1.0
"""A step-level price's prior standard deviation, in blocks' recomputation seconds."""
SHARED = 0.5
"""The part of a price's prior variance every mode's price on every group shares: what storing costs
the step at all is saved by whichever mode does not store."""
GROUPED = 0.25
"""The part it shares with the other modes of its own group only: where storing costs what (placement)."""
GRAIN = 0.05
"""Step-level prices move in steps of this fraction of a block's recomputation: a wobble re-plans nothing."""
_VERSIONS = itertools.count(1)
"""Versions of every fit, never repeated: caches keyed by one outlive a restored state safely."""


def params(groups: int, modes: Sequence[Mode] = PRICED) -> list[tuple[Mode, int]]:
    """The fitted prices, in order: each of ``modes`` (the priced modes a profile offers) on each group."""
    return [(m, g) for m in modes for g in range(groups)]


def group_of(block: int, blocks: int, groups: int) -> int:
    """The position group of ``block`` of ``blocks``: contiguous groups, the first blocks in group 0."""
    return min(groups - 1, block * groups // max(1, blocks))


def counts(modes: Sequence[Mode], groups: int, fitted: Sequence[Mode] = PRICED) -> tuple[int, ...]:
    """The features of a plan: per fitted price (of the modes ``fitted``), the blocks running that mode in that
    group."""
    index = {p: k for k, p in enumerate(params(groups, fitted))}
    out = [0] * len(index)
    for i, m in enumerate(modes):
        k = index.get((m, group_of(i, len(modes), groups)))
        if k is not None:
            out[k] += 1
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Prior:
    """The per-block prices a fit starts from, per fitted price: the mean over the group's blocks of the
    mode's per-block price, and how far the step may take it (seconds at the bucket's top length). The
    prices' departures are correlated (``SHARED``, ``GROUPED``): what one mode's steps show of storing's
    hidden cost says as much of the others'."""

    mean: tuple[float, ...]
    spread: tuple[float, ...]
    groups: int = 2
    modes: tuple[Mode, ...] = PRICED
    """The modes whose prices are fitted, in order."""
    precision: tuple[tuple[float, ...], ...] = field(init=False, repr=False, compare=False)
    """The inverse of the prior's covariance."""

    def __post_init__(self) -> None:
        fitted = params(self.groups, self.modes)
        if not len(self.mean) == len(self.spread) == len(fitted):
            raise ValueError(f"a prior for {len(self.modes)} modes on {self.groups} groups has {len(fitted)} prices")
        own = 1.0 - SHARED - GROUPED
        spread = [max(s, 1e-12) for s in self.spread]
        cov = [
            [
                spread[k] * spread[j] * (SHARED + GROUPED * (gk == gj) + own * (k == j))
                for j, (_mj, gj) in enumerate(fitted)
            ]
            for k, (_mk, gk) in enumerate(fitted)
        ]
        object.__setattr__(self, "precision", tuple(tuple(r) for r in _inverse(cov)))


@dataclass(frozen=True, slots=True)
class Posterior:
    """What the steps and the prior say of each fitted price: mean and covariance (seconds at the top)."""

    mean: tuple[float, ...]
    cov: tuple[tuple[float, ...], ...]

    def contrast(self, dx: Sequence[int]) -> tuple[float, float]:
        """Mean and standard deviation of what a plan change of features ``dx`` adds to the step."""
        mean = sum(d * m for d, m in zip(dx, self.mean, strict=True))
        var = sum(dx[i] * dx[j] * self.cov[i][j] for i in range(len(dx)) if dx[i] for j in range(len(dx)) if dx[j])
        return mean, math.sqrt(max(0.0, var))


@dataclass(frozen=True, slots=True)
class Sums:
    """A fit's sums over pairs of differing plans at one moment, and its noise then."""

    sxx: list[list[float]]
    """:attr:`StepFit.sxx` then."""
    sxy: list[float]
    """:attr:`StepFit.sxy` then."""
    pairs: float
    """:attr:`StepFit.pairs` then."""
    noise_var: float
    """:meth:`StepFit.noise_var` then: what later steps' noise is weighed against."""


@dataclass(slots=True)
class _Last:
    step: int
    seconds: float
    features: tuple[int, ...]


class StepFit:
    """One length bucket's fit: decayed sums of the differences between consecutive steps."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.sxx = [[0.0] * size for _ in range(size)]
        """Decayed sum of dx dx^T over pairs of differing plans."""
        self.sxy = [0.0] * size
        """Decayed sum of dx dy over those pairs."""
        self.pairs = 0.0
        """Pairs of differing plans, decayed."""
        self.noise = 0.0
        """Decayed sum of dy^2 over pairs of equal plans."""
        self.noise_pairs = 0.0
        """Pairs of equal plans, decayed."""
        self.level = 0.0
        """A step's time here (scaled to the top length), a running mean."""
        self.last: _Last | None = None
        self.version = next(_VERSIONS)
        """New at every change: what a cached posterior was computed from."""

    # -- what the steps say ---------------------------------------------------

    def observe(self, step: int, seconds: float, features: tuple[int, ...], prior: Prior) -> None:
        """One step of this bucket: its time ``seconds`` (scaled to the top length) under a plan of
        ``features``; paired with the bucket's previous step where that was at most ``MAX_GAP`` steps before."""
        last = self.last
        if last is not None and step <= last.step:
            return  # a step offered again (a new budget): its time was taken the first time
        if last is not None and step - last.step <= MAX_GAP:
            dx = [a - b for a, b in zip(features, last.features, strict=True)]
            dy = seconds - last.seconds
            if any(dx):
                self._pair(dx, dy, prior)
            else:
                self._noise(dy)
        self.level = seconds if self.level <= 0 else 0.9 * self.level + 0.1 * seconds
        self.last = _Last(step, seconds, features)
        self.version = next(_VERSIONS)

    def _noise(self, dy: float) -> None:
        sq = dy * dy
        if self.noise_pairs >= MIN_NOISE_PAIRS:
            # One stall (a collection, another process) is not the noise of every difference.
            sq = min(sq, CLIP * CLIP * self.noise_var())
        self.noise = self.noise * NOISE_DECAY + sq
        self.noise_pairs = self.noise_pairs * NOISE_DECAY + 1.0

    def _pair(self, dx: list[int], dy: float, prior: Prior) -> None:
        # Clipped against what the fit predicts, within its own uncertainty as well as the noise's: a fit
        # still far from the truth must not hold the evidence back.
        predicted, spread = self.posterior(prior).contrast(dx)
        limit = CLIP * math.sqrt(INFLATION * self.noise_var() + spread * spread)
        dy = predicted + min(limit, max(-limit, dy - predicted))
        for i in range(self.size):
            row = self.sxx[i]
            for j in range(self.size):
                row[j] = row[j] * DECAY + dx[i] * dx[j]
            self.sxy[i] = self.sxy[i] * DECAY + dx[i] * dy
        self.pairs = self.pairs * DECAY + 1.0

    def noise_var(self) -> float:
        """The variance of the difference between two steps of one plan (seconds squared)."""
        assumed = 2.0 * (NOISE_PRIOR * self.level) ** 2
        # The assumption fades as the pairs measured would: decayed as often as pairs were seen.
        weight = NOISE_PRIOR_PAIRS * max(0.0, 1.0 - self.noise_pairs * (1.0 - NOISE_DECAY))
        var = (self.noise + weight * assumed) / max(1e-9, self.noise_pairs + weight)
        return max(var, 2.0 * (NOISE_FLOOR * self.level) ** 2, 1e-18)

    @property
    def informed(self) -> bool:
        """Whether enough pairs of differing and of equal plans were seen for the fit to move a price."""
        return self.pairs >= MIN_PAIRS and self.noise_pairs >= MIN_NOISE_PAIRS

    def posterior(self, prior: Prior) -> Posterior:
        """The fitted prices under ``prior``: Bayesian least squares of the differences."""
        var = INFLATION * self.noise_var()
        n = self.size
        lam = prior.precision
        a = [[self.sxx[i][j] / var + lam[i][j] for j in range(n)] for i in range(n)]
        b = [self.sxy[i] / var + sum(lam[i][j] * prior.mean[j] for j in range(n)) for i in range(n)]
        cov = _inverse(a)
        mean = tuple(sum(cov[i][j] * b[j] for j in range(n)) for i in range(n))
        return Posterior(mean, tuple(tuple(r) for r in cov))

    def sums(self) -> Sums:
        """What the pairs of differing plans have taught so far, to go back to (:meth:`forget_since`)."""
        return Sums([list(r) for r in self.sxx], list(self.sxy), self.pairs, self.noise_var())

    def forget_since(self, sums: Sums) -> None:
        """Forget the pairs of differing plans seen since ``sums`` were taken (steps too noisy to teach), of
        whatever length in the bucket; the noise measured since, the level and the last step stay."""
        self.sxx, self.sxy, self.pairs = [list(r) for r in sums.sxx], list(sums.sxy), sums.pairs
        self.version = next(_VERSIONS)

    # -- across restarts ------------------------------------------------------

    def export(self) -> dict[str, Any]:
        last = self.last
        return {
            "sxx": [list(r) for r in self.sxx],
            "sxy": list(self.sxy),
            "pairs": self.pairs,
            "noise": self.noise,
            "noise_pairs": self.noise_pairs,
            "level": self.level,
            "last": None if last is None else [last.step, last.seconds, list(last.features)],
        }

    @classmethod
    def restored(cls, state: Any, size: int, where: str) -> StepFit:
        if not isinstance(state, dict):
            raise ValueError(f"state: {where} must be an object, got {type(state).__name__}")
        fit = cls(size)
        sxx = state.get("sxx")
        if not isinstance(sxx, list) or len(sxx) != size:
            raise ValueError(f"state: {where}.sxx must be {size} rows of {size} numbers")
        fit.sxx = [_numbers(row, size, f"{where}.sxx", signed=True) for row in sxx]
        if any(fit.sxx[i][j] != fit.sxx[j][i] or fit.sxx[i][i] < 0 for i in range(size) for j in range(size)):
            raise ValueError(f"state: {where}.sxx must be symmetric with a non-negative diagonal")
        fit.sxy = _numbers(state.get("sxy"), size, f"{where}.sxy", signed=True)
        fit.pairs, fit.noise, fit.noise_pairs, fit.level = (
            _number(state.get(k), f"{where}.{k}") for k in ("pairs", "noise", "noise_pairs", "level")
        )
        last = state.get("last")
        if last is not None:
            if not isinstance(last, list) or len(last) != 3:
                raise ValueError(f"state: {where}.last must be [step, seconds, features] or null, got {last!r}")
            step = whole_number(last[0], f"{where}.last.step")
            seconds = _number(last[1], f"{where}.last.seconds")
            raw = last[2]
            if not isinstance(raw, list) or len(raw) != size:
                raise ValueError(f"state: {where}.last.features must be {size} block counts")
            features = tuple(whole_number(c, f"{where}.last.features") for c in raw)
            fit.last = _Last(step, seconds, features)
        return fit


class StepPrices:
    """The step-level fits of every length bucket observed (at most ``MAX_BUCKETS``, as many as the
    per-block timings keep, the least recently observed dropped first), and their posteriors, kept while
    neither fit nor prior moves."""

    def __init__(self, groups: int, modes: Sequence[Mode] = PRICED) -> None:
        self.groups = groups
        self.modes = tuple(modes)
        """The modes whose prices are fitted (those of :data:`PRICED` the profile offers), in that order."""
        self.params = params(groups, self.modes)
        """The fitted prices, in order: (mode, group)."""
        self.size = len(self.params)
        self._fits: dict[int, StepFit] = {}
        """By bucket top, the least recently observed first."""
        self._posteriors: dict[int, tuple[int, Prior, Posterior]] = {}

    def features(self, modes: Sequence[Mode]) -> tuple[int, ...]:
        return counts(modes, self.groups, self.modes)

    def fit(self, top: int) -> StepFit | None:
        return self._fits.get(top)

    @property
    def buckets(self) -> list[int]:
        return sorted(self._fits)

    def observe(self, top: int, step: int, seconds: float, modes: Sequence[Mode], prior: Prior) -> None:
        fit = self._fits.pop(top, None) or StepFit(self.size)
        fit.observe(step, seconds, self.features(modes), prior)
        self._fits[top] = fit
        while len(self._fits) > MAX_BUCKETS:
            gone = next(iter(self._fits))
            del self._fits[gone]
            self._posteriors.pop(gone, None)

    def posterior(self, top: int, prior: Prior) -> Posterior | None:
        """The bucket's fitted prices, or None where it was never observed."""
        fit = self._fits.get(top)
        if fit is None:
            return None
        hit = self._posteriors.get(top)
        if hit is not None and hit[0] == fit.version and hit[1] == prior:
            return hit[2]
        post = fit.posterior(prior)
        self._posteriors[top] = (fit.version, prior, post)
        return post

    def offsets(self, top: int, prior: Prior) -> tuple[float, ...] | None:
        """Per fitted price, what the steps add to the per-block price (seconds a block at the top length,
        in steps of ``GRAIN`` of the prior's spread); None where the bucket's steps do not yet say enough."""
        fit = self._fits.get(top)
        post = self.posterior(top, prior)
        if fit is None or post is None or not fit.informed:
            return None
        out = []
        for c, p, s in zip(post.mean, prior.mean, prior.spread, strict=True):
            grain = GRAIN * s
            out.append(round((c - p) / grain) * grain if grain > 0 else 0.0)
        return tuple(out) if any(out) else None

    # -- across restarts ------------------------------------------------------

    def export(self) -> dict[str, Any]:
        return {
            "groups": self.groups,
            "modes": [m.label for m in self.modes],
            "buckets": [[top, f.export()] for top, f in self._fits.items()],
        }

    def restore(self, state: Any) -> None:
        """Continue from what :meth:`export` gave; ValueError naming the field, these left as they were,
        for anything else (a state fitted with another number of groups included)."""
        if not isinstance(state, dict):
            raise ValueError(f"state: step_prices must be an object, got {type(state).__name__}")
        if state.get("groups") != self.groups:
            raise ValueError(
                f"state: step_prices.groups is {state.get('groups')!r}, this planner fits {self.groups} "
                "groups (set price_groups to match)"
            )
        # A state from before the fitted modes were saved fitted the four modes priced then.
        labels = state.get("modes", ["selective", "recompute", "offload", "compress"])
        if labels != [m.label for m in self.modes]:
            raise ValueError(
                f"state: step_prices.modes is {labels!r}, this planner fits {[m.label for m in self.modes]} "
                "(its profile offers other modes)"
            )
        fits = restored_by_length(
            state.get("buckets", []),
            "step_prices.buckets",
            lambda fit, where: StepFit.restored(fit, self.size, where),
            most=MAX_BUCKETS,
        )
        self._fits, self._posteriors = fits, {}


def _number(value: Any, what: str, *, signed: bool = False) -> float:
    lo = -MAX_SUM if signed else 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= MAX_SUM:
        raise ValueError(f"state: {what} must be a finite number in [{lo:g}, {MAX_SUM:g}], got {value!r}")
    return float(value)


def _numbers(raw: Any, size: int, what: str, *, signed: bool = False) -> list[float]:
    if not isinstance(raw, list) or len(raw) != size:
        raise ValueError(f"state: {what} must be a list of {size} numbers, got {raw!r}")
    return [_number(v, what, signed=signed) for v in raw]


def _inverse(a: list[list[float]]) -> list[list[float]]:
    """The inverse of a small symmetric positive-definite matrix (Gauss-Jordan; the prior keeps it
    well conditioned)."""
    n = len(a)
    m = [[*row, *(1.0 if i == j else 0.0 for j in range(n))] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        m[col] = [v / p for v in m[col]]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col]
                m[r] = [v - f * w for v, w in zip(m[r], m[col], strict=True)]
    return [row[n:] for row in m]
