"""The planner's vocabulary: small immutable records, validated on creation. The cost model's records
(sizes, per-block costs, profiles); modes and shapes are in ``units``, plans in ``plan``, step observations in
``steps``."""

from __future__ import annotations

from dataclasses import dataclass, field

from rematd.planner.units import Mode, Shape, check_bytes, check_seconds

# The exponents a term may have: activations grow at most with batch^2 and seq^3.
MAX_BATCH_EXP = 2
MAX_SEQ_EXP = 3


@dataclass(frozen=True, slots=True)
class Term:
    """Bytes at the reference shape that scale as batch^batch_exp x seq_len^seq_exp."""

    bytes: int
    batch_exp: int = 1
    seq_exp: int = 1

    def __post_init__(self) -> None:
        check_bytes("term.bytes", self.bytes)
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
    fixed_seconds: float = 0.0
    """Of ``extra_seconds``, what the checkpoint's own work around the block's region costs (its hooks on each
    tensor saved, its recomputation's set-up): the same at every length, and not in what the steps time of the
    mode (its rematerialisation), so neither the shape nor the measured scales move it."""
    released: Size = field(default_factory=Size)
    """Of ``kept``, the bytes the block's backward has freed by the time it rematerialises (a part recomputed
    alone comes back after the parts that ran after it in forward let their activations go): while it
    rematerialises the block holds ``kept - released + transient``."""

    def __post_init__(self) -> None:
        name = self.mode.name.lower()
        check_seconds(f"{name}.extra_seconds", self.extra_seconds)
        check_seconds(f"{name}.fixed_seconds", self.fixed_seconds)
        if self.fixed_seconds > self.extra_seconds:
            raise ValueError(
                f"{name}.fixed_seconds ({self.fixed_seconds!r}) must not exceed {name}.extra_seconds "
                f"({self.extra_seconds!r}): it is a share of them"
            )


PESSIMISTIC = (Mode.OFFLOAD,)
"""Modes whose profiled seconds miss costs only a real step shows (copies that stall the device): until
measured they cost at least recomputing. Every other mode is priced from the profile, which times its work
op by op (an op policy's dispatch included), and the steps refine that price."""


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
    in_flight: int = 1
    """Microbatches whose activations of this block are alive at once at the peak: 1 but on a pipeline stage,
    whose schedule runs the forwards of several microbatches before the first one's backward."""
    stage: int = 0
    """On a rank that runs several pipeline stages, which of them the block runs in, in the order a microbatch's
    forward runs them: its backward runs the later stages first, and releases what a stage's blocks keep only as
    it passes them."""

    def __post_init__(self) -> None:
        if isinstance(self.in_flight, bool) or not isinstance(self.in_flight, int) or self.in_flight < 1:
            raise ValueError(f"in_flight must be a positive integer, got {self.in_flight!r}")
        check_bytes("saved_bytes", self.saved_bytes)
        check_bytes("input_bytes", self.input_bytes)
        check_seconds("forward_seconds", self.forward_seconds)
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
    """Bytes one microbatch keeps from the block's forward to its backward."""
    transient: int
    """Bytes the block brings back while its backward runs."""
    seconds: float
    others: int = 0
    """Bytes the other microbatches alive at once keep for the block (on a pipeline stage): held at every
    moment of the backward of the one whose backward runs."""
    stage: int = 0
    """The pipeline stage of the rank the block runs in (:attr:`BlockCost.stage`)."""
    group: int = 0
    """The block's position group where step-level prices tell groups apart (0 elsewhere): the solvers
    pool seconds and place modes only among blocks alike in bytes and in group."""
    fixed: float = 0.0
    """Of ``seconds``, the checkpoint's own work (:attr:`ModeCost.fixed_seconds`), which measured scales leave."""

    @property
    def scaled_seconds(self) -> float:
        """What the measured scales multiply: the seconds less the checkpoint's own work."""
        return self.seconds - self.fixed

    def repriced(self, seconds: float, group: int | None = None, fixed: float | None = None) -> Option:
        """This option at ``seconds`` (and in ``group``, with ``fixed`` of them the checkpoint's own work, where
        given). The constructor, not ``dataclasses.replace``: several times faster, and prices are rebuilt for
        every new set of them."""
        return Option(
            self.mode,
            self.kept,
            self.transient,
            seconds,
            self.others,
            self.stage,
            self.group if group is None else group,
            self.fixed if fixed is None else fixed,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Per-block costs of a model at one input shape."""

    blocks: tuple[BlockCost, ...]
    """One entry per checkpointable block, in execution order."""
    shape: Shape = field(default_factory=Shape)
    """The input shape the costs were measured at."""
    other: Size = field(default_factory=Size)
    """Activations saved outside the blocks (embeddings, head, loss): always stored."""
    other_in_backward: float = True
    """The fraction of the memory outside the blocks (:meth:`other_at`) still held while the blocks' backward
    runs: all of it on CUDA (gradients, optimizer state, memory outside the blocks whatever the plan); on the
    CPU none (the saved tensors of the head and the loss, all its accounting counts there, are released before
    the blocks' backward starts), but on a pipeline stage the other microbatches' alive at once,
    ``(other_in_flight - 1) / other_in_flight``."""
    other_in_flight: int = 1
    """Microbatches whose memory outside the blocks is alive at once (a pipeline stage's): ``other`` is one
    microbatch's."""
    _first: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Per block, the first block with equal costs: costs are computed once per class of blocks."""

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a profile needs at least one block")
        if not 0.0 <= self.other_in_backward <= 1.0:
            raise ValueError(f"other_in_backward must be a fraction in [0, 1], got {self.other_in_backward!r}")
        if self.other_in_flight < 1:
            raise ValueError(f"other_in_flight must be a positive integer, got {self.other_in_flight!r}")
        seen: dict[BlockCost, int] = {}
        object.__setattr__(self, "_first", tuple(seen.setdefault(b, i) for i, b in enumerate(self.blocks)))

    def other_at(self, shape: Shape | None = None) -> int:
        """Memory outside the blocks at the end of forward, every microbatch alive then included."""
        return self.other.at(self.shape, shape or self.shape) * self.other_in_flight

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
            others = b.in_flight - 1
            opts = [
                Option(
                    m.mode,
                    kept,
                    max(0, m.transient.scaled(sizes) - m.released.scaled(sizes)),
                    (_priced(m, floor) - m.fixed_seconds) * scale + m.fixed_seconds,
                    others * kept,
                    b.stage,
                    fixed=m.fixed_seconds,
                )
                for m in costs
                if allowed is None or m.mode in allowed or m.mode == Mode.STORE
                for kept in (m.kept.scaled(sizes),)
            ]
            out.append(opts)
        return out

    def forward_seconds_at(self, shape: Shape | None = None) -> float:
        total = sum(b.forward_seconds for b in self.blocks)
        return total * (self.time_ratio(shape) if shape else 1.0)
