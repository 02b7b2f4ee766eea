"""The controller's use of step-level prices: learning them from each step's time, letting them overrule
the per-block prices only where the steps say so surely, trials of plans where they are unsure, and what
the plan's reason says of it (:mod:`rematd.planner.stepfit`, :mod:`rematd.planner.plan_trials`)."""

from __future__ import annotations

import dataclasses
import math

from rematd.planner.config import ControllerConfig
from rematd.planner.cost import overhead_ratio
from rematd.planner.decision import Decision
from rematd.planner.model import Profile
from rematd.planner.plan import ShapePlan
from rematd.planner.plan_trials import (
    MAX_LOSS,
    MIN_GAIN,
    SURE,
    TIGHT,
    PlanTrial,
    PlanTrials,
    trial_over_reason,
    trial_reason,
)
from rematd.planner.pricing import TablePricing, as_corrected
from rematd.planner.reasons import human_bytes
from rematd.planner.shapes import Offsets
from rematd.planner.solvers import Choice, front_loaded
from rematd.planner.stepfit import INFLATION, Posterior, group_of
from rematd.planner.steps import StepObservation
from rematd.planner.timing import MAX_BUCKETS
from rematd.planner.units import Mode, Shape, letters

LOOSEN_SLACK = 0.97
"""A looser plan, or one on trial, must fit this fraction of the target under the worst recent correction."""
TRIAL_NOISE_PAIRS = 8.0
"""Pairs of equal plans (decayed) the bucket's fit has seen before its uncertainty may start a trial."""
HOLD = 1.0
"""Standard deviations by which a plan the steps chose must stay faster than the per-block prices' choice
to stay in force (it took ``SURE`` to be chosen)."""
INFORMED = 0.5
"""A plan is tried only where its trial's differences would carry this much of what the fit already knows
of it (their precision over the fit's): its uncertainty then shrinks by a fifth or more."""
MAX_RAN = 256
"""Plans remembered as run per length bucket; past that, no new plan is taken as run there."""
RECHECK_STEPS = 8
"""Steps at one table entry between two looks for a plan worth a trial there (each look solves a few dozen
times, tens of milliseconds on the training thread of an in-process planner)."""
MAX_IDLE_LOOKS = 3
"""Each look at an entry that finds nothing worth a trial doubles the wait before the next, up to this many
times (``RECHECK_STEPS`` << 3: 64 steps); a look that finds one, or another plan in force there, resets it."""


class StepPlanning(TablePricing):
    """Step-level prices in the controller's decisions."""

    def __init__(self, profile: Profile, config: ControllerConfig | None = None) -> None:
        super().__init__(profile, config)
        self._plans = PlanTrials(self.config)
        self._looked: dict[int, tuple[int, tuple[Mode, ...], int]] = {}
        """Per table entry, the step it was last looked at for a plan trial, the plan in force there then, and
        how many looks in a row found nothing worth a trial with that plan in force."""
        self._ran: dict[int, dict[tuple[int, ...], tuple[Mode, ...]]] = {}
        """Per length bucket, the plans (as the fit sees them: modes per position group) whose steps were
        timed there since this planner started, each with the last plan of them that ran."""

    @property
    def plan_trials(self) -> PlanTrials:
        """The plan on trial, if any, and what plan trials have cost."""
        return self._plans

    # -- learning -------------------------------------------------------------

    def _learn_step_time(self, obs: StepObservation, modes: tuple[Mode, ...] | None) -> None:
        """The step's time, scaled to its bucket's top length, into that bucket's fit; only where the plan
        that ran is known and a plan of the planner's was in force (not the profiling step)."""
        seq = obs.shape.seq_len
        if modes is None or obs.step_seconds <= 0 or not seq or not obs.plan_version:
            return
        top = self.bucket_of(seq)
        self._learned.steps.observe(top, obs.step, obs.step_seconds / self._from_top(seq), modes, self._prior(top))
        ran = self._ran.setdefault(top, {})
        features = self._learned.steps.features(modes)
        if features in ran or len(ran) < MAX_RAN:
            ran[features] = modes
        while len(self._ran) > MAX_BUCKETS:
            del self._ran[next(iter(self._ran))]

    def _has_run(self, modes: tuple[Mode, ...], seq: int) -> bool:
        """Whether steps of ``modes`` (or of a plan the fit prices alike) were timed in the bucket of ``seq``."""
        return self._learned.steps.features(modes) in self._ran.get(self.bucket_of(seq), ())

    def _level(self, seq: int) -> float:
        """A step's time at ``seq`` by the fit of its bucket (0 where never timed)."""
        fit = self._learned.steps.fit(self.bucket_of(seq)) if seq else None
        return fit.level * self._from_top(seq) if fit is not None else 0.0

    # -- overruling the per-block prices --------------------------------------

    def _choose(self, shape: Shape, target: int, static: int) -> Choice:
        """The plan an entry at ``shape`` should run for ``target``: the cheapest by the step-level prices
        where the steps show it faster than the per-block prices' choice by ``SURE`` standard deviations
        of their difference and its own steps ran here; else the fastest plan whose steps ran here and
        that fits, where they show it so (:meth:`_fastest_fitting`); else the per-block prices' choice (noise
        never moves a plan)."""
        seq = shape.seq_len
        if not self._offsets(seq):
            return self._solve_at(shape, target, static)
        per_block = self._solve_at(shape, target, static, per_block=True)
        # Only a plan whose own steps were timed here: the fit's prices extrapolated to a plan never run
        # rest on its model of a step, not on the steps. Plans not yet run get there by a trial. Where no plan
        # that ran is surely faster than the per-block choice, the fitted one cannot be (nor need be solved:
        # the fit moves every step, and this runs every step).
        faster = self._faster_ran(per_block.modes, seq)
        if not faster:
            return per_block
        fitted = self._solve_at(shape, target, static)
        if self._has_run(fitted.modes, seq) and self._surely_faster(per_block.modes, fitted.modes, seq):
            return self._front_loaded(fitted, shape)
        # The fitted plan never ran here (a new target: a loosening, a cut), or is not surely faster: the
        # fastest of the plans that did run, rather than forget what the steps showed of them.
        return self._fastest_fitting(faster, shape, target, static, per_block)

    def _fastest_fitting(
        self, faster: list[tuple[Mode, ...]], shape: Shape, target: int, static: int, per_block: Choice
    ) -> Choice:
        """The first of ``faster`` (plans that ran, fastest first) that fits ``target`` at ``shape`` under
        the ceiling the peaks learned, as a choice; ``per_block`` where none does."""
        at = self._at(shape)
        ceiling = self._learned.ceiling(shape.seq_len)
        for modes in faster:
            kept, extra = at.cost(modes)
            if (ceiling is None or kept < ceiling) and self._fits(modes, shape, target, static):
                found = Choice(
                    modes=modes, predicted_peak_bytes=static + at.other_bytes + kept, extra_seconds=extra, fits=True
                )
                return self._front_loaded(found, shape)
        return per_block

    def _faster_ran(self, modes: tuple[Mode, ...], seq: int) -> list[tuple[Mode, ...]]:
        """The plans that ran at ``seq``'s bucket (the last of each the fit prices alike) which the steps
        show faster than ``modes`` by ``SURE`` standard deviations (as :meth:`_surely_faster`), fastest
        first."""
        found = self._posterior(seq)
        if found is None:
            return []
        post, _ratio = found
        mine = self._learned.steps.features(modes)
        faster = []
        for features, ran in self._ran.get(self.bucket_of(seq), {}).items():
            saving, sd = post.contrast([a - b for a, b in zip(mine, features, strict=True)])
            if saving > SURE * sd:
                faster.append((saving, ran))
        # Stable: of plans measured alike, the one that ran first here.
        faster.sort(key=lambda t: -t[0])
        return [ran for _saving, ran in faster]

    def _front_loaded(self, choice: Choice, shape: Shape) -> Choice:
        """A plan the steps chose, its recomputing blocks first within each position group where that
        brings its predicted peak no higher: the fit prices it the same, and the steps chose it because
        a mode costs the step what the per-block timings do not show, which on a CPU is storing's, more
        for the first blocks (their activations wait longest)."""
        at = self._at(shape)
        loaded = tuple(front_loaded(at.options, choice.modes))
        before, after = at.cost(choice.modes)[0], at.cost(loaded)[0]
        if loaded == choice.modes or after > before:
            return choice
        return dataclasses.replace(
            choice, modes=loaded, predicted_peak_bytes=choice.predicted_peak_bytes - before + after
        )

    def _surely_faster(self, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int, sure: float = SURE) -> bool:
        """Whether the steps show ``new`` faster than ``old`` at ``seq`` by ``sure`` standard deviations."""
        if old == new:
            return False
        saving, sd = self._contrast(old, new, seq)
        return saving > sure * sd

    def _by_steps(self, modes: tuple[Mode, ...], seq: int, target: int, static: int) -> bool:
        """Whether ``modes`` differ from what the per-block prices alone choose at ``seq`` (a plan the
        step-level prices chose, priced by them)."""
        if not self._offsets(seq):
            return False
        return modes != self._solve_at(self._shape(seq), target, static, per_block=True).modes

    def _held(self, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int, target: int, static: int) -> bool:
        """Whether the plan in force ``old`` stays instead of ``new`` on prices: where the steps chose it and
        still show it faster than the per-block prices' choice by ``HOLD`` standard deviations, or ``new``
        is a step-level choice they do not show surely faster than it (a plan never changes on noise, nor
        goes back and forth on the edge of being sure)."""
        if self._by_steps(old, seq, target, static):
            per_block = self._solve_at(self._shape(seq), target, static, per_block=True).modes
            if self._surely_faster(per_block, old, seq, HOLD):
                return True
        return self._by_steps(new, seq, target, static) and not self._surely_faster(old, new, seq)

    def _step_note(self, entry: ShapePlan, target: int, static: int) -> str:
        """Where the entry differs from what the per-block prices alone would choose there, because the
        step-level prices say otherwise: what the steps measured; else ""."""
        seq = entry.max_seq_len
        if not self._by_steps(entry.modes, seq, target, static):
            return ""
        per_block = self._solve_at(self._shape(seq), target, static, per_block=True).modes
        saving, sd = self._contrast(per_block, entry.modes, seq)
        level = self._level(seq)
        if saving <= 0 or level <= 0:
            return ""
        return (
            f"step times overrule the per-block prices at lengths up to {seq}: {letters(entry.modes)} measured "
            f"{saving / level:.1%} ± {sd / level:.1%} faster than {letters(per_block)}, which the per-block "
            f"prices prefer ({self._price_detail(seq, level)})"
        )

    def _price_detail(self, seq: int, level: float) -> str:
        """The step-level prices that moved most at ``seq``, against the per-block ones, per block as a
        fraction of the step: e.g. "recompute on blocks 0-5 -0.4% by step times, +2.9% per block"."""
        found = self._posterior(seq)
        if found is None:
            return ""
        post, ratio = found
        prior = self._prior(self.bucket_of(seq))
        groups, n = self.config.price_groups, self.profile.num_blocks
        fitted = zip(self._learned.steps.params, post.mean, prior.mean, strict=True)
        moved = sorted(((abs(c - p), mode, g, c, p) for (mode, g), c, p in fitted), key=lambda t: -t[0])
        parts = []
        for _d, mode, g, c, p in moved[:2]:
            lo, hi = -(-g * n // groups), -(-(g + 1) * n // groups) - 1
            parts.append(
                f"{mode.label} on blocks {lo}-{hi} {c * ratio / level:+.1%} a block by step times, "
                f"{p * ratio / level:+.1%} by per-block timing"
            )
        return "; ".join(parts)

    def step_shares(self, top: int) -> dict[Mode, tuple[tuple[float, ...], tuple[float, ...]]]:
        """Per mode, per position group: what a block in that mode adds to a step at the bucket of ``top``
        by the step-level fit, and by the per-block prices, as fractions of the step; {} where the steps
        there do not yet move any price."""
        found = self._posterior(top)
        level = self._level(top)
        if found is None or level <= 0 or not self._offsets(top):
            return {}
        post, ratio = found
        prior = self._prior(self.bucket_of(top))
        out: dict[Mode, tuple[list[float], list[float]]] = {}
        for (mode, _g), c, p in zip(self._learned.steps.params, post.mean, prior.mean, strict=True):
            step, block = out.setdefault(mode, ([], []))
            step.append(round(c * ratio / level, 6))
            block.append(round(p * ratio / level, 6))
        return {m: (tuple(s), tuple(b)) for m, (s, b) in out.items()}

    # -- trials of plans ------------------------------------------------------

    def _start_plan_trial(
        self, obs: StepObservation, entry: ShapePlan | None, target: int, peaks_measured: bool
    ) -> Decision | None:
        """A trial of the plan that could most be faster than ``entry`` (the one the step ran with), where
        the fit leaves room for one and trials have not had their share; None otherwise."""
        plans = self._plans
        seq = entry.max_seq_len if entry is not None else 0
        if entry is None or not peaks_measured or self._learned.headroom_steps or not plans.may_start(seq):
            return None
        if not self._fit_ready(seq):
            return None
        last, modes, idle = self._looked.get(seq, (-RECHECK_STEPS, entry.modes, 0))
        if modes != entry.modes:
            idle = 0
        if obs.step - last < RECHECK_STEPS << min(idle, MAX_IDLE_LOOKS):
            return None
        found = self._best_candidate(entry, target, obs.static_bytes)
        self._looked[seq] = (obs.step, entry.modes, 0 if found is not None else idle + 1)
        if found is None:
            return None
        modes, saving, sd = found
        tried = self._replaced(entry, modes, obs.static_bytes)
        trial = PlanTrial(home=entry, tried=tried, started=plans.steps, saving=saving, sd=sd)
        plans.start(trial)
        table = [tried if e is entry else e for e in self.table]
        here = self._target_at(target, seq)
        # As the candidate was weighed: its prediction as the measured peaks correct it.
        shown, as_measured = as_corrected(tried.predicted_peak_bytes, obs.static_bytes, self._learned.correction(seq))
        peak = f"predicted {human_bytes(shown)}{as_measured} of the {human_bytes(here)} target"
        return self._decision(table, obs.shape, target, obs.static_bytes, trial_reason(trial, peak))

    def _step_plan_trial(self, obs: StepObservation, target: int) -> Decision:
        """The plan trial in force, a step on: its next turn, or its end (the plan tried kept where the steps
        found it surely faster, else the plan in force put back)."""
        plans = self._plans
        trial = plans.trial
        assert trial is not None
        static = obs.static_bytes
        if plans.between or plans.ran_out:
            saving, sd = self._contrast(trial.home.modes, trial.modes, trial.seq)
            level = self._level(trial.seq) or 1.0
            # A trial ends early where the plan tried is surely slower, never where it looks surely faster:
            # a look after every pair would find noise surely faster more often than the 2 standard
            # deviations say, and a plan kept stays.
            if plans.ran_out or sd < TIGHT * level or saving < -SURE * sd:
                plans.stop()
                kept = saving > SURE * sd and self._fits(trial.modes, self._shape(trial.seq), target, static)
                if kept:
                    self.table = tuple(trial.tried if e is trial.home else e for e in self.table)
                reason = trial_over_reason(trial, saving / level, sd / level, kept)
                return self._decision(list(self.table), obs.shape, target, static, reason)
        turn = plans.turn
        table = [turn if e is trial.home and turn is not None else e for e in self.table]
        return self._decision(table, obs.shape, target, static, trial_reason(trial, "in turn"))

    def _fit_ready(self, seq: int) -> bool:
        """Whether the fit at ``seq``'s bucket has seen enough steps to weigh a plan trial there."""
        fit = self._learned.steps.fit(self.bucket_of(seq))
        return fit is not None and fit.noise_pairs >= TRIAL_NOISE_PAIRS and self._level(seq) > 0

    def _best_candidate(
        self, entry: ShapePlan, target: int, static: int
    ) -> tuple[tuple[Mode, ...], float, float] | None:
        """Of the plans that fit for a trial and could be faster than ``entry`` by ``MIN_GAIN`` of a step
        (their expected saving plus ``SURE`` standard deviations), whose difference from it is not yet
        known within ``TIGHT`` and which the fit expects slower by no more than ``MAX_LOSS``, one tried
        least often here, the most promising of those (expected saving plus one standard deviation): its
        modes, expected saving and standard deviation (fractions of a step); None when no plan qualifies."""
        seq = entry.max_seq_len
        fit = self._learned.steps.fit(self.bucket_of(seq))
        found = self._posterior(seq)
        level = self._level(seq)
        if fit is None or found is None or not self._fit_ready(seq):
            return None
        shape = self._shape(seq)
        slack = int(target * LOOSEN_SLACK)
        ceiling = self._learned.ceiling(seq)
        at = self._at(shape)
        # The variance of one difference of steps, as the fit takes it, at this length.
        noise = INFLATION * fit.noise_var() * self._from_top(seq) ** 2
        best: tuple[tuple[bool, int, float], tuple[Mode, ...], float, float] | None = None
        # Plans the fit prices alike (the same modes per position group) are one candidate: the first
        # of them, front-loaded.
        seen = {self._learned.steps.features(entry.modes)}
        in_force = at.cost(entry.modes)[0]
        for modes in self._candidates(entry.modes, shape, slack, static, *found, level):
            kept = at.cost(modes)[0]
            below = ceiling is None or kept < ceiling
            # A plan predicted to keep no more than the plan in force risks nothing it does not: it need
            # only fit as that plan does (a placement of the same modes, when the plan in force was
            # loosened up to the target).
            fits = self._fits(modes, shape, slack, static, pessimistic=True) or (
                kept <= in_force and self._fits(modes, shape, target, static)
            )
            if modes == entry.modes or not below or not fits:
                continue
            features = self._learned.steps.features(modes)
            if features in seen:
                continue
            seen.add(features)
            saving, sd = self._contrast(entry.modes, modes, seq)
            # A plan the fit finds surely faster but whose own steps never ran here is tried whatever
            # else the fit knows: only its steps may put it in force.
            confirm = saving > SURE * sd and saving >= MIN_GAIN * level and not self._has_run(modes, seq)
            if not confirm:
                if sd < TIGHT * level or saving + SURE * sd < MIN_GAIN * level or saving < -MAX_LOSS * level:
                    continue
                # Worth it only where a trial's steps would tell much: on steps too noisy, they cannot.
                if 2 * self.config.plan_trial_steps * sd * sd < INFORMED * noise:
                    continue
            # Plans to confirm first, then the plans tried least here (each trial tells of its own
            # difference more than of the others'), then the most promising by one standard deviation
            # of optimism: likelier to be faster, and cheaper to try.
            rank = (confirm, -self._plans.times_tried(seq, modes), saving + sd)
            if best is None or rank > best[0]:
                best = (rank, modes, saving / level, sd / level)
        return best[1:] if best is not None else None

    def _candidates(
        self,
        current: tuple[Mode, ...],
        shape: Shape,
        target: int,
        static: int,
        post: Posterior,
        ratio: float,
        level: float,
    ) -> list[tuple[Mode, ...]]:
        """Plans to weigh against ``current``: per position group, ``current`` with one more block
        recomputed (the first stored one there: a small step towards leaner plans, whose trial says
        whether storing costs what the per-block prices say); the best that fits ``target`` by the fit's
        prices; the best were one mode's fitted prices lower on every group at once, or one of them
        lower or higher, by one and by ``SURE`` standard deviations, where that room is wider than
        ``TIGHT`` of a step; and ``current`` and each of those front-loaded (placement), those first."""
        found = [*self._one_more(current), self._solve_at(shape, target, static).modes]
        prior = self._prior(self.bucket_of(shape.seq_len))
        base = [c - p for c, p in zip(post.mean, prior.mean, strict=True)]
        usable = self._usable_modes()
        fitted = self._learned.steps.params
        sd = [math.sqrt(max(0.0, post.cov[k][k])) for k in range(len(fitted))]
        moves: list[dict[int, float]] = []
        for mode in usable:
            # The mode cheaper on every group at once, then on one group, or dearer on one (which moves
            # its blocks to the other groups).
            mine = [k for k, (m, _g) in enumerate(fitted) if m == mode and SURE * sd[k] * ratio >= TIGHT * level]
            for far in (1.0, SURE):
                if len(mine) > 1:
                    moves.append({k: -far * sd[k] for k in mine})
                moves.extend({k: sign * far * sd[k]} for k in mine for sign in (-1.0, 1.0))
        for move in moves:
            moved = [d + move.get(k, 0.0) for k, d in enumerate(base)]
            found.append(self._solve_at(shape, target, static, offsets=self._as_offsets(moved, ratio)).modes)
        # Each of them front-loaded too, first: the recomputing blocks first among blocks alike, across
        # the position groups, then within each. The per-block prices cannot tell placements apart, and
        # the fit cannot within a group, where the front-loaded plan goes first on a tie: on a CPU the
        # first blocks' stored activations wait longest and come back from memory, not from cache.
        flat = self._at(shape, per_block=True).options
        grouped = self._at(shape).options
        out: list[tuple[Mode, ...]] = []
        for modes in [current, *found]:
            for variant in (tuple(front_loaded(flat, modes)), tuple(front_loaded(grouped, modes)), modes):
                if variant not in out:
                    out.append(variant)
        return out

    def _one_more(self, current: tuple[Mode, ...]) -> list[tuple[Mode, ...]]:
        """Per position group, ``current`` with its first stored block there recomputed."""
        if Mode.RECOMPUTE not in self._usable_modes():
            return []
        groups, n = self.config.price_groups, len(current)
        out = []
        for g in range(groups):
            first = next((i for i, m in enumerate(current) if m == Mode.STORE and group_of(i, n, groups) == g), None)
            if first is not None:
                out.append((*current[:first], Mode.RECOMPUTE, *current[first + 1 :]))
        return out

    def _usable_modes(self) -> frozenset[Mode]:
        """The modes beyond storing the solver may choose for some block."""
        offered = {o.mode for b in self.profile.blocks for o in b.mode_costs()} - {Mode.STORE}
        allowed = self.config.allowed_modes
        return frozenset(offered if allowed is None else offered & allowed)

    def _as_offsets(self, added: list[float], ratio: float) -> Offsets:
        by_mode: dict[Mode, list[float]] = {}
        for (mode, _g), d in zip(self._learned.steps.params, added, strict=True):
            by_mode.setdefault(mode, []).append(d * ratio)
        return tuple((m, tuple(v)) for m, v in by_mode.items() if any(v))

    def _replaced(self, entry: ShapePlan, modes: tuple[Mode, ...], static: int) -> ShapePlan:
        """``entry`` running ``modes``, with their predicted peak and overhead."""
        at = self._at(self._shape(entry.max_seq_len))
        peak, extra = at.cost(modes)
        return dataclasses.replace(
            entry,
            modes=modes,
            predicted_peak_bytes=static + at.other_bytes + peak,
            predicted_overhead_ratio=overhead_ratio(extra, at.forward_seconds),
        )
