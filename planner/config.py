"""How cautiously the adaptive controller trades memory for recomputation."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rematd.planner.units import Mode


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerConfig:
    """How cautiously the controller trades memory for recomputation."""

    margin_ratio: float = 0.1
    """Fraction of the budget kept free: target = budget x (1 - margin_ratio)."""
    settled_margin_ratio: float = 0.005
    """The margin at a length whose measured peaks have settled on the model's: the last
    ``correction_window`` measured/predicted ratios there within ``settled_spread`` of each other, no
    crossing of the target above them remembered, no out-of-memory event. The margin guards against
    the prediction's error, which those measurements bound (on the CPU's accounting, to a few KiB)."""
    settled_spread: float = 0.005
    """How far apart (as a fraction) the recent measured/predicted ratios of a length may be for it to settle."""
    loosen_after_steps: int = 5
    """Consecutive steps with room for a looser plan before the plan loosens."""
    max_loosen_after_steps: int = 80
    """Upper bound of the dwell, which doubles each time a loosening is undone soon after."""
    max_correction: float = 4.0
    """Upper bound of the learned measured/predicted correction factor."""
    min_correction: float = 0.5
    """Lower bound of that factor: peaks measured below the prediction let plans use the room, this far."""
    correction_window: int = 8
    """Recent measured/predicted ratios kept per sequence-length bucket."""
    oom_correction_step: float = 1.25
    """Factor by which an out-of-memory event raises the correction of its bucket."""
    bucket_ratio: float = math.sqrt(2)
    """Ratio between the sequence lengths of neighbouring table entries."""
    max_entries: int = 16
    """Most entries of the plan table."""
    allowed_modes: frozenset[Mode] | None = None
    """Modes the planner may choose besides STORE (None: every mode the profile offers)."""
    explore_share: float = 0.05
    """Most of the steps spent on trials of modes not yet measured at a length: trial steps stay within
    ``explore_steps + explore_share x steps`` (0: never explore)."""
    explore_steps: int = 2
    """Steps one trial runs."""
    explore_blocks: int = 2
    """Blocks one trial switches to the mode it measures."""
    explore_stale_steps: int = 5000
    """Steps after which a mode measured at a length counts as unmeasured there again."""
    price_groups: int = 2
    """Groups of blocks by position (contiguous, the first blocks first) whose step-level prices are fitted
    apart: what storing costs may depend on how long a block's activations wait for its backward."""
    plan_trial_steps: int = 4
    """Steps one trial of a plan runs it, each followed by a step of the plan in force (so that the
    machine's drift falls on both alike)."""
    plan_explore_share: float = 0.1
    """Most of a table entry's steps spent running plans on trial, over its first 64 steps; beyond, of the
    square root of 64 times its steps, so that a long job's trials grow ever rarer (see
    :func:`rematd.planner.plan_trials.allowance`; 0: never try a plan; the step-level prices still learn
    from the plans that run)."""

    def __post_init__(self) -> None:
        self._check_margins()
        self._check_corrections()
        self._check_exploration()

    def _check_margins(self) -> None:
        if not 0.0 <= self.margin_ratio < 1.0:
            raise ValueError(f"margin_ratio must be in [0, 1), got {self.margin_ratio!r}")
        if not 0.0 <= self.settled_margin_ratio < 1.0:
            raise ValueError(f"settled_margin_ratio must be in [0, 1), got {self.settled_margin_ratio!r}")
        if self.settled_spread < 0.0:
            raise ValueError(f"settled_spread must be >= 0, got {self.settled_spread!r}")
        if self.loosen_after_steps < 1:
            raise ValueError(f"loosen_after_steps must be >= 1, got {self.loosen_after_steps!r}")
        if self.max_loosen_after_steps < self.loosen_after_steps:
            raise ValueError("max_loosen_after_steps must be >= loosen_after_steps")

    def _check_corrections(self) -> None:
        if self.max_correction < 1.0:
            raise ValueError(f"max_correction must be >= 1, got {self.max_correction!r}")
        if not 0.0 < self.min_correction <= 1.0:
            raise ValueError(f"min_correction must be in (0, 1], got {self.min_correction!r}")
        if self.correction_window < 1:
            raise ValueError(f"correction_window must be >= 1, got {self.correction_window!r}")
        if self.oom_correction_step <= 1.0:
            raise ValueError(f"oom_correction_step must be > 1, got {self.oom_correction_step!r}")

    def _check_exploration(self) -> None:
        if not 0.0 <= self.explore_share < 1.0:
            raise ValueError(f"explore_share must be in [0, 1), got {self.explore_share!r}")
        if not 0.0 <= self.plan_explore_share < 1.0:
            raise ValueError(f"plan_explore_share must be in [0, 1), got {self.plan_explore_share!r}")
        for name in ("explore_steps", "explore_blocks", "explore_stale_steps", "plan_trial_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 1 <= self.price_groups <= 8:
            raise ValueError(f"price_groups must be in [1, 8], got {self.price_groups!r}")
        if self.bucket_ratio <= 1.0:
            raise ValueError(f"bucket_ratio must be > 1, got {self.bucket_ratio!r}")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries!r}")

    def target_bytes(self, budget_bytes: int) -> int:
        return int(budget_bytes * (1.0 - self.margin_ratio))

    def budget_of(self, target: int) -> int:
        """The budget ``target`` keeps ``margin_ratio`` under (the inverse of :meth:`target_bytes`)."""
        return int(target / (1.0 - self.margin_ratio))

    def settled_target(self, target: int) -> int:
        """``target`` (under ``margin_ratio``) moved to ``settled_margin_ratio``: same budget, smaller margin."""
        # Never a larger margin than the one asked for: margin_ratio=0 plans to the budget from the start.
        settled = min(self.settled_margin_ratio, self.margin_ratio)
        return int(target * (1.0 - settled) / (1.0 - self.margin_ratio))
