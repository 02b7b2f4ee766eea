"""The step-level fit's prices as the plan table uses them: its prior, drawn from the per-block prices; what
its steps add to each mode's per-block price; what one plan saves a step against another; and how a plan's
reason shows them (:mod:`rematd.planner.stepfit`)."""

from __future__ import annotations

from typing import NamedTuple

from rematd.planner.config import ControllerConfig
from rematd.planner.learned import Learned
from rematd.planner.model import Profile
from rematd.planner.shapes import Offsets, Scales, at_shape
from rematd.planner.stepfit import PRIOR_SPREAD, Posterior, Prior, group_of
from rematd.planner.units import Mode, Shape

CACHED = 128
"""Priors, offsets and length ratios kept before each cache starts over."""


class PriorKey(NamedTuple):
    """What a bucket's prior depends on."""

    top: int
    batch: int
    scales: Scales


class OffsetsKey(NamedTuple):
    """What the step-level prices at a length depend on (``version``: the fit's, which moves with its steps)."""

    seq: int
    batch: int
    version: int
    scales: Scales


class RatioKey(NamedTuple):
    """A length, at a batch size."""

    seq: int
    batch: int


class StepPricing:
    """The step-level prices of one profile under what has been learned from measurements.

    ``config`` and ``learned`` are replaced, not changed, by whoever holds this (the controls, a restart)."""

    def __init__(self, profile: Profile, config: ControllerConfig, learned: Learned) -> None:
        self.profile = profile
        self.config = config
        self.learned = learned
        self._priors: dict[PriorKey, Prior] = {}
        self._offsets: dict[OffsetsKey, Offsets] = {}
        self._ratios: dict[RatioKey, float] = {}

    def _shape(self, seq: int) -> Shape:
        batch = self.learned.batch
        return Shape(batch=batch, seq_len=seq, tokens=batch * seq)

    def prior(self, top: int) -> Prior:
        """The per-block prices at the top of a bucket as the step-level fit's prior: per mode and
        position group, the mean per-block price of the group's blocks (recomputing's where a block
        does not offer the mode), give or take a block's recomputation."""
        scales = self.learned.timing.scales_at(top)
        key = PriorKey(top, self.learned.batch, scales)
        hit = self._priors.get(key)
        if hit is not None:
            return hit
        steps = self.learned.steps
        options = at_shape(self.profile, self._shape(top), None, scales, prune=False, offsets=()).options
        groups, n = self.config.price_groups, len(options)
        members: list[list[int]] = [[] for _ in range(groups)]
        for i in range(n):
            members[group_of(i, n, groups)].append(i)
        mean, spread = [], []
        for mode, g in steps.params:
            prices, recompute = [], []
            for i in members[g] or range(n):
                by_mode = {o.mode: o.seconds for o in options[i]}
                rec = by_mode.get(Mode.RECOMPUTE, max(by_mode.values()))
                prices.append(by_mode.get(mode, rec))
                recompute.append(rec)
            mean.append(sum(prices) / len(prices))
            spread.append(max(1e-9, PRIOR_SPREAD * sum(recompute) / len(recompute)))
        prior = Prior(tuple(mean), tuple(spread), groups, steps.modes)
        if len(self._priors) > CACHED:
            self._priors.clear()
        self._priors[key] = prior
        return prior

    def posterior(self, seq: int) -> tuple[Posterior, float] | None:
        """The step-level fit of the bucket of ``seq`` and the factor that takes its seconds (at the
        bucket's top) to ``seq``; None where that bucket's steps were never timed."""
        if not seq:
            return None
        top = self.learned.bucket_of(seq)
        post = self.learned.steps.posterior(top, self.prior(top))
        if post is None:
            return None
        return post, self.from_top(seq)

    def from_top(self, seq: int) -> float:
        """How a step's seconds at the top of ``seq``'s bucket scale to ``seq`` (the profile's time ratio)."""
        top = self.learned.bucket_of(seq)
        if top == seq:
            return 1.0
        key = RatioKey(seq, self.learned.batch)
        hit = self._ratios.get(key)
        if hit is None:
            hit = self.profile.time_ratio(self._shape(seq)) / self.profile.time_ratio(self._shape(top))
            if len(self._ratios) > CACHED:
                self._ratios.clear()
            self._ratios[key] = hit
        return hit

    def offsets(self, seq: int) -> Offsets:
        """What the steps at ``seq``'s bucket add to each mode's per-block price, per position group (seconds
        a block at ``seq``); () where they do not say enough yet, or agree with the per-block prices."""
        if not seq:
            return ()
        steps = self.learned.steps
        top = self.learned.bucket_of(seq)
        fit = steps.fit(top)
        if fit is None or not fit.informed:
            return ()
        key = OffsetsKey(seq, self.learned.batch, fit.version, self.learned.timing.scales_at(top))
        hit = self._offsets.get(key)
        if hit is not None:
            return hit
        added = steps.offsets(top, self.prior(top))
        out: Offsets = ()
        if added is not None:
            ratio = self.from_top(seq)
            by_mode: dict[Mode, list[float]] = {}
            for (mode, _g), d in zip(steps.params, added, strict=True):
                by_mode.setdefault(mode, []).append(round(d * ratio, 12))
            out = tuple((m, tuple(v)) for m, v in by_mode.items() if any(v))
        if len(self._offsets) > CACHED:
            self._offsets.clear()
        self._offsets[key] = out
        return out

    def as_offsets(self, added: list[float], ratio: float) -> Offsets:
        """Per-parameter seconds at a bucket's top (``added``) as offsets at a length ``ratio`` of it."""
        by_mode: dict[Mode, list[float]] = {}
        for (mode, _g), d in zip(self.learned.steps.params, added, strict=True):
            by_mode.setdefault(mode, []).append(d * ratio)
        return tuple((m, tuple(v)) for m, v in by_mode.items() if any(v))

    def contrast(self, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int) -> tuple[float, float]:
        """What running ``new`` instead of ``old`` at ``seq`` saves a step by the step-level fit, and its
        standard deviation (seconds); (0, 0) where the bucket's steps were never timed."""
        found = self.posterior(seq)
        if found is None:
            return 0.0, 0.0
        post, ratio = found
        steps = self.learned.steps
        dx = [a - b for a, b in zip(steps.features(old), steps.features(new), strict=True)]
        mean, sd = post.contrast(dx)
        return mean * ratio, sd * ratio

    def level(self, seq: int) -> float:
        """A step's time at ``seq`` by the fit of its bucket (0 where never timed)."""
        fit = self.learned.steps.fit(self.learned.bucket_of(seq)) if seq else None
        return fit.level * self.from_top(seq) if fit is not None else 0.0

    def detail(self, seq: int, level: float) -> str:
        """The step-level prices that moved most at ``seq``, against the per-block ones, per block as a
        fraction of the step: e.g. "recompute on blocks 0-5 -0.4% by step times, +2.9% per block"."""
        found = self.posterior(seq)
        if found is None:
            return ""
        post, ratio = found
        prior = self.prior(self.learned.bucket_of(seq))
        groups, n = self.config.price_groups, self.profile.num_blocks
        fitted = zip(self.learned.steps.params, post.mean, prior.mean, strict=True)
        moved = sorted(((abs(c - p), mode, g, c, p) for (mode, g), c, p in fitted), key=lambda t: -t[0])
        parts = []
        for _d, mode, g, c, p in moved[:2]:
            lo, hi = -(-g * n // groups), -(-(g + 1) * n // groups) - 1
            parts.append(
                f"{mode.label} on blocks {lo}-{hi} {c * ratio / level:+.1%} a block by step times, "
                f"{p * ratio / level:+.1%} by per-block timing"
            )
        return "; ".join(parts)

    def shares(self, top: int) -> dict[Mode, tuple[tuple[float, ...], tuple[float, ...]]]:
        """Per mode, per position group: what a block in that mode adds to a step at the bucket of ``top``
        by the step-level fit, and by the per-block prices, as fractions of the step; {} where the steps
        there do not yet move any price."""
        found = self.posterior(top)
        level = self.level(top)
        if found is None or level <= 0 or not self.offsets(top):
            return {}
        post, ratio = found
        prior = self.prior(self.learned.bucket_of(top))
        out: dict[Mode, tuple[list[float], list[float]]] = {}
        for (mode, _g), c, p in zip(self.learned.steps.params, post.mean, prior.mean, strict=True):
            step, block = out.setdefault(mode, ([], []))
            step.append(round(c * ratio / level, 6))
            block.append(round(p * ratio / level, 6))
        return {m: (tuple(s), tuple(b)) for m, (s, b) in out.items()}
