"""A plan trial whose own steps are far noisier than the steps before it (another job came onto the machine for
a while) teaches the step-level prices nothing: four pairs that noisy show gains that are not there, and a fit
that took them would keep the error for many steps."""

from __future__ import annotations

import pytest

from rematd.planner import ControllerConfig, Mode
from rematd.planner.plan import ShapePlan
from rematd.planner.plan_trials import VOID_NOISE, PlanTrial, PlanTrials, void_reason
from rematd.planner.stepfit import Prior, StepFit

from .test_step_prices import FOUR, STORING_SLOW, Job, new_job

S, R = Mode.STORE, Mode.RECOMPUTE


def voids_of(job: Job) -> list[float]:
    """Filled as the job runs: for each plan trial ended, how many times the variance the fit measured before
    it its own steps' was, where that voided it (else 0)."""
    search = job.session.controller.trial_search
    end, voids = search.end, []

    def ended() -> float:
        running = search.plans.trial is not None
        ratio = end()
        if running:
            voids.append(ratio)
        return ratio

    search.end = ended  # type: ignore[method-assign]
    return voids


def burst_job(seed: int) -> tuple[Job, list[int], list[float]]:
    """A job whose steps cost what the per-block prices say (no plan is faster than theirs), their noise
    0.5% of a step, except through its first plan trial: 30%; the steps of that burst, and the trials' voids."""
    job = new_job(seed=seed, noise=0.005)
    job.storing = lambda block, seq: 0.0
    trials = job.session.controller.plan_trials
    voids = voids_of(job)
    burst = []
    for _ in range(300):
        noisy = trials.trial is not None and trials.trials == 1
        job.noise = 0.3 if noisy else 0.005
        if noisy:
            burst.append(job.step)
        job.run(1, STORING_SLOW)
    return job, burst, voids


@pytest.mark.parametrize("seed", [0, 3, 6, 7])
def test_a_trial_through_a_burst_of_load_keeps_nothing_and_teaches_nothing(seed: int) -> None:
    # Without the trial's own noise weighed, each of these seeds kept the plan tried ("measured 6-33% ± 1.1%
    # faster", the fit's noise being the quiet steps').
    job, burst, voids = burst_job(seed)
    assert len(burst) >= 4
    # The first trial (through the burst) was void: its own steps varied many times more than the quiet ones.
    assert voids[0] > 10 * VOID_NOISE, voids
    # Later trials, on steps as quiet as before the burst, are weighed as any: none void.
    assert len(voids) >= 2 and not any(voids[1:]), voids
    assert not any(" kept: measured" in r or "step times overrule" in r for r in job.reasons), job.reasons
    modes, _ = job.in_force_since(STORING_SLOW)
    assert modes.count(R) == 3  # the per-block prices' plan


def test_steps_as_noisy_as_before_void_no_trial() -> None:
    # 3% a step throughout: trials run and end on their verdicts.
    for seed in range(4):
        job = new_job(seed, noise=0.03)
        voids = voids_of(job)
        job.run(200, STORING_SLOW)
        assert voids and not any(voids), voids


def test_a_void_verdict_says_why() -> None:
    trial = PlanTrial(home=plan((S, S)), tried=plan((R, S)), started=0, saving=0.0, sd=0.0)
    reason = void_reason(trial, 25.0)
    assert reason.startswith("trial of a plan over at lengths up to 128: too noisy to tell, .. stays")
    assert "differed 5.0x as much" in reason and "taken back out of the step-level prices" in reason


def plan(modes: tuple[Mode, ...]) -> ShapePlan:
    return ShapePlan(max_seq_len=128, max_tokens=256, modes=modes, predicted_peak_bytes=1, predicted_overhead_ratio=0)


def test_a_trials_own_noise_is_each_plans_steps_one_after_the_other() -> None:
    trials = PlanTrials(ControllerConfig())
    home, tried = (S, S), (R, S)
    trials.start(PlanTrial(home=plan(home), tried=plan(tried), started=0, saving=0.0, sd=0.0))
    assert trials.own_noise() == (0.0, 0)
    trials.note(128, home, 9.0)  # before the first step of the plan tried: not the trial's
    for tried_s, home_s in ((1.0, 2.0), (1.2, 2.0), (1.0, 2.6)):
        trials.note(128, tried, tried_s)
        trials.note(128, home, home_s)
    trials.note(128, tried, 0.0)  # untimed
    noise, n = trials.own_noise()
    assert n == 4
    assert noise == pytest.approx((0.2**2 + 0.2**2 + 0.0 + 0.6**2) / 4)
    trials.stop()
    assert trials.own_noise() == (0.0, 0) and trials.sums is None


def test_a_fit_forgets_the_pairs_since_its_sums_were_taken() -> None:
    fit = StepFit(8)
    prior = Prior(mean=(0.01,) * 8, spread=(0.01,) * 8, modes=FOUR)
    step = 0
    for k in range(12):
        fit.observe(step, 1.0 + 0.01 * (k % 3), (0, 0, k % 3, 1, 0, 0, 0, 0), prior)
        step += 1
    before, mean = fit.sums(), fit.posterior(prior).mean
    version = fit.version
    for k in range(6):
        fit.observe(step, 3.0 * (k % 2), (0, 0, k % 2, 0, 0, 0, 0, 0), prior)
        step += 1
    assert fit.posterior(prior).mean != pytest.approx(mean)
    fit.forget_since(before)
    assert fit.version != version
    assert fit.posterior(prior).mean == pytest.approx(mean)
    assert fit.sums() == before
    assert VOID_NOISE > 1
