"""The planner's vocabulary: small immutable records, validated on creation."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


def _check_bytes(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer number of bytes, got {value!r}")


def _check_seconds(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative number of seconds, got {value!r}")


# The exponents a term may have: activations grow at most with batch^2 and seq^3.
MAX_BATCH_EXP = 2
MAX_SEQ_EXP = 3


class Mode(enum.IntEnum):
    """How a block keeps what its backward needs. Values match the wire enum."""

    STORE = 1
    """Keep every saved activation."""
    SELECTIVE = 2
    """Keep matmul and attention outputs; recompute pointwise ops in backward."""
    RECOMPUTE = 3
    """Keep only the block's input; run its forward again in backward."""
    OFFLOAD = 4
    """Copy the saved activations to host memory until backward."""


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


@dataclass(frozen=True, slots=True)
class Term:
    """Bytes at the reference shape that scale as batch^batch_exp x seq_len^seq_exp."""

    bytes: int
    batch_exp: int = 1
    seq_exp: int = 1

    def __post_init__(self) -> None:
        _check_bytes("term.bytes", self.bytes)
        if not (0 <= self.batch_exp <= MAX_BATCH_EXP and 0 <= self.seq_exp <= MAX_SEQ_EXP):
            raise ValueError(f"term exponents out of range: batch^{self.batch_exp} seq^{self.seq_exp}")


def _ratio(new: int, ref: int) -> float:
    return new / ref if new > 0 and ref > 0 else 1.0


@dataclass(frozen=True, slots=True)
class Size:
    """A byte count as a function of the input shape, measured at a reference shape."""

    terms: tuple[Term, ...] = ()

    @staticmethod
    def linear(n: int) -> Size:
        """``n`` bytes that grow with tokens (batch x sequence length)."""
        return Size((Term(n, 1, 1),)) if n else Size()

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    def at(self, ref: Shape, shape: Shape) -> int:
        if not self.terms:
            return 0
        return self.scaled(_Scale(ref, shape))

    def scaled(self, scale: _Scale) -> int:
        if not self.terms:
            return 0
        if scale.tokens_only is not None:
            return int(self.bytes * scale.tokens_only)
        table = scale.table
        return int(sum([t.bytes * table[t.batch_exp][t.seq_exp] for t in self.terms]))


class _Scale:
    """The factors that take sizes measured at ``ref`` to ``shape``, one per pair of exponents."""

    __slots__ = ("table", "tokens_only")

    def __init__(self, ref: Shape, shape: Shape) -> None:
        if not (ref.batch and ref.seq_len and shape.batch and shape.seq_len):
            # Only tokens are known: scale everything with them.
            self.tokens_only: float | None = _ratio(shape.tokens, ref.tokens)
            rb = rs = 1.0
        else:
            self.tokens_only = None
            rb, rs = _ratio(shape.batch, ref.batch), _ratio(shape.seq_len, ref.seq_len)
        self.table = tuple(tuple(rb**b * rs**q for q in range(MAX_SEQ_EXP + 1)) for b in range(MAX_BATCH_EXP + 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModeCost:
    """What a block costs in one mode, at the profile's shape."""

    mode: Mode
    """The mode."""
    kept: Size
    """Device bytes held from the block's forward until its backward."""
    transient: Size = field(default_factory=Size)
    """Extra device bytes while the block's backward runs (rematerialised activations)."""
    extra_seconds: float = 0.0
    """Step seconds the mode adds over storing, at the profile's shape."""

    def __post_init__(self) -> None:
        _check_seconds(f"{self.mode.name.lower()}.extra_seconds", self.extra_seconds)


PESSIMISTIC = (Mode.SELECTIVE, Mode.OFFLOAD)
"""Modes whose profiled seconds miss costs only a real step shows (the selective policy's dispatch in
forward and in recompute; copies that stall the device): until measured they cost at least recomputing."""


def _priced(cost: ModeCost, recompute_seconds: float) -> float:
    """The profile's price of a mode: its measured extra seconds, and for the modes in
    :data:`PESSIMISTIC` no less than recomputing the whole block (measurements then scale this price)."""
    if cost.mode in PESSIMISTIC:
        return max(cost.extra_seconds, recompute_seconds)
    return cost.extra_seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCost:
    """What one block costs, measured at the profile's shape."""

    saved_bytes: int
    """Bytes the block saves for backward when it is stored (not recomputed)."""
    input_bytes: int
    """Bytes a checkpoint keeps for the block: its input."""
    forward_seconds: float
    """Seconds one forward of the block takes; the price of recomputing it."""
    modes: tuple[ModeCost, ...] = ()
    """Measured per-mode costs; when empty, store and recompute follow from the fields above."""

    def __post_init__(self) -> None:
        _check_bytes("saved_bytes", self.saved_bytes)
        _check_bytes("input_bytes", self.input_bytes)
        _check_seconds("forward_seconds", self.forward_seconds)
        seen = [m.mode for m in self.modes]
        if len(set(seen)) != len(seen):
            raise ValueError(f"a block lists a mode twice: {[m.name for m in seen]}")
        if self.modes and Mode.STORE not in seen:
            raise ValueError("a block's modes must include STORE")

    def mode_costs(self) -> tuple[ModeCost, ...]:
        if self.modes:
            return self.modes
        return (
            ModeCost(mode=Mode.STORE, kept=Size.linear(self.saved_bytes)),
            ModeCost(
                mode=Mode.RECOMPUTE,
                kept=Size.linear(self.input_bytes),
                transient=Size.linear(self.saved_bytes),
                extra_seconds=self.forward_seconds,
            ),
        )


@dataclass(frozen=True, slots=True)
class Option:
    """One mode of one block at a concrete shape: what the solvers choose among."""

    mode: Mode
    kept: int
    transient: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Per-block costs of a model at one input shape."""

    blocks: tuple[BlockCost, ...]
    """One entry per checkpointable block, in execution order."""
    shape: Shape = field(default_factory=Shape)
    """The input shape the costs were measured at."""
    other: Size = field(default_factory=Size)
    """Activations saved outside the blocks (embeddings, head, loss): always stored."""
    _first: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Per block, the first block with equal costs: costs are computed once per class of blocks."""

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a profile needs at least one block")
        seen: dict[BlockCost, int] = {}
        object.__setattr__(self, "_first", tuple(seen.setdefault(b, i) for i, b in enumerate(self.blocks)))

    def other_at(self, shape: Shape | None = None) -> int:
        return self.other.at(self.shape, shape or self.shape)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def time_ratio(self, shape: Shape) -> float:
        """How step time scales to ``shape``: like the stored activations do."""
        scale = _Scale(self.shape, shape)
        ref = now = 0
        done: dict[int, tuple[int, int]] = {}
        for i, b in enumerate(self.blocks):
            first = self._first[i]
            if first not in done:
                store = next(m for m in b.mode_costs() if m.mode == Mode.STORE).kept
                done[first] = (store.bytes, store.scaled(scale))
            r, n = done[first]
            ref += r
            now += n
        return now / ref if ref and now else _ratio(shape.tokens, self.shape.tokens)

    def options_at(self, shape: Shape | None = None, allowed: frozenset[Mode] | None = None) -> list[list[Option]]:
        """Every block's options at ``shape`` (the profile's own when None), STORE first."""
        target = shape or self.shape
        sizes = _Scale(self.shape, target)
        tokens = _ratio(target.tokens, self.shape.tokens)
        # Equal blocks share one list of options (option lists are never mutated).
        out: list[list[Option]] = []
        for i, b in enumerate(self.blocks):
            first = self._first[i]
            if first != i:
                out.append(out[first])
                continue
            costs = sorted(b.mode_costs(), key=lambda m: (m.mode != Mode.STORE, m.mode))
            store = costs[0].kept
            store_now = store.scaled(sizes)
            # A mode's seconds scale like the block's stored activations.
            scale = store_now / store.bytes if store.bytes else tokens
            floor = next((m.extra_seconds for m in costs if m.mode == Mode.RECOMPUTE), 0.0)
            opts = [
                Option(m.mode, m.kept.scaled(sizes), m.transient.scaled(sizes), _priced(m, floor) * scale)
                for m in costs
                if allowed is None or m.mode in allowed or m.mode == Mode.STORE
            ]
            out.append(opts)
        return out

    def forward_seconds_at(self, shape: Shape | None = None) -> float:
        total = sum(b.forward_seconds for b in self.blocks)
        return total * (self.time_ratio(shape) if shape else 1.0)

    def scaled_to(self, shape: Shape) -> Profile:
        """The same costs re-expressed with ``shape`` as their reference."""
        if shape == self.shape:
            return self
        opts = self.options_at(shape)
        ratio = self.time_ratio(shape)
        blocks = []
        for b, o in zip(self.blocks, opts, strict=True):
            by_mode = {x.mode: x for x in o}
            store = by_mode[Mode.STORE]
            rec = by_mode.get(Mode.RECOMPUTE)
            blocks.append(
                BlockCost(
                    saved_bytes=store.kept,
                    input_bytes=rec.kept if rec else b.input_bytes,
                    forward_seconds=b.forward_seconds * ratio,
                    modes=tuple(
                        ModeCost(
                            mode=x.mode,
                            kept=Size.linear(x.kept),
                            transient=Size.linear(x.transient),
                            extra_seconds=x.seconds,
                        )
                        for x in o
                    ),
                )
            )
        return Profile(blocks=tuple(blocks), shape=shape, other=Size.linear(self.other_at(shape)))


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

    def block_modes(self, num_blocks: int) -> tuple[Mode, ...]:
        if self.modes:
            return self.modes
        chosen = set(self.blocks)
        return tuple(Mode.RECOMPUTE if i in chosen else Mode.STORE for i in range(num_blocks))

    def modes_for(self, shape: Shape, num_blocks: int) -> tuple[Mode, ...]:
        """The modes a step of ``shape`` runs with: the first table entry that
        covers it, the largest entry when none does, the plan's own without a table."""
        if not self.shape_plans or not shape.seq_len:
            return self.block_modes(num_blocks)
        for entry in self.shape_plans:
            if entry.covers(shape):
                return entry.modes
        return self.shape_plans[-1].modes


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
        _check_seconds("mode_seconds.seconds", self.seconds)
        _check_seconds("mode_seconds.forward_seconds", self.forward_seconds)


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
    mode_seconds: tuple[ModeSeconds, ...] = ()
    """Measured extra seconds per mode, where the client timed them."""

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"step must be a non-negative integer, got {self.step!r}")
        _check_bytes("peak_bytes", self.peak_bytes)
        _check_bytes("budget_bytes", self.budget_bytes)
        _check_bytes("static_bytes", self.static_bytes)
