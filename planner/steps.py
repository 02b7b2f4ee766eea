"""What a rank measured over one training step, as the planner takes it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from rematd.planner.records import quick
from rematd.planner.units import Mode, Shape, check_bytes, check_seconds


@quick
@dataclass(frozen=True, slots=True)
class ModeSeconds:
    """What the blocks that ran in one mode during a step measured: their extra seconds, summed."""

    mode: Mode
    blocks: int
    """Blocks timed (those whose forward and rematerialisation had both finished when read)."""
    seconds: float
    """Their rematerialisation in backward, seconds together (0 for STORE)."""
    forward_seconds: float = 0.0
    """Their forward in this mode, seconds together: with the forward of stored blocks as the
    baseline, what the mode adds in forward (checkpoint bookkeeping, the selective policy's
    dispatch, offload's copies). 0 where the client did not time forwards."""

    def __post_init__(self) -> None:
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 0:
            raise ValueError(f"mode_seconds.blocks must be a non-negative integer, got {self.blocks!r}")
        check_seconds("mode_seconds.seconds", self.seconds)
        check_seconds("mode_seconds.forward_seconds", self.forward_seconds)


@quick
@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorFigures:
    """The caching allocator's and the device's figures for one step: CUDA only, all 0 elsewhere.

    Defined once: the client's memory sample, the wire's step statistics and the planner's observation
    all carry them, and copy them with :meth:`allocator_figures`.
    """

    alloc_retries: int = 0
    """Allocator retries during the step (CUDA)."""
    oom_count: int = 0
    """Cumulative out-of-memory count (CUDA)."""
    allocated_bytes: int = 0
    """Allocated bytes at the end of the step (CUDA)."""
    reserved_bytes: int = 0
    """Bytes the allocator holds at the end of the step (CUDA)."""
    peak_reserved_bytes: int = 0
    """Most bytes the allocator held during the step (CUDA)."""
    inactive_split_bytes: int = 0
    """Bytes at the end of the step in cached blocks split for a smaller request and not in use (CUDA)."""
    free_bytes: int = 0
    """The device's free bytes at the end of the step, outside every process's allocator (CUDA)."""
    total_bytes: int = 0
    """The device's bytes (CUDA)."""

    def allocator_figures(self) -> dict[str, int]:
        """These figures by name, to build another record that carries them."""
        return {name: getattr(self, name) for name in ALLOCATOR_FIELDS}


ALLOCATOR_FIELDS = tuple(f.name for f in fields(AllocatorFigures))


@quick
@dataclass(frozen=True, slots=True, kw_only=True)
class StepObservation(AllocatorFigures):
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
    mode_seconds: tuple[ModeSeconds, ...] = ()
    """Measured extra seconds per mode, where the client timed them."""
    modes: tuple[Mode, ...] = ()
    """The mode each block ran in, when not those of the plan ``plan_version`` (pins, or a plan agreed
    between ranks); empty: the plan's."""
    step_seconds: float = 0.0
    """The step's wall-clock seconds, from its first forward to its end (a mean over steps folded into one
    report); 0 where not measured. What the step-level prices are fitted to."""
    routed_bytes: int = 0
    """Bytes a mixture of experts' routing added to the peak beyond a balanced router's (the client's measure):
    not an error of the planner's prediction."""

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"step must be a non-negative integer, got {self.step!r}")
        check_seconds("step_seconds", self.step_seconds)
        for name in _BYTE_FIELDS:
            check_bytes(name, getattr(self, name))


_BYTE_FIELDS = tuple(f.name for f in fields(StepObservation) if f.name.endswith("_bytes"))
