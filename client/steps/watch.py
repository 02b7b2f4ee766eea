"""What the training job's log says of its memory, in-process and against a service alike: a step over the budget,
each time, and a plan chosen where no plan fits, once per plan."""

from __future__ import annotations

import logging
from collections.abc import Callable

from rematd.client.service.step_record import StepRecord
from rematd.planner import Plan, Shape

log = logging.getLogger("rematd.client")


class BudgetWatch:
    """Warns, on the training thread at a step's end, from the figures the step reports."""

    def __init__(self) -> None:
        self._said_no_fit = 0
        """The last plan version whose "no plan fits" was logged."""
        self._looked: tuple[int, Shape] | None = None
        """The plan version and step shape whose plan in force was last looked at for it."""
        self.over_steps = 0
        """Steps measured over their budget so far."""

    def step_ended(self, step: StepRecord, peak: int, version: int, in_force: Callable[[], Plan]) -> None:
        """``step``: the step's figures; ``peak``: its peak of what the budget caps; ``version``: the version
        of the plan it ran, ``in_force()`` that plan (looked at only when there is something to say of it)."""
        budget = step.budget_bytes
        if budget and peak > budget:
            self.over_steps += 1
            plan = in_force()
            predicted = plan.predicted_peak_bytes
            log.warning(
                "rematd: step %d peaked at %.1f MiB, %.1f MiB (%.1f%%) over the budget of %.1f MiB (plan v%d, %s)",
                step.step,
                peak / 2**20,
                (peak - budget) / 2**20,
                100 * (peak / budget - 1),
                budget / 2**20,
                plan.version,
                f"predicted {predicted / 2**20:.1f} MiB" if predicted else "no prediction: every block at its leanest",
            )
        # A plan's reason is the planner's, for the version and its table's entry at the step's shape: looked at
        # once for each.
        looked = (version, step.shape)
        if version > self._said_no_fit and looked != self._looked:
            self._looked = looked
            plan = in_force()
            if "no plan fits" in plan.reason:
                self._said_no_fit = version  # the planner's own version (ranks that agree show the group's)
                log.warning("rematd: plan v%d: %s", plan.version, plan.reason)
