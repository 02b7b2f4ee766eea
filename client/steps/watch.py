"""What the training job's log says of its memory, in-process and against a service alike: a step over the budget,
each time, and a plan chosen where no plan fits, once per plan."""

from __future__ import annotations

import logging

from rematd.messages import StepStats
from rematd.planner import Plan

log = logging.getLogger("rematd.client")


class BudgetWatch:
    """Warns, on the training thread at a step's end, from the figures the step reports."""

    def __init__(self) -> None:
        self._said_no_fit = 0
        """The last plan version whose "no plan fits" was logged."""
        self.over_steps = 0
        """Steps measured over their budget so far."""

    def step_ended(self, stats: StepStats, peak: int, plan: Plan) -> None:
        """``stats``: the step's report; ``peak``: its peak of what the budget caps; ``plan``: the plan it ran."""
        budget = stats.budget_bytes
        if budget and peak > budget:
            self.over_steps += 1
            predicted = plan.predicted_peak_bytes
            log.warning(
                "rematd: step %d peaked at %.1f MiB, %.1f MiB (%.1f%%) over the budget of %.1f MiB (plan v%d, %s)",
                stats.step,
                peak / 2**20,
                (peak - budget) / 2**20,
                100 * (peak / budget - 1),
                budget / 2**20,
                plan.version,
                f"predicted {predicted / 2**20:.1f} MiB" if predicted else "no prediction: every block at its leanest",
            )
        if plan.version > self._said_no_fit and "no plan fits" in plan.reason:
            self._said_no_fit = plan.version
            log.warning("rematd: plan v%d: %s", plan.version, plan.reason)
