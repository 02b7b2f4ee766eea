"""The planner's vocabulary: small immutable records, validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _check_bytes(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer number of bytes, got {value!r}")


def _check_seconds(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative number of seconds, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """The shape signature of one step's input."""

    batch: int = 0
    """Sequences in the batch (0 when unknown)."""
    seq_len: int = 0
    """Tokens per sequence (0 when unknown)."""
    tokens: int = 0
    """Tokens in the batch; the quantity activation memory scales with."""

    def __post_init__(self) -> None:
        for name in ("batch", "seq_len", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"shape.{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCost:
    """What one block costs, measured at the profile's shape."""

    saved_bytes: int
    """Bytes the block saves for backward when it is stored (not recomputed)."""
    input_bytes: int
    """Bytes a checkpoint keeps for the block: its input."""
    forward_seconds: float
    """Seconds one forward of the block takes; the price of recomputing it."""

    def __post_init__(self) -> None:
        _check_bytes("saved_bytes", self.saved_bytes)
        _check_bytes("input_bytes", self.input_bytes)
        _check_seconds("forward_seconds", self.forward_seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Per-block costs of a model at one input shape."""

    blocks: tuple[BlockCost, ...]
    """One entry per checkpointable block, in execution order."""
    shape: Shape = field(default_factory=Shape)
    """The input shape the costs were measured at."""

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a profile needs at least one block")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def scaled_to(self, shape: Shape) -> Profile:
        """Costs at another shape, assuming activation bytes and time grow with tokens."""
        if not self.shape.tokens or not shape.tokens or shape.tokens == self.shape.tokens:
            return self
        ratio = shape.tokens / self.shape.tokens
        return Profile(
            blocks=tuple(
                BlockCost(
                    saved_bytes=int(b.saved_bytes * ratio),
                    input_bytes=int(b.input_bytes * ratio),
                    forward_seconds=b.forward_seconds * ratio,
                )
                for b in self.blocks
            ),
            shape=shape,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A checkpoint plan: which blocks recompute their activations in backward."""

    version: int
    """Increases by one each time the plan for a (job, rank) changes."""
    blocks: tuple[int, ...]
    """Indices of the blocks that recompute, ascending."""
    checkpoint_every: int
    """k when the plan is "every k-th block" (indices divisible by k); 0 for none or an irregular set."""
    predicted_peak_bytes: int
    """Predicted peak for the shape the plan was made for."""
    predicted_overhead_ratio: float
    """Predicted extra step time from recomputation, as a fraction of the step."""
    target_bytes: int
    """The memory target the plan was made to fit."""
    reason: str
    """Why the planner chose this plan, for people."""

    @property
    def checkpointed(self) -> frozenset[int]:
        return frozenset(self.blocks)

    def same_choice(self, other: Plan | None) -> bool:
        return other is not None and other.blocks == self.blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class StepObservation:
    """What a rank measured over one training step."""

    step: int
    """The step number, increasing."""
    peak_bytes: int
    """Peak of the budgeted quantity during the step (allocated bytes on CUDA, saved bytes on CPU)."""
    budget_bytes: int
    """The budget in force for the step."""
    static_bytes: int = 0
    """Memory held outside activations at step start (weights, grads, optimizer state)."""
    plan_version: int = 0
    """The plan version that was in force."""
    shape: Shape = field(default_factory=Shape)
    """The shape of the step's input."""
    alloc_retries: int = 0
    """Allocator retries during the step (CUDA)."""
    oom_count: int = 0
    """Cumulative out-of-memory count (CUDA)."""
    allocated_bytes: int = 0
    """Allocated bytes at the end of the step (CUDA)."""
    reserved_bytes: int = 0
    """Bytes the allocator holds at the end of the step (CUDA)."""

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"step must be a non-negative integer, got {self.step!r}")
        _check_bytes("peak_bytes", self.peak_bytes)
        _check_bytes("budget_bytes", self.budget_bytes)
        _check_bytes("static_bytes", self.static_bytes)
