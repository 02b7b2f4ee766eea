"""Starting a trial of a mode not measured at a length: the plan in force there with a few blocks switched to
it, where that still fits with the loosening slack and under the cap an out-of-memory event set
(:mod:`rematd.planner.explore`)."""

from __future__ import annotations

from rematd.planner.explore import Explorer, Trial
from rematd.planner.plan import ShapePlan
from rematd.planner.pricing import Pricing
from rematd.planner.shapes import at_shape
from rematd.planner.step_planning import LOOSEN_SLACK
from rematd.planner.steps import StepObservation
from rematd.planner.units import Mode


def start_mode_trial(
    explorer: Explorer, pricing: Pricing, obs: StepObservation, bucket: int, entry: ShapePlan | None, target: int
) -> tuple[Trial, ShapePlan] | None:
    """A trial, started, of a mode not measured at this length on ``entry`` (the one the step ran with),
    where the budget allows one, with ``entry`` running its modes; None where none may start."""
    static = obs.static_bytes
    # Only from a settled plan that recomputes something.
    if (
        entry is None
        or pricing.learned.headroom_steps
        or not explorer.may_start()
        or all(m == Mode.STORE for m in entry.modes)
    ):
        return None
    shape = pricing.shape(entry.max_seq_len)
    options = at_shape(pricing.profile, shape, pricing.config.allowed_modes, pricing.scales(shape.seq_len)).options
    slack = int(target * LOOSEN_SLACK)
    at = pricing.at(shape)
    # Never past what an out-of-memory event capped this length at.
    ceiling = pricing.learned.ceiling(entry.max_seq_len)

    def fits(modes: tuple[Mode, ...]) -> bool:
        below = ceiling is None or at.cost(modes)[0] < ceiling
        return below and pricing.fits(modes, shape, slack, static, pessimistic=True)

    for mode in explorer.untried(bucket, {o.mode for opts in options for o in opts}, obs.step):
        trial = explorer.propose(
            seq=entry.max_seq_len,
            current=entry.modes,
            mode=mode,
            offers=lambda i, m: any(o.mode == m for o in options[i]),
            fits=fits,
        )
        if trial is None:
            continue
        explorer.start(trial)
        return trial, pricing.replaced(entry, trial.modes, static)
    return None
