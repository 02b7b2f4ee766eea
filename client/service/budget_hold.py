"""How a source of plans answers a budget cut: the in-process planner before the next step, on its thread, or a
service from later steps' statistics."""

from __future__ import annotations

import enum


class BudgetHold(enum.Enum):
    """How a source of plans answers a budget cut, and so what the steps run until it has."""

    NONE = "none"
    """Planned for before the next step starts: nothing to hold."""
    UNTIL_TAKEN = "until taken"
    """Planned for on another thread of this process: a plan not predicted to fit the cut gives way to every block
    at its leanest until the planner has taken the cut in (its plan for it, if any, already waiting)."""
    UNTIL_NEWER_PLAN = "until a newer plan"
    """Planned for elsewhere from later steps' statistics: a plan not predicted to fit the cut gives way to every
    block at its leanest until a newer plan arrives."""
