"""A plan kept by a trial is checked once more, on fresh steps, against the plan it replaced. On a loaded
machine a burst that falls on one plan's steps more than the other's passes for a gain that a trial's four
pairs cannot question (the trial is neither void, since each plan's steps agree among themselves, nor
disputed, since most of its pairs show the same gain): the recheck's own pairs find the gain gone, the plan
replaced comes back, and the fit forgets what the burst taught it. A gain that is there holds."""

from __future__ import annotations

import dataclasses

import pytest

from rematd.planner import Mode, Shape
from rematd.planner.plan import ShapePlan
from rematd.planner.plan_trials import RECHECK_AFTER, Kept, PlanTrial, recheck_over_reason
from rematd.planner.trial_search import Handed

from .test_step_prices import STORING_SLOW, Job, N, new_job, true_seconds
from .test_trial_noise import verdict_is_a_plan

S, R = Mode.STORE, Mode.RECOMPUTE
SHAPE = Shape(batch=2, seq_len=STORING_SLOW, tokens=2 * STORING_SLOW)


def biased_job(seed: int, slowed: float = 0.15) -> tuple[Job, list[tuple[bool, bool]]]:
    """A job whose steps cost what the per-block prices say (no plan is faster than theirs; noise 0.5% of a
    step), but whose plan in force ran ``slowed`` of a step slower through the first plan trial (the load came
    and went with its steps); per recheck ended, whether it held and whether the fit's sums were then those it
    had when the trial that kept the plan started."""
    job = new_job(seed=seed, noise=0.005)
    search = job.session.controller.trial_search
    trials = search.plans
    rechecked, checked = search._rechecked, []

    def recheck(trial: PlanTrial, kept: Kept, table: tuple[ShapePlan, ...]) -> Handed:
        handed = rechecked(trial, kept, table)
        assert kept.rollback is not None
        _top, fit, before = kept.rollback
        checked.append((trials.outcomes["held"] > 0, fit.sums().sxy == before.sxy and fit.pairs == before.pairs))
        return handed

    search._rechecked = recheck  # type: ignore[method-assign]
    for _ in range(400):
        trial, modes = trials.trial, job.session.plan.modes_for(SHAPE, N)
        biased = trial is not None and trials.trials == 1 and modes == trial.home.modes
        extra = slowed * true_seconds(modes, STORING_SLOW) / N if biased else 0.0
        job.storing = lambda block, seq, extra=extra: extra
        job.run(1, STORING_SLOW)
    return job, checked


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_gain_a_burst_made_does_not_hold_and_the_plan_replaced_comes_back(seed: int) -> None:
    job, checked = biased_job(seed)
    trials = job.session.controller.plan_trials
    # The burst made the first trial keep its plan: neither void nor disputed can tell.
    first = next(r for r in job.reasons if r.startswith("trial of a plan over"))
    assert " kept: measured" in first, job.reasons
    assert checked[0] == (False, True), checked  # reverted; the fit as before the burst's trial
    assert trials.outcomes["reverted"] == 1 and trials.outcomes["held"] == 0, trials.outcomes
    back = next(r for r in job.reasons if "did not hold" in r)
    verdict_is_a_plan(job, back)
    # The recheck came once the plan kept had run its steps, and put the plan replaced back.
    kept_at = job.reason_steps[job.reasons.index(first)]
    rechecked_at = next(s for r, s in zip(job.reasons, job.reason_steps, strict=True) if "once more" in r)
    assert rechecked_at - kept_at >= RECHECK_AFTER
    modes, _ = job.in_force_since(STORING_SLOW)
    assert modes.count(R) == 3  # the per-block prices' plan


def test_a_gain_that_is_there_holds_and_the_plan_kept_stays() -> None:
    # Storing truly costs 1.5 forwards at this length: recomputing every block is faster, and stays so.
    job = new_job(seed=0)
    job.run(200, STORING_SLOW)
    trials = job.session.controller.plan_trials
    assert trials.outcomes["kept"] >= 1 and trials.outcomes["held"] >= 1, trials.outcomes
    assert trials.outcomes["reverted"] == 0, trials.outcomes
    held = next(r for r in job.reasons if "its gain held" in r)
    verdict_is_a_plan(job, held)
    modes, _ = job.in_force_since(STORING_SLOW)
    assert modes == (R,) * N


def test_a_plan_kept_is_checked_once_and_not_again_after_it_held() -> None:
    job = new_job(seed=0)
    job.run(400, STORING_SLOW)
    outcomes = job.session.controller.plan_trials.outcomes
    rechecks = [r for r in job.reasons if r.startswith("trial of a plan:") and "once more" in r]
    assert 1 <= len(rechecks) == outcomes["held"] + outcomes["reverted"] <= outcomes["kept"], (rechecks, outcomes)


def test_a_recheck_verdict_says_both_measures() -> None:
    plan = ShapePlan(max_seq_len=128, max_tokens=256, modes=(R, S), predicted_peak_bytes=1, predicted_overhead_ratio=0)
    trial = PlanTrial(home=plan, tried=dataclasses.replace(plan, modes=(S, S)), started=0, saving=-0.2, sd=0.01)
    back = recheck_over_reason(trial, 0.2, -0.01, 0.02, held=False)
    assert back.startswith("trial of a plan over at lengths up to 128: .. back, the gain that kept R. did not hold")
    assert "1.0% slower on fresh steps against its trial's 20.0% faster, short by more than 2 x 2.0%" in back
    held = recheck_over_reason(trial, 0.2, 0.19, 0.02, held=True)
    assert "R. stays, its gain held: 19.0% faster on fresh steps against its trial's 20.0% faster" in held
