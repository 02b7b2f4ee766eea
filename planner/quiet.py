"""When a rank's steady steps may be folded into fewer reports: the planner would learn nothing from each."""

from __future__ import annotations

QUIET_RISK = 0.25
"""Below this out-of-memory risk a rank's steady steps may be folded into fewer reports."""

QUIET_STEPS = 16
"""Steps a plan holds before its steady steps may be folded."""


def report_interval(
    *, steps_on_plan: int, steady: bool, oom_risk: float, quiet_steps: int, max_interval_seconds: float
) -> float:
    """How long a rank may fold steady steps into one report: the longest allowed once its plan has
    held for a while with no risk and no loosening under way; else 0, every step reported."""
    if steps_on_plan >= quiet_steps and steady and oom_risk < QUIET_RISK:
        return max_interval_seconds
    return 0.0
