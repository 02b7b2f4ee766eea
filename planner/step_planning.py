"""Step-level prices in the plan table: learning them from each step's time, and letting them overrule the
per-block prices only where the steps say so surely, and what the plan's reason says of it
(:mod:`rematd.planner.stepfit`; trials of plans where they are unsure: :mod:`rematd.planner.trial_search`)."""

from __future__ import annotations

import dataclasses
import math

from rematd.planner.plan import ShapePlan
from rematd.planner.plan_trials import SURE
from rematd.planner.pricing import Pricing
from rematd.planner.solvers import Choice, front_loaded
from rematd.planner.steps import StepObservation
from rematd.planner.timing import MAX_BUCKETS
from rematd.planner.units import Mode, Shape, letters

LOOSEN_SLACK = 0.97
"""A looser plan, or one on trial, must fit this fraction of the target under the worst recent correction
(the whole target where the length's peaks have settled: :func:`loosen_limit`)."""
HOLD = 1.0
"""Standard deviations by which a plan the steps chose must stay faster than the per-block prices' choice
to stay in force (it took ``SURE`` to be chosen)."""
REFUSAL_SHRINK = 0.8
"""The fraction of its standard deviation at a trial's refusal to which the fit's must fall before the fit alone
may put the plan refused in force (:meth:`StepPlanner.verdict`)."""
MAX_RAN = 256
"""Plans remembered as run per length bucket; past that, no new plan is taken as run there."""


def loosen_limit(pricing: Pricing, target: int, seq: int) -> int:
    """What a looser plan, or a plan on trial, must fit at ``seq`` under the worst recent correction: the
    target where the length's peaks have settled (their spread is then the slack, and the pessimistic
    correction holds it), else the target less ``LOOSEN_SLACK``."""
    return target if pricing.learned.settled(seq) else int(target * LOOSEN_SLACK)


class StepPlanner:
    """The plan each table entry should run, with the step-level prices of ``pricing`` in the choice."""

    def __init__(self, pricing: Pricing) -> None:
        self._pricing = pricing
        self._ran: dict[int, dict[tuple[int, ...], tuple[Mode, ...]]] = {}
        """Per length bucket, the plans (as the fit sees them: modes per position group) whose steps were
        timed there since this planner started, each with the last plan of them that ran."""
        self._refused: dict[int, dict[tuple[int, ...], tuple[tuple[Mode, ...], float]]] = {}
        """Per length bucket, the plans (as the fit sees them) whose last trial there found them not surely
        faster, or whose recheck found their gain gone, each with the plan it was weighed against and the
        standard deviation of the two's difference then, as a fraction of a step (:meth:`verdict`)."""

    def fit_seconds(self, obs: StepObservation) -> float:
        """The step's time as the step-level fit takes it, scaled to its bucket's top length (0: not timed)."""
        seq = obs.shape.seq_len
        if obs.step_seconds <= 0 or not seq:
            return 0.0
        return obs.step_seconds / self._pricing.step_prices.from_top(seq)

    def learn(self, obs: StepObservation, modes: tuple[Mode, ...] | None) -> None:
        """The step's time, scaled to its bucket's top length, into that bucket's fit; only where the plan
        that ran is known and a plan of the planner's was in force (not the profiling step)."""
        seconds = self.fit_seconds(obs)
        if modes is None or not seconds or not obs.plan_version:
            return
        prices, steps = self._pricing.step_prices, self._pricing.learned.steps
        top = self._pricing.bucket_of(obs.shape.seq_len)
        steps.observe(top, obs.step, seconds, modes, prices.prior(top))
        ran = self._ran.setdefault(top, {})
        features = steps.features(modes)
        if features in ran or len(ran) < MAX_RAN:
            ran[features] = modes
        while len(self._ran) > MAX_BUCKETS:
            gone = next(iter(self._ran))
            del self._ran[gone]
            self._refused.pop(gone, None)

    def has_run(self, modes: tuple[Mode, ...], seq: int) -> bool:
        """Whether steps of ``modes`` (or of a plan the fit prices alike) were timed in the bucket of ``seq``."""
        features = self._pricing.learned.steps.features(modes)
        return features in self._ran.get(self._pricing.bucket_of(seq), ())

    def verdict(self, home: tuple[Mode, ...], modes: tuple[Mode, ...], seq: int, *, kept: bool) -> None:
        """A trial at ``seq`` kept ``modes`` over ``home``, or refused them (it ended with ``home`` staying, or
        a recheck found their gain gone and put ``home`` back). A refused plan is put in force by the fit
        alone only once the fit knows of the two's difference materially more than when it was refused
        (:meth:`may_choose`): a fit one pair past a trial's verdict rests on that trial's evidence, and a look
        at it after every step would find noise surely faster more often than ``SURE`` says."""
        top = self._pricing.bucket_of(seq)
        features = self._pricing.learned.steps.features(modes)
        refused = self._refused.setdefault(top, {})
        if kept:
            refused.pop(features, None)
        elif features in refused or len(refused) < MAX_RAN:
            refused[features] = (home, self._relative_sd(home, modes, seq))

    def _relative_sd(self, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int) -> float:
        """The standard deviation of what ``new`` saves against ``old`` at ``seq`` by the fit, as a fraction
        of a step (infinite where the length's steps were never timed)."""
        prices = self._pricing.step_prices
        level = prices.level(seq)
        return prices.contrast(old, new, seq)[1] / level if level > 0 else math.inf

    def may_choose(self, modes: tuple[Mode, ...], seq: int) -> bool:
        """Whether the fit alone may put ``modes`` in force at ``seq``: its steps ran there (as
        :meth:`has_run`), and a trial that refused it since (:meth:`verdict`) has been outweighed, the fit's
        standard deviation of its difference from the plan then in force down to ``REFUSAL_SHRINK`` of what
        it was."""
        top = self._pricing.bucket_of(seq)
        features = self._pricing.learned.steps.features(modes)
        return features in self._ran.get(top, ()) and self._outweighed(top, features, modes, seq)

    def _outweighed(self, top: int, features: tuple[int, ...], modes: tuple[Mode, ...], seq: int) -> bool:
        """Whether no trial refused the plan of ``features`` at bucket ``top`` or the fit has since outweighed
        it (as :meth:`may_choose`)."""
        refused = self._refused.get(top, {}).get(features)
        return refused is None or self.outweighs(*refused, modes, seq)

    def outweighs(self, home: tuple[Mode, ...], sd: float, modes: tuple[Mode, ...], seq: int) -> bool:
        """Whether the fit now knows materially more of what ``modes`` save against ``home`` at ``seq`` than a
        trial whose verdict had ``sd`` (a fraction of a step) did: its standard deviation of the two's
        difference down to ``REFUSAL_SHRINK`` of that."""
        return self._relative_sd(home, modes, seq) <= REFUSAL_SHRINK * sd

    # -- overruling the per-block prices --------------------------------------

    def choose(self, shape: Shape, target: int, static: int) -> Choice:
        """The plan an entry at ``shape`` should run for ``target``: the cheapest by the step-level prices
        where the steps show it faster than the per-block prices' choice by ``SURE`` standard deviations
        of their difference and its own steps ran here; else the fastest plan whose steps ran here and
        that fits, where they show it so (:meth:`_fastest_fitting`); else the per-block prices' choice (noise
        never moves a plan)."""
        pricing = self._pricing
        seq = shape.seq_len
        if not pricing.step_prices.offsets(seq):
            return pricing.solve(shape, target, static)
        per_block = pricing.solve(shape, target, static, per_block=True)
        # Only a plan whose own steps were timed here: the fit's prices extrapolated to a plan never run
        # rest on its model of a step, not on the steps. Plans not yet run get there by a trial; so do plans
        # a trial refused, until the fit knows much more than it did (:meth:`verdict`). Where no plan
        # that ran is surely faster than the per-block choice, the fitted one cannot be (nor need be solved:
        # the fit moves every step, and this runs every step).
        faster = self._faster_ran(per_block.modes, seq)
        if not faster:
            return per_block
        fitted = pricing.solve(shape, target, static)
        if self.may_choose(fitted.modes, seq) and self.surely_faster(per_block.modes, fitted.modes, seq):
            return self.front_loaded(fitted, shape)
        # The fitted plan never ran here (a new target: a loosening, a cut), or is not surely faster: the
        # fastest of the plans that did run, rather than forget what the steps showed of them.
        return self._fastest_fitting(faster, shape, target, static, per_block)

    def _fastest_fitting(
        self, faster: list[tuple[Mode, ...]], shape: Shape, target: int, static: int, per_block: Choice
    ) -> Choice:
        """The first of ``faster`` (plans that ran, fastest first) that fits ``target`` at ``shape`` under
        the ceiling the peaks learned, as a choice; ``per_block`` where none does."""
        pricing = self._pricing
        at = pricing.at(shape)
        ceiling = pricing.learned.ceiling(shape.seq_len)
        for modes in faster:
            kept, extra = at.cost(modes)
            if (ceiling is None or kept < ceiling) and pricing.fits(modes, shape, target, static):
                found = Choice(
                    modes=modes, predicted_peak_bytes=static + at.other_bytes + kept, extra_seconds=extra, fits=True
                )
                return self.front_loaded(found, shape)
        return per_block

    def _faster_ran(self, modes: tuple[Mode, ...], seq: int) -> list[tuple[Mode, ...]]:
        """The plans that ran at ``seq``'s bucket (the last of each the fit prices alike) which the steps
        show faster than ``modes`` by ``SURE`` standard deviations (as :meth:`surely_faster`), fastest
        first; a plan a trial refused there counts only once the fit has outweighed it (:meth:`may_choose`)."""
        found = self._pricing.step_prices.posterior(seq)
        if found is None:
            return []
        post, _ratio = found
        mine = self._pricing.learned.steps.features(modes)
        faster = []
        top = self._pricing.bucket_of(seq)
        for features, ran in self._ran.get(top, {}).items():
            if not self._outweighed(top, features, ran, seq):
                continue
            saving, sd = post.contrast([a - b for a, b in zip(mine, features, strict=True)])
            if saving > SURE * sd:
                faster.append((saving, ran))
        # Stable: of plans measured alike, the one that ran first here.
        faster.sort(key=lambda t: -t[0])
        return [ran for _saving, ran in faster]

    def front_loaded(self, choice: Choice, shape: Shape) -> Choice:
        """A plan the steps chose, its recomputing blocks first within each position group where that
        brings its predicted peak no higher: the fit prices it the same, and the steps chose it because
        a mode costs the step what the per-block timings do not show, which on a CPU is storing's, more
        for the first blocks (their activations wait longest)."""
        at = self._pricing.at(shape)
        loaded = tuple(front_loaded(at.options, choice.modes))
        before, after = at.cost(choice.modes)[0], at.cost(loaded)[0]
        if loaded == choice.modes or after > before:
            return choice
        return dataclasses.replace(
            choice, modes=loaded, predicted_peak_bytes=choice.predicted_peak_bytes - before + after
        )

    def surely_faster(self, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int, sure: float = SURE) -> bool:
        """Whether the steps show ``new`` faster than ``old`` at ``seq`` by ``sure`` standard deviations."""
        if old == new:
            return False
        saving, sd = self._pricing.step_prices.contrast(old, new, seq)
        return saving > sure * sd

    def by_steps(self, modes: tuple[Mode, ...], seq: int, target: int, static: int) -> bool:
        """Whether ``modes`` differ from what the per-block prices alone choose at ``seq`` (a plan the
        step-level prices chose, priced by them)."""
        pricing = self._pricing
        if not pricing.step_prices.offsets(seq):
            return False
        return modes != pricing.solve(pricing.shape(seq), target, static, per_block=True).modes

    def held(self, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int, target: int, static: int) -> bool:
        """Whether the plan in force ``old`` stays instead of ``new`` on prices: where the steps chose it and
        still show it faster than the per-block prices' choice by ``HOLD`` standard deviations, or ``new``
        is a step-level choice they do not show surely faster than it (a plan never changes on noise, nor
        goes back and forth on the edge of being sure)."""
        if self.by_steps(old, seq, target, static):
            pricing = self._pricing
            per_block = pricing.solve(pricing.shape(seq), target, static, per_block=True).modes
            if self.surely_faster(per_block, old, seq, HOLD):
                return True
        return self.by_steps(new, seq, target, static) and not self.surely_faster(old, new, seq)

    def note(self, entry: ShapePlan, target: int, static: int) -> str:
        """Where the entry differs from what the per-block prices alone would choose there, because the
        step-level prices say otherwise: what the steps measured; else ""."""
        seq = entry.max_seq_len
        if not self.by_steps(entry.modes, seq, target, static):
            return ""
        pricing, prices = self._pricing, self._pricing.step_prices
        per_block = pricing.solve(pricing.shape(seq), target, static, per_block=True).modes
        saving, sd = prices.contrast(per_block, entry.modes, seq)
        level = prices.level(seq)
        if saving <= 0 or level <= 0:
            return ""
        return (
            f"step times overrule the per-block prices at lengths up to {seq}: {letters(entry.modes)} measured "
            f"{saving / level:.1%} ± {sd / level:.1%} faster than {letters(per_block)}, which the per-block "
            f"prices prefer ({prices.detail(seq, level)})"
        )
