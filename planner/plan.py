"""Plans: the modes each block runs with, per range of input shapes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from rematd.planner.solvers import checkpoint_every_of
from rematd.planner.units import Mode, Shape


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapePlan:
    """The modes for steps whose shape is within the bounds."""

    max_seq_len: int
    """Largest sequence length the entry covers."""
    max_tokens: int
    """Largest tokens per batch the entry covers."""
    modes: tuple[Mode, ...]
    """One mode per block."""
    predicted_peak_bytes: int
    """Predicted peak at the entry's bounds."""
    predicted_overhead_ratio: float
    """Predicted recompute overhead at the entry's bounds."""

    def covers(self, shape: Shape) -> bool:
        return shape.seq_len <= self.max_seq_len and shape.tokens <= self.max_tokens


def blocks_of(modes: tuple[Mode, ...]) -> tuple[int, ...]:
    """The blocks that do not simply store: those a plan checkpoints in some way."""
    return tuple(i for i, m in enumerate(modes) if m != Mode.STORE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A checkpoint plan: how each block keeps what its backward needs."""

    version: int
    """Increases by one each time the plan for a (job, rank) changes."""
    blocks: tuple[int, ...]
    """Indices of the blocks that do not store everything, ascending."""
    checkpoint_every: int
    """k when the plan is "every k-th block recomputes" (indices divisible by k); 0 otherwise."""
    predicted_peak_bytes: int
    """Predicted peak for the shape the plan was made for."""
    predicted_overhead_ratio: float
    """Predicted extra step time from recomputation, as a fraction of the step."""
    target_bytes: int
    """The memory target the plan was made to fit."""
    reason: str
    """Why the planner chose this plan, for people."""
    modes: tuple[Mode, ...] = ()
    """One mode per block; empty means ``blocks`` recompute and the rest store."""
    shape_plans: tuple[ShapePlan, ...] = ()
    """Plans for other input shapes, ascending; see :meth:`modes_for`."""

    @property
    def checkpointed(self) -> frozenset[int]:
        return frozenset(self.blocks)

    @property
    def lossy(self) -> bool:
        """Whether some block compresses at some length: its gradients are then not bitwise storing's."""
        return any(Mode.COMPRESS in ms for ms in (self.modes, *(e.modes for e in self.shape_plans)))

    def block_modes(self, num_blocks: int) -> tuple[Mode, ...]:
        if self.modes:
            return self.modes
        chosen = set(self.blocks)
        return tuple(Mode.RECOMPUTE if i in chosen else Mode.STORE for i in range(num_blocks))

    def at(self, shape: Shape) -> Plan:
        """The plan as a step of ``shape`` runs it: its table's entry for that length in the plan's own fields
        (modes, blocks, frequency, prediction); version, target, reason and table as they were."""
        entry = entry_for(self.shape_plans, shape) if shape.seq_len else None
        if entry is None or (entry.modes == self.modes and entry.predicted_peak_bytes == self.predicted_peak_bytes):
            return self
        return self.running(
            entry.modes, predicted_peak_bytes=entry.predicted_peak_bytes, overhead=entry.predicted_overhead_ratio
        )

    def running(self, modes: tuple[Mode, ...], *, predicted_peak_bytes: int, overhead: float, why: str = "") -> Plan:
        """This plan with ``modes`` in force instead of its own (and ``why`` after its reason)."""
        return dataclasses.replace(
            self,
            blocks=blocks_of(modes),
            checkpoint_every=checkpoint_every_of(modes),
            predicted_peak_bytes=predicted_peak_bytes,
            predicted_overhead_ratio=overhead,
            modes=modes,
            reason=f"{self.reason}; {why}" if why else self.reason,
        )

    def modes_for(self, shape: Shape, num_blocks: int) -> tuple[Mode, ...]:
        """The modes a step of ``shape`` runs with: the first table entry that
        covers it, the largest entry when none does, the plan's own without a table."""
        entry = entry_for(self.shape_plans, shape) if shape.seq_len else None
        return entry.modes if entry is not None else self.block_modes(num_blocks)


def entry_for(table: Sequence[ShapePlan], shape: Shape) -> ShapePlan | None:
    """The entry of ``table`` a step of ``shape`` runs with: the first that covers it, the largest when none
    does or the length is unknown; None without a table."""
    if not table:
        return None
    if shape.seq_len:
        for entry in table:
            if entry.covers(shape):
                return entry
    return table[-1]
