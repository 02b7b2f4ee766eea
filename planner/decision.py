"""What the controller hands the session: a change of plan, and how the table it calls for differs
from the one in force."""

from __future__ import annotations

from dataclasses import dataclass, field

from rematd.planner.plan import ShapePlan
from rematd.planner.units import Mode


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """A change of plan the controller asks for."""

    modes: tuple[Mode, ...]
    """Modes for the shape just observed (or the profile's shape)."""
    table: tuple[ShapePlan, ...]
    """The plan table."""
    predicted_peak_bytes: int
    predicted_overhead_ratio: float
    target_bytes: int
    reason: str
    verdict: bool = False
    """A trial's verdict: made a plan, its reason said, even where the modes and table stay as they were (what
    the steps ran and why, in the plans' history, agrees with them)."""


@dataclass(slots=True)
class Moves:
    """How the table the step's measurements call for differs from the one in force, by length."""

    current: dict[int, ShapePlan]
    desired: dict[int, ShapePlan]
    tighter: list[int] = field(default_factory=list)
    looser: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)

    def table(self, take: list[int]) -> tuple[ShapePlan, ...]:
        """The desired entries at ``take`` and at new lengths, the current ones elsewhere."""
        return tuple(
            entry if seq in take or seq in self.new else self.current.get(seq, entry)
            for seq, entry in self.desired.items()
        )
