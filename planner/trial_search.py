"""Trials of plans where the step-level prices are unsure: finding a plan worth one at a table entry, and
each step of the trial in force, to its verdict (:mod:`rematd.planner.plan_trials`)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import NamedTuple

from rematd.planner.plan import ShapePlan
from rematd.planner.plan_trials import (
    EXTEND,
    MAX_LOSS,
    MIN_GAIN,
    RECHECK_AFTER,
    SURE,
    TIGHT,
    VOID_NOISE,
    Kept,
    PlanTrial,
    PlanTrials,
    disputed_reason,
    extended_reason,
    overtaken_reason,
    recheck_over_reason,
    recheck_reason,
    trial_over_reason,
    trial_reason,
    void_reason,
)
from rematd.planner.pricing import Pricing, as_corrected
from rematd.planner.reasons import human_bytes
from rematd.planner.solvers import front_loaded
from rematd.planner.step_planning import StepPlanner, loosen_limit
from rematd.planner.stepfit import CLIP, INFLATION, Posterior, StepFit, Sums, group_of
from rematd.planner.steps import StepObservation
from rematd.planner.units import Mode, Shape

TRIAL_NOISE_PAIRS = 8.0
"""Pairs of equal plans (decayed) the bucket's fit has seen before its uncertainty may start a trial."""
INFORMED = 0.5
"""A plan is tried only where its trial's differences would carry this much of what the fit already knows
of it (their precision over the fit's): its uncertainty then shrinks by a fifth or more."""
RECHECK_STEPS = 8
"""Steps at one table entry between two looks for a plan worth a trial there (each look solves a few dozen
times, tens of milliseconds on the training thread of an in-process planner)."""
MAX_IDLE_LOOKS = 3
"""Each look at an entry that finds nothing worth a trial doubles the wait before the next, up to this many
times (``RECHECK_STEPS`` << 3: 64 steps); a look that finds one, or another plan in force there, resets it."""


class Look(NamedTuple):
    """A table entry's last look for a plan worth a trial."""

    step: int
    modes: tuple[Mode, ...]
    """The plan in force there then."""
    idle: int
    """Looks in a row that found nothing worth a trial with that plan in force."""


class Candidate(NamedTuple):
    """A plan worth a trial, with what the fit expects it to save a step and that saving's standard
    deviation (fractions of a step)."""

    modes: tuple[Mode, ...]
    saving: float
    sd: float


class Handed(NamedTuple):
    """What a step of plan trials hands out: the table in force, the table the steps run, and why."""

    table: tuple[ShapePlan, ...]
    handed: list[ShapePlan]
    reason: str
    over: bool = False
    """Whether a trial ended: its verdict is a plan's reason even where the modes stay as they were."""


class TrialSearch:
    """The plan trials at the entries of a table priced by ``pricing``, whose plans ``planner`` chose."""

    def __init__(self, pricing: Pricing, planner: StepPlanner) -> None:
        self._pricing = pricing
        self._planner = planner
        self.plans = PlanTrials(pricing.config)
        """The plan on trial, if any, and what plan trials have cost."""
        self._looked: dict[int, Look] = {}

    def start(
        self,
        obs: StepObservation,
        entry: ShapePlan | None,
        target: int,
        peaks_measured: bool,
        table: tuple[ShapePlan, ...],
    ) -> Handed | None:
        """A trial of the plan that could most be faster than ``entry`` (the one the step ran with, in
        ``table``), where the fit leaves room for one and trials have not had their share; None otherwise."""
        pricing, plans = self._pricing, self.plans
        seq = entry.max_seq_len if entry is not None else 0
        if entry is None or not peaks_measured or pricing.learned.headroom_steps or not plans.may_start(seq):
            return None
        recheck = self._recheck(obs, entry, target, table)
        if recheck is not None or not self.fit_ready(seq):
            return recheck
        last, modes, idle = self._looked.get(seq, Look(-RECHECK_STEPS, entry.modes, 0))
        if modes != entry.modes:
            idle = 0
        if obs.step - last < RECHECK_STEPS << min(idle, MAX_IDLE_LOOKS):
            return None
        found = self.best_candidate(entry, target, obs.static_bytes)
        self._looked[seq] = Look(obs.step, entry.modes, 0 if found is not None else idle + 1)
        if found is None:
            return None
        tried = pricing.replaced(entry, found.modes, obs.static_bytes)
        trial = PlanTrial(home=entry, tried=tried, started=plans.steps, saving=found.saving, sd=found.sd)
        self._start(trial)
        peak = self._peak_text(tried, obs.static_bytes, target)
        return Handed(table, [tried if e is entry else e for e in table], trial_reason(trial, peak))

    def _start(self, trial: PlanTrial) -> None:
        """Put ``trial`` in force, with the fit of its length as it is now to go back to."""
        pricing = self._pricing
        top = pricing.bucket_of(trial.seq)
        fit = pricing.learned.steps.fit(top)
        self.plans.start(trial, (top, fit, fit.sums()) if fit is not None else None)

    def _peak_text(self, tried: ShapePlan, static: int, target: int) -> str:
        """The plan tried's predicted peak, as the measured peaks correct it, against the target at its length."""
        pricing, seq = self._pricing, tried.max_seq_len
        shown, as_measured = as_corrected(tried.predicted_peak_bytes, static, pricing.learned.correction(seq))
        here = human_bytes(pricing.target_at(target, seq))
        return f"predicted {human_bytes(shown)}{as_measured} of the {here} target"

    def _recheck(
        self, obs: StepObservation, entry: ShapePlan, target: int, table: tuple[ShapePlan, ...]
    ) -> Handed | None:
        """Where a trial kept the plan in force at ``entry`` and it has run ``RECHECK_AFTER`` steps there since,
        a trial of the plan it replaced against it once more (:class:`Kept`); None otherwise. A plan in force
        there other than the one kept, or a plan replaced that no longer fits, leaves nothing to check."""
        pricing, plans, seq = self._pricing, self.plans, entry.max_seq_len
        kept = plans.kept.get(seq)
        if kept is None:
            return None
        if kept.kept == entry.modes and plans.entry_steps(seq) - kept.since < RECHECK_AFTER:
            return None  # not yet
        del plans.kept[seq]
        if kept.kept != entry.modes or not pricing.fits(kept.replaced, pricing.shape(seq), target, obs.static_bytes):
            return None
        tried = pricing.replaced(entry, kept.replaced, obs.static_bytes)
        saving, sd = -kept.saving / kept.level, kept.sd / kept.level
        trial = PlanTrial(home=entry, tried=tried, started=plans.steps, saving=saving, sd=sd, recheck=kept)
        self._start(trial)
        reason = recheck_reason(trial, self._peak_text(tried, obs.static_bytes, target))
        return Handed(table, [tried if e is entry else e for e in table], reason)

    def step(self, obs: StepObservation, target: int, table: tuple[ShapePlan, ...]) -> Handed:
        """The plan trial in force, a step on: its next turn, or its end (the plan tried kept in ``table``
        where the steps found it surely faster, else the plan in force put back)."""
        pricing, plans = self._pricing, self.plans
        trial = plans.trial
        assert trial is not None
        if trial.recheck is not None and plans.ran_out:
            return self._rechecked(trial, trial.recheck, table)
        if trial.recheck is None and (plans.between or plans.ran_out):
            saving, sd = pricing.step_prices.contrast(trial.home.modes, trial.modes, trial.seq)
            level = pricing.step_prices.level(trial.seq) or 1.0
            # A trial ends early where the plan tried is surely slower, never where it looks surely faster:
            # a look after every pair would find noise surely faster more often than the 2 standard
            # deviations say, and a plan kept stays.
            if plans.ran_out or sd < TIGHT * level or saving < -SURE * sd:
                own = self._disputed(trial, saving, sd)
                if own is not None:
                    return Handed(table, list(table), self._dispute(trial, saving, sd, own), over=True)
                shape = pricing.shape(trial.seq)
                fits = pricing.fits(trial.modes, shape, target, obs.static_bytes)
                kept = saving > SURE * sd and fits
                # Short of sure but promising, and not yet known within TIGHT: the steps once more.
                if not kept and fits and EXTEND * sd < saving and sd >= TIGHT * level and plans.may_extend():
                    return self._extend(trial, saving / level, sd / level, table)
                if kept:
                    table = tuple(trial.tried if e is trial.home else e for e in table)
                    self._check_later(trial, saving, sd, level)
                self._planner.verdict(trial.home.modes, trial.modes, trial.seq, kept=kept)
                plans.over("kept" if kept else "stays")
                reason = trial_over_reason(trial, saving / level, sd / level, kept)
                return Handed(table, list(table), reason, over=True)
        return self._in_turn(trial, table, trial_reason(trial, "in turn"))

    def _in_turn(self, trial: PlanTrial, table: tuple[ShapePlan, ...], reason: str) -> Handed:
        """``table`` with the trial's next turn handed at its entry, and ``reason``."""
        turn = self.plans.turn
        handed = [turn if e is trial.home and turn is not None else e for e in table]
        return Handed(table, handed, reason)

    def _extend(self, trial: PlanTrial, saving: float, sd: float, table: tuple[ShapePlan, ...]) -> Handed:
        """The trial in force, having run its steps, found its plan ``saving`` ± ``sd`` faster (fractions of a step):
        promising, short of sure. Its steps run once more, the plan tried first, before the verdict."""
        self.plans.extend()
        return self._in_turn(trial, table, extended_reason(trial, saving, sd, self.plans.config.plan_trial_steps))

    def _check_later(self, trial: PlanTrial, saving: float, sd: float, level: float) -> None:
        """The trial in force keeps its plan, measured ``saving`` ± ``sd`` (seconds) faster on steps of
        ``level`` seconds: check it once more later (:class:`Kept`)."""
        plans, seq = self.plans, trial.seq
        record = Kept(
            replaced=trial.home.modes,
            kept=trial.modes,
            saving=saving,
            sd=sd,
            level=level,
            since=plans.entry_steps(seq),
            rollback=plans.rollback,
        )
        plans.note_kept(record, seq)

    def stands(self, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int) -> bool:
        """Whether the plan in force ``old`` at the table entry up to ``seq`` is one a trial kept there (and no
        recheck found its gain gone) against ``new`` chosen on prices: the plan it replaced or one that keeps
        no more memory than the more of the two (what the trial weighed), until the fit has outweighed the
        trial (its standard deviation of the two's difference down to ``REFUSAL_SHRINK`` of the trial's).

        A plan kept then runs alone: its steps add no pair of the two plans, only noise. A noisy stretch
        widens every deviation the fit gives for as long as the noise's decay remembers it, a burst on the
        first steps moves its means, and the plan kept would go back on prices the trial had settled, for the
        steps until the fit finds it again. Trials weigh it again (its recheck, on fresh steps, or a trial of
        another plan); a plan that keeps more than both, room the trial did not weigh, may still loosen it,
        and a tightening never waits."""
        kept = self.plans.standing.get(seq)
        if kept is None:
            return False
        pricing = self._pricing
        if kept.kept != old or self._planner.outweighs(kept.replaced, kept.sd / kept.level, old, seq):
            del self.plans.standing[seq]  # left by a tightening, or outweighed: the fit weighs it as any plan
            return False
        shape = pricing.shape(seq)
        return not (pricing.keeps_less(old, new, shape) and pricing.keeps_less(kept.replaced, new, shape))

    def void(self) -> str | None:
        """Where the plan trial in force has run all its steps and its own steps of one plan differed by more
        than ``VOID_NOISE`` times the variance the fit had measured when it started, or the fit finds the
        plan tried surely faster where the median of the trial's own pairs of steps does not bear that out
        (:meth:`_disputed`): end it, take the pairs it taught the fit back out, and say why; None otherwise
        (the trial, if any, goes on)."""
        plans = self.plans
        trial, rollback = plans.trial, plans.rollback
        if trial is None or rollback is None:
            return None
        before = rollback[2]
        noise, differences = plans.own_noise(CLIP * CLIP * before.noise_var)
        if differences >= plans.full_differences and noise > VOID_NOISE * before.noise_var:
            self._take_back("void")
            return void_reason(trial, noise / before.noise_var)
        if not plans.ran_out or trial.recheck is not None:
            return None
        saving, sd = self._pricing.step_prices.contrast(trial.home.modes, trial.modes, trial.seq)
        own = self._disputed(trial, saving, sd)
        return None if own is None else self._dispute(trial, saving, sd, own)

    def _disputed(self, trial: PlanTrial, saving: float, sd: float) -> float | None:
        """Where the fit finds the plan on trial surely faster (``saving`` a step, ``sd`` its standard
        deviation, seconds), but the median of the trial's own pairs of steps (:meth:`PlanTrials.own_gain`)
        finds it faster by less than the fit's lower bound (``SURE`` standard deviations below its mean): a
        few outlying steps made the fit's mean. Then that median (seconds); None otherwise."""
        own = self.plans.own_gain()
        if own is None or saving <= SURE * sd:
            return None
        own *= self._pricing.step_prices.from_top(trial.seq)
        return own if own < saving - SURE * sd else None

    def _dispute(self, trial: PlanTrial, saving: float, sd: float, own: float) -> str:
        """End the plan trial in force as disputed (:meth:`_disputed` found ``own``), its pairs taken back; why."""
        self._take_back("disputed")
        level = self._pricing.step_prices.level(trial.seq) or 1.0
        return disputed_reason(trial, saving / level, sd / level, own / level)

    def _take_back(self, outcome: str) -> None:
        """End the plan trial in force as ``outcome``, its pairs taken back out of the fit it started with
        (unless the bucket's fit was dropped, or restored, meanwhile)."""
        rollback = self.plans.rollback
        self._check_again_later()
        self.plans.over(outcome)
        self._forget(rollback)

    def _forget(self, rollback: tuple[int, StepFit, Sums] | None) -> None:
        """The pairs the fit of ``rollback`` has taken since its sums there, taken back out of it (unless the
        bucket's fit was dropped, or restored, meanwhile)."""
        if rollback is not None:
            top, fit, before = rollback
            if self._pricing.learned.steps.fit(top) is fit:
                fit.forget_since(before)

    def _check_again_later(self) -> None:
        """Where the trial in force is a recheck ending unweighed (void, overtaken), check the plan kept once
        more later: the steps that would have told are the ones a recheck is for."""
        plans, trial = self.plans, self.plans.trial
        if trial is not None and trial.recheck is not None:
            again = dataclasses.replace(trial.recheck, since=plans.entry_steps(trial.seq))
            plans.note_kept(again, trial.seq, trial_over=False)

    def _rechecked(self, trial: PlanTrial, kept: Kept, table: tuple[ShapePlan, ...]) -> Handed:
        """The verdict of a recheck that has run its steps: weighed by its own pairs of steps alone (the fit has
        taken the pairs of the trial that kept the plan), the gain measured then against the one that kept it,
        within ``SURE`` standard deviations of the two together. Held: the plan kept stays. Not: the plan it
        replaced comes back, and the fit goes back to its sums before that trial (the pairs of differing plans
        since, the recheck's among them, forgotten with the trial's: which of them the burst made is unknown)."""
        pricing, plans = self._pricing, self.plans
        gains = plans.own_gains()
        if not gains:  # its length stopped coming
            return self._unweighed(trial, table)
        scale = pricing.step_prices.from_top(trial.seq)
        level = kept.level
        rollback = plans.rollback
        before = rollback[2].noise_var if rollback is not None else 0.0
        noise, _ = plans.own_noise(CLIP * CLIP * before if before > 0 else math.inf)
        # Each pair's difference shares a step with the next, as the fit's do: inflated as it inflates them.
        se = scale * math.sqrt(INFLATION * max(noise, before) / len(gains))
        # The plan tried is the one replaced: the plan kept gained what the plan tried lost.
        gained = -statistics.median(gains) * scale
        sd = math.hypot(kept.sd, se)
        held = gained >= kept.saving - SURE * sd
        plans.over("held" if held else "reverted")
        if not held:
            self.plans.standing.pop(trial.seq, None)
            table = tuple(trial.tried if e is trial.home else e for e in table)
            self._forget(kept.rollback)
            self._planner.verdict(kept.replaced, kept.kept, trial.seq, kept=False)
        reason = recheck_over_reason(trial, kept.saving / level, gained / level, sd / level, held)
        return Handed(table, list(table), reason, over=True)

    def _unweighed(self, trial: PlanTrial, table: tuple[ShapePlan, ...]) -> Handed:
        self._check_again_later()
        self.plans.over("overtaken")
        return Handed(table, list(table), overtaken_reason(trial), over=True)

    def end(self) -> str | None:
        """End the plan trial in force, if any (a new table overtakes it, an out-of-memory error): void where
        :meth:`void` finds it so, else overtaken; why, None without a trial."""
        trial = self.plans.trial
        voided = self.void()
        if voided is not None or trial is None:
            return voided
        self._check_again_later()
        self.plans.over("overtaken")
        return overtaken_reason(trial)

    def fit_ready(self, seq: int) -> bool:
        """Whether the fit at ``seq``'s bucket has seen enough steps to weigh a plan trial there."""
        pricing = self._pricing
        fit = pricing.learned.steps.fit(pricing.bucket_of(seq))
        return fit is not None and fit.noise_pairs >= TRIAL_NOISE_PAIRS and pricing.step_prices.level(seq) > 0

    def best_candidate(self, entry: ShapePlan, target: int, static: int) -> Candidate | None:
        """Of the plans that fit for a trial and could be faster than ``entry`` by ``MIN_GAIN`` of a step
        (their expected saving plus ``SURE`` standard deviations), whose difference from it is not yet
        known within ``TIGHT`` and which the fit expects slower by no more than ``MAX_LOSS``, one tried
        least often here, the most promising of those (expected saving plus one standard deviation); None
        when no plan qualifies."""
        pricing, prices, steps = self._pricing, self._pricing.step_prices, self._pricing.learned.steps
        seq = entry.max_seq_len
        fit = steps.fit(pricing.bucket_of(seq))
        found = prices.posterior(seq)
        level = prices.level(seq)
        if fit is None or found is None or not self.fit_ready(seq):
            return None
        shape = pricing.shape(seq)
        # Where the peaks have settled, a plan on trial may use what a loosening may.
        slack = loosen_limit(pricing, target, seq)
        ceiling = pricing.learned.ceiling(seq)
        at = pricing.at(shape)
        # The variance of one difference of steps, as the fit takes it, at this length.
        noise = INFLATION * fit.noise_var() * prices.from_top(seq) ** 2
        best: tuple[tuple[bool, int, float], Candidate] | None = None
        # Plans the fit prices alike (the same modes per position group) are one candidate: the first
        # of them, front-loaded.
        seen = {steps.features(entry.modes)}
        in_force = at.cost(entry.modes)[0]
        for modes in self._candidates(entry.modes, shape, slack, static, *found, level):
            kept = at.cost(modes)[0]
            below = ceiling is None or kept < ceiling
            # A plan predicted to keep no more than the plan in force risks nothing it does not: it need
            # only fit as that plan does (a placement of the same modes, when the plan in force was
            # loosened up to the target).
            fits = pricing.fits(modes, shape, slack, static, pessimistic=True) or (
                kept <= in_force and pricing.fits(modes, shape, target, static)
            )
            if modes == entry.modes or not below or not fits:
                continue
            features = steps.features(modes)
            if features in seen:
                continue
            seen.add(features)
            saving, sd = prices.contrast(entry.modes, modes, seq)
            # A plan the fit finds surely faster but whose own steps never ran here, or which a trial refused
            # since they did (until outweighed), is tried whatever else the fit knows: only its steps may put
            # it in force.
            confirm = saving > SURE * sd and saving >= MIN_GAIN * level and not self._planner.may_choose(modes, seq)
            if not confirm:
                if sd < TIGHT * level or saving + SURE * sd < MIN_GAIN * level or saving < -MAX_LOSS * level:
                    continue
                # Worth it only where a trial's steps would tell much: on steps too noisy, they cannot.
                if 2 * pricing.config.plan_trial_steps * sd * sd < INFORMED * noise:
                    continue
            # Plans to confirm first, then the plans tried least here (each trial tells of its own
            # difference more than of the others'), then the most promising by one standard deviation
            # of optimism: likelier to be faster, and cheaper to try.
            rank = (confirm, -self.plans.times_tried(seq, modes), saving + sd)
            if best is None or rank > best[0]:
                best = (rank, Candidate(modes, saving / level, sd / level))
        return best[1] if best is not None else None

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
        pricing, prices = self._pricing, self._pricing.step_prices
        found = [*self._one_more(current), pricing.solve(shape, target, static).modes]
        prior = prices.prior(pricing.bucket_of(shape.seq_len))
        base = [c - p for c, p in zip(post.mean, prior.mean, strict=True)]
        usable = self._usable_modes()
        fitted = pricing.learned.steps.params
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
            found.append(pricing.solve(shape, target, static, offsets=prices.as_offsets(moved, ratio)).modes)
        # Each of them front-loaded too, first: the recomputing blocks first among blocks alike, across
        # the position groups, then within each. The per-block prices cannot tell placements apart, and
        # the fit cannot within a group, where the front-loaded plan goes first on a tie: on a CPU the
        # first blocks' stored activations wait longest and come back from memory, not from cache.
        flat = pricing.at(shape, per_block=True).options
        grouped = pricing.at(shape).options
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
        groups, n = self._pricing.config.price_groups, len(current)
        out = []
        for g in range(groups):
            first = next((i for i, m in enumerate(current) if m == Mode.STORE and group_of(i, n, groups) == g), None)
            if first is not None:
                out.append((*current[:first], Mode.RECOMPUTE, *current[first + 1 :]))
        return out

    def _usable_modes(self) -> frozenset[Mode]:
        """The modes beyond storing the solver may choose for some block."""
        profile = self._pricing.profile
        offered = {o.mode for b in profile.blocks for o in b.mode_costs()} - {Mode.STORE}
        allowed = self._pricing.config.allowed_modes
        return frozenset(offered if allowed is None else offered & allowed)
