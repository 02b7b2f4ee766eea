"""Bounded trials of whole plans, where the step-level prices are unsure whether another plan is faster.

The step-level fit (:mod:`rematd.planner.stepfit`) learns only from plans that run. A plan the per-block
prices rank lower (recomputing more where storing turns out to cost time, or the same blocks placed
otherwise) may be faster, and the fit cannot say so until it has run. So, where the fit leaves room for
another plan that fits to be faster than the one in force, the controller tries it: the plan tried for a
step, then the plan in force for a step, ``plan_trial_steps`` times over, so that the machine's drift
falls on both alike and each switch is measured in both directions. A trial stops early once the fit
finds the plan tried surely slower or knows their difference within ``TIGHT`` of a step, never on looking
surely faster (a look after each pair would take noise for a gain too often); the plan tried is kept
only where the fit, at the end, finds it faster, surely (``SURE`` standard deviations). Where the end finds it
faster by more than ``EXTEND`` standard deviations but short of sure, the trial runs its steps once more (once,
within the bound below): steps as noisy as a loaded machine's cannot tell a gain of a few percent in four pairs,
and a plan refused there is one the per-block prices then hold against for long. A trial whose own
steps varied far more than the steps before it (another job came onto the machine) teaches nothing: its
pairs are taken back out of the fit and the plan in force stays (:data:`VOID_NOISE`).

What trials cost is bounded: at each table entry, steps running a plan on trial stay within
``allowance(steps) + plan_trial_steps`` (:func:`allowance`; a new length has new prices to learn, then a
share of its first ``SHARE_HORIZON`` steps, then a share growing as the square root of its steps: each trial
at an entry that has tried its plans' neighbours tells less than the last, and a long job should not pay a
fixed share of every step for ever on steps too noisy to settle); a trial starts only from a settled plan,
once the entry has run ``SETTLE_STEPS`` steps (its peaks measured, the noise of its steps known), and only
with a plan whose predicted peak under the worst recent correction fits the target with the loosening slack
(:func:`rematd.planner.step_planning.loosen_limit`: none where the length's peaks have settled).
Trials end where nothing could be faster by ``MIN_GAIN`` of a step, or every candidate is known within
``TIGHT``.

A plan kept rests on a few pairs of steps, and on a loaded machine a burst that fell on one plan's steps more
than the other's can pass for a gain that the standard deviation of so few pairs does not question. So a plan
kept is checked once more, on fresh steps: once it has run ``RECHECK_AFTER`` steps at its entry, the plan it
replaced is tried against it for a trial's steps, weighed by that trial's own pairs alone (the fit has taken
the first trial's). Where the gain measured then falls short of the one that kept the plan by more than
``SURE`` standard deviations of the two together, the plan replaced comes back and the fit goes back to its sums
before the first trial (which of the pairs since a burst made is unknown); otherwise the plan kept stays, for
good.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

from rematd.planner.config import ControllerConfig
from rematd.planner.plan import ShapePlan
from rematd.planner.stepfit import MAX_GAP, StepFit, Sums
from rematd.planner.units import Mode, letters

SURE = 2.0
"""Standard deviations by which the fit must find a plan faster for it to overrule the per-block prices."""
EXTEND = 1.0
"""Standard deviations by which a trial that ran its steps must find the plan tried faster (short of ``SURE``) to
run them once more before its verdict. With no gain at all, about one trial in seven gets there; the verdict
after the second look still asks ``SURE`` of all the pairs, so a plan no faster is kept a little more often than
with one look (3.4% of trials against 2.3%, for independent Gaussian steps and a deviation that shrinks as the
square root of the pairs), a plan truly faster by 1.5 of the first look's deviations 1.7 times as often (52.5%
against 31%). The fit's deviation shrinks less where earlier trials of the same two plans taught it, and the
gain of a second look with it."""
TIGHT = 0.0025
"""A difference between two plans known within this fraction of a step needs no more trials."""
MIN_GAIN = 0.005
"""A plan that cannot be this fraction of a step faster than the one in force is not worth a trial."""
MAX_LOSS = 0.05
"""A plan the fit expects to be more than this fraction of a step slower than the one in force is never
tried, however unsure it is: what one step of a trial may be expected to cost."""
VOID_NOISE = 4.0
"""A trial is void where the differences between each plan's successive steps in it (its own noise) have a
mean square over this many times the variance the fit had measured when it started: another load came onto
the machine for its steps, whose pairs would show the fit gains or losses that are not there, kept for many
steps. Each square is clipped as the fit clips a pair of equal plans (``CLIP`` standard deviations), so one
stall voids nothing. With the noise as the fit measured it (Gaussian, independent steps), a full trial of
four pairs (six such differences) crosses this about once in 400 trials; the fit's floor and prior on the
noise make that rarer still."""
GIVE_UP_FACTOR = 4
"""A trial whose length does not come back for this many times its steps is abandoned."""
FREE_TRIALS = 2
"""Trials each table entry may run before its share of its steps counts: a new length has new prices."""
SETTLE_STEPS = 16
"""Steps a table entry runs before its first plan trial: its peaks settle, the noise of its steps shows."""
SHARE_HORIZON = 64
"""Steps of a table entry over which trials may take ``plan_explore_share`` of them; beyond, the share's
steps grow as the square root of the entry's steps."""
RECHECK_AFTER = 16
"""Steps a plan kept by a trial runs at its entry before the plan it replaced is tried against it once more."""
OUTCOMES = ("kept", "stays", "void", "disputed", "overtaken", "held", "reverted")
"""How a plan trial ends: the plan tried kept (the steps found it surely faster); the plan in force stays (they
did not); void (too noisy to tell, :data:`VOID_NOISE`) or disputed (a few outlying steps made the fit's verdict,
:meth:`PlanTrials.own_gain`), each with its steps taken back out of the fit; overtaken by a new table (a change
of length, budget or memory, an out-of-memory error). A recheck of a plan kept (:class:`Kept`) ends held (its
gain held on fresh steps) or reverted (it did not: the plan it replaced back, the fit as it was before the
trial that kept the plan), or void or overtaken as any trial."""


def allowance(steps: int, config: ControllerConfig) -> float:
    """Steps that plans on trial may have run at a table entry that has run ``steps``, before another trial
    may start there: ``FREE_TRIALS x plan_trial_steps``, plus ``plan_explore_share`` of its steps up to
    ``SHARE_HORIZON``, and of ``sqrt(SHARE_HORIZON x steps)`` beyond (0 with the share 0: no trial)."""
    share = config.plan_explore_share
    if share <= 0:
        return 0.0
    counted = steps if steps <= SHARE_HORIZON else math.sqrt(SHARE_HORIZON * steps)
    return FREE_TRIALS * config.plan_trial_steps + share * counted


@dataclass(frozen=True, slots=True, kw_only=True)
class Kept:
    """A plan kept by a trial's step times, to be checked once more against the plan it replaced."""

    replaced: tuple[Mode, ...]
    """The plan in force before the trial."""
    kept: tuple[Mode, ...]
    """The plan the trial kept."""
    saving: float
    """What the trial measured the plan kept to save a step over the plan replaced (seconds, as the fit
    prices them)."""
    sd: float
    """That saving's standard deviation (seconds)."""
    level: float
    """A step's time then (seconds, as the fit prices them): what the saving was a fraction of."""
    since: int
    """Steps its entry had run when the trial ended."""
    rollback: tuple[int, StepFit, Sums] | None
    """The fit as it was when the trial started: what a recheck that finds the gain did not hold goes back to."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanTrial:
    """A plan on trial at one table entry, in turn with the plan in force there."""

    home: ShapePlan
    """The table entry in force."""
    tried: ShapePlan
    """The same entry with the plan tried."""
    started: int
    """Steps observed when it started."""
    saving: float
    """What the fit expected it to save a step at the start, as a fraction of the step."""
    sd: float
    """That expectation's standard deviation, as a fraction of the step."""
    recheck: Kept | None = None
    """Where the plan tried is the one a trial replaced, back against the plan it kept (``home``): that trial."""

    @property
    def seq(self) -> int:
        """Longest length of the table entry."""
        return self.home.max_seq_len

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The plan tried."""
        return self.tried.modes


class PlanTrials:
    """The plan on trial, whose turn it is, and what plan trials have cost."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.trial: PlanTrial | None = None
        self.steps = 0
        """Steps observed."""
        self.trial_steps = 0
        """Steps that ran a plan on trial."""
        self.trials = 0
        """Plan trials started."""
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        """Plan trials ended so far, by how (:data:`OUTCOMES`)."""
        self._tried = 0
        self._last_tried = False
        self._length = config.plan_trial_steps
        """Steps of the plan tried the trial in force runs (``plan_trial_steps``, twice that once extended)."""
        self._per_entry: dict[int, list[int]] = {}
        """Per table entry (its longest length): [steps observed under it, steps that ran a plan on trial]."""
        self._tried_plans: dict[tuple[int, tuple[Mode, ...]], int] = {}
        """Trials run per (table entry, plan tried)."""
        self._seconds: list[tuple[bool, int, float]] = []
        """The trial's timed steps in order: whether each ran the plan tried, its step number and its time (as
        the fit takes it)."""
        self.rollback: tuple[int, StepFit, Sums] | None = None
        """The bucket of the trial's length, its fit and that fit's sums when the trial started: what a void
        trial goes back to."""
        self.kept: dict[int, Kept] = {}
        """Per table entry (its longest length), the plan a trial kept there, until it is checked once more."""
        self.standing: dict[int, Kept] = {}
        """Per table entry, the plan a trial last kept there, while it stays in force and no recheck found its
        gain gone (:meth:`rematd.planner.trial_search.TrialSearch.stands`)."""

    def note(self, entry: int, ran: tuple[Mode, ...] | None, seconds: float = 0.0, step: int = 0) -> bool:
        """Step ``step``, under the table entry up to length ``entry``, ran ``ran`` in ``seconds`` (scaled as
        the step-level fit takes them; 0: not timed); True when it ran the plan on trial."""
        self.steps += 1
        counts = self._per_entry.setdefault(entry, [0, 0])
        counts[0] += 1
        if len(self._per_entry) > 4 * self.config.max_entries:
            # Entries come and go with the lengths seen: keep the newest ones' counts.
            del self._per_entry[next(iter(self._per_entry))]
        trial = self.trial
        if trial is None or entry != trial.seq or ran is None:
            return False
        if ran == trial.modes:
            self.trial_steps += 1
            counts[1] += 1
            self._tried += 1
            self._last_tried = True
            if seconds > 0:
                self._seconds.append((True, step, seconds))
            return True
        if ran == trial.home.modes:
            self._last_tried = False
            if seconds > 0 and self._tried:
                self._seconds.append((False, step, seconds))
        return False

    def own_noise(self, clip: float) -> tuple[float, int]:
        """The mean square of the differences between each plan's successive steps in the trial (those at most
        ``MAX_GAP`` steps apart, as the fit pairs steps), each clipped at ``clip``, and how many there were."""
        squares: list[float] = []
        for tried in (True, False):
            times = [(step, t) for was, step, t in self._seconds if was is tried]
            squares.extend(min(clip, (b - a) ** 2) for (i, a), (j, b) in itertools.pairwise(times) if j - i <= MAX_GAP)
        return (sum(squares) / len(squares), len(squares)) if squares else (0.0, 0)

    def own_gains(self) -> list[float]:
        """Over the trial's successive steps that ran its two plans (at most ``MAX_GAP`` apart), the plan in
        force's step less the plan tried's (the fit's seconds, as :meth:`note` took them)."""
        return [
            (a - b) if tried_b else (b - a)
            for (tried_a, i, a), (tried_b, j, b) in itertools.pairwise(self._seconds)
            if tried_a != tried_b and j - i <= MAX_GAP
        ]

    def own_gain(self) -> float | None:
        """The median of :meth:`own_gains`: above 0 where the plan tried was the faster in most of its pairs of
        steps; None with no such pair. Heavy-tailed noise (a stall in a step or two) moves a mean, and so the
        fit, far more than it moves this."""
        gains = self.own_gains()
        return statistics.median(gains) if gains else None

    def entry_steps(self, entry: int) -> int:
        """Steps observed under the table entry up to length ``entry`` (its newest entries')."""
        return self._per_entry.get(entry, (0, 0))[0]

    def note_kept(self, kept: Kept, entry: int, *, trial_over: bool = True) -> None:
        """A trial at the table entry up to length ``entry`` kept ``kept.kept``: check it once more later, and
        where that trial has just ended (not a recheck put off), hold the plan as standing there."""
        bound = self.config.max_entries
        _put(self.kept, entry, kept, bound)
        if trial_over:
            _put(self.standing, entry, kept, bound)

    @property
    def full_differences(self) -> int:
        """How many differences :meth:`own_noise` rests on in a trial that ran ``plan_trial_steps`` steps of each
        plan: from there on, at each step, a trial is weighed for being void (an extended one, on more of them)."""
        return 2 * (self.config.plan_trial_steps - 1)

    @property
    def turn(self) -> ShapePlan | None:
        """The entry the trial's length should run next: the plan in force after a step of the plan tried,
        else the plan tried; None with no trial."""
        trial = self.trial
        if trial is None:
            return None
        return trial.home if self._last_tried else trial.tried

    @property
    def ran_out(self) -> bool:
        """Whether the trial has run its steps (the last of them followed by the plan in force), or its
        length stopped coming."""
        trial = self.trial
        if trial is None:
            return False
        return self.ran_all or self.steps - trial.started > GIVE_UP_FACTOR * 2 * self._length

    @property
    def ran_all(self) -> bool:
        """Whether the trial has run all its steps, the last of them followed by the plan in force."""
        return self.trial is not None and self._tried >= self._length and not self._last_tried

    @property
    def extended(self) -> bool:
        """Whether the trial in force runs its steps twice (:meth:`extend`)."""
        return self._length > self.config.plan_trial_steps

    def may_extend(self) -> bool:
        """Whether the trial in force, having run all its steps once, may run them once more: as a new trial could
        start, its entry's steps on trial within ``allowance(steps)`` before it, so within ``allowance(steps) +
        plan_trial_steps`` after."""
        trial = self.trial
        if trial is None or self.extended or not self.ran_all:
            return False
        return self._within_allowance(trial.seq)[1]

    def extend(self) -> None:
        """Run the trial in force's steps once more before its verdict."""
        self._length += self.config.plan_trial_steps

    @property
    def between(self) -> bool:
        """Whether the last step at the trial's entry ran the plan in force, after at least one of the plan
        tried: where the fit may be asked whether the trial has settled it."""
        return self.trial is not None and self._tried > 0 and not self._last_tried

    def may_start(self, entry: int) -> bool:
        """Whether a new trial at the table entry up to length ``entry`` keeps the steps running plans on
        trial there within ``allowance(steps) + plan_trial_steps`` of its steps there."""
        if self.config.plan_explore_share <= 0 or self.trial is not None:
            return False
        steps, within = self._within_allowance(entry)
        return steps >= SETTLE_STEPS and within

    def _within_allowance(self, entry: int) -> tuple[int, bool]:
        """(steps run at the table entry up to length ``entry``, whether its steps on trial are within
        ``allowance`` of them)."""
        steps, tried = self._per_entry.get(entry, (0, 0))
        return steps, tried <= allowance(steps, self.config)

    def start(self, trial: PlanTrial, rollback: tuple[int, StepFit, Sums] | None = None) -> None:
        self.trial, self._tried, self._last_tried = trial, 0, False
        self._seconds, self.rollback = [], rollback
        self._length = self.config.plan_trial_steps
        self.trials += 1
        key = (trial.seq, trial.modes)
        self._tried_plans[key] = self._tried_plans.get(key, 0) + 1
        if len(self._tried_plans) > 64 * self.config.max_entries:
            del self._tried_plans[next(iter(self._tried_plans))]

    def times_tried(self, entry: int, modes: tuple[Mode, ...]) -> int:
        """How many trials ``modes`` has had at the table entry up to length ``entry``."""
        return self._tried_plans.get((entry, modes), 0)

    @property
    def voided(self) -> int:
        """Plan trials void: their own steps too noisy to teach anything (:data:`VOID_NOISE`)."""
        return self.outcomes["void"]

    @property
    def disputed(self) -> int:
        """Plan trials taken back because the fit found the plan tried surely faster on average where the median
        of the trial's own pairs of steps found it faster by far less (:meth:`own_gain`)."""
        return self.outcomes["disputed"]

    def over(self, outcome: str) -> PlanTrial | None:
        """End the trial in force, counted as ``outcome`` (one of :data:`OUTCOMES`); the trial, if any."""
        if self.trial is not None:
            self.outcomes[outcome] += 1
        return self.stop()

    def stop(self) -> PlanTrial | None:
        """End the trial in force, uncounted; the trial, if any."""
        trial, self.trial = self.trial, None
        self._tried, self._last_tried = 0, False
        self._seconds, self.rollback = [], None
        return trial


def _put(records: dict[int, Kept], entry: int, kept: Kept, bound: int) -> None:
    """``kept`` as the record of ``entry``, the oldest entry's dropped beyond ``bound`` of them."""
    records[entry] = kept
    if len(records) > bound:
        del records[next(iter(records))]


def trial_reason(trial: PlanTrial, peak_text: str) -> str:
    return (
        f"trial of a plan: {letters(trial.modes)} in turn with {letters(trial.home.modes)} at lengths up to "
        f"{trial.seq}, to measure by step times whether it is faster (the fit expects "
        f"{_signed(trial.saving)} ± {trial.sd:.1%} of a step); {peak_text}"
    )


def extended_reason(trial: PlanTrial, saving: float, sd: float, more: int) -> str:
    """A trial that ran its steps found the plan tried ``saving`` ± ``sd`` faster (fractions of a step): more than
    ``EXTEND`` standard deviations, short of ``SURE``; each plan runs ``more`` steps again."""
    return trial_reason(
        trial,
        f"its steps so far measured it {_signed(saving)} ± {sd:.1%} of a step, short of sure ({SURE:g} standard "
        f"deviations), so each plan runs {more} steps more",
    )


def void_reason(trial: PlanTrial, ratio: float) -> str:
    return (
        f"trial of a plan over at lengths up to {trial.seq}: too noisy to tell, {letters(trial.home.modes)} "
        f"stays: a plan's steps in the trial differed {math.sqrt(ratio):.1f}x as much as steps had before it "
        "(another load on the machine?), so its steps are taken back out of the step-level prices"
    )


def disputed_reason(trial: PlanTrial, saving: float, sd: float, own: float) -> str:
    return (
        f"trial of a plan over at lengths up to {trial.seq}: {letters(trial.home.modes)} stays: "
        f"{letters(trial.modes)} measured {_signed(saving)} ± {sd:.1%} of a step against it on average, but "
        f"{_signed(own)} by the median of its own pairs of steps (a few outlying steps made the average), "
        "so its steps are taken back out of the step-level prices"
    )


def overtaken_reason(trial: PlanTrial) -> str:
    return (
        f"the trial of {letters(trial.modes)} in turn with {letters(trial.home.modes)} at lengths up to "
        f"{trial.seq} ends unweighed"
    )


def trial_over_reason(trial: PlanTrial, saving: float, sd: float, kept: bool) -> str:
    verdict = (
        f"{letters(trial.modes)} kept: measured {saving:.1%} ± {sd:.1%} faster by step times"
        if kept
        else f"{letters(trial.home.modes)} stays: {letters(trial.modes)} measured {_signed(saving)} ± {sd:.1%} "
        "of a step against it by step times"
    )
    return f"trial of a plan over at lengths up to {trial.seq}: {verdict}"


def _signed(saving: float) -> str:
    """A saving as people read it: "2.0% faster" or "1.5% slower"."""
    return f"{abs(saving):.1%} {'faster' if saving >= 0 else 'slower'}"


def recheck_reason(trial: PlanTrial, peak_text: str) -> str:
    return (
        f"trial of a plan: {letters(trial.modes)} in turn with {letters(trial.home.modes)} at lengths up to "
        f"{trial.seq} once more, to check on fresh steps that the plan kept is {-trial.saving:.1%} "
        f"± {trial.sd:.1%} of a step faster, as its trial measured; {peak_text}"
    )


def recheck_over_reason(trial: PlanTrial, claimed: float, gained: float, sd: float, held: bool) -> str:
    """What the trial that kept the plan measured it to save (``claimed``), what its recheck measured
    (``gained``), and the two measures' joint standard deviation (``sd``), as fractions of a step."""
    measured = f"{_signed(gained)} on fresh steps against its trial's {claimed:.1%} faster"
    if held:
        return (
            f"trial of a plan over at lengths up to {trial.seq}: {letters(trial.home.modes)} stays, its gain "
            f"held: {measured}, within {SURE:g} x {sd:.1%}"
        )
    return (
        f"trial of a plan over at lengths up to {trial.seq}: {letters(trial.modes)} back, the gain that kept "
        f"{letters(trial.home.modes)} did not hold: {measured}, short by more than {SURE:g} x {sd:.1%}; the "
        "step-level prices go back to where they were before its trial"
    )
