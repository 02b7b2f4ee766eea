"""What the modes really cost: measured extra step seconds against the profile's, per mode and per
length bucket.

A mode's cost is what it adds to a whole step: what its blocks' forward takes
beyond a stored block's forward (the selective policy's dispatch, offload's
copies) plus the rematerialisation in backward.
The client times both on the device, every step. The ratio of those
measurements to what the profile priced for the same blocks at the same
shape, per mode, scales every option's seconds but the share that is the
checkpoint's own work around a region (``Option.fixed``), which no step
times apart and the profile measured once. Scales move in steps of
``STEP`` (a new step re-prepares the solver, a wobble does not) and only
after ``MIN_BLOCKS`` timed blocks.

That ratio need not be the same at every length (a mode's fixed costs weigh
more on short steps, attention's on long ones), so it is kept per length
bucket (:class:`BucketTimes`) as well as pooled over the whole job. At a
length, a mode timed on ``MIN_BLOCKS`` blocks of its bucket takes that
bucket's scale; any other takes the pooled one.

A mode not yet measured is priced pessimistically: no cheaper than the profile
says (which for selective and offload is at least recomputing the block), and
as much dearer as the dearest measured mode turned out. A profile taken on a
cold first step, with the device synchronised after each operation, has
looked cheap and dear by turns; a plan that counts on a discount never seen
is the one that runs slow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from rematd.planner.restoring import mode_sums, number, restored_by_length, whole_number
from rematd.planner.shapes import Scales
from rematd.planner.steps import ModeSeconds
from rematd.planner.units import Mode

STEP = 1.1
"""Scales are powers of this."""
HOLD = 0.75
"""A scale moves to another power of ``STEP`` only once its ratio is this many powers away from the one in
force (0.5: plain rounding). A ratio that wobbles on the edge between two powers would otherwise change the
prices, and re-solve every entry of the plan table, step after step."""
MIN_BLOCKS = 4
"""Timed blocks of a mode before its scale departs from 1."""
DECAY = 0.9
"""Weight of the past in the running sums, per observation."""
LIMITS = (0.1, 10.0)
"""A scale stays within these: a measurement far outside them is more likely wrong than the profile."""
OUTLIER = 2.0
"""A step's timing of a mode (its rematerialisation, its forward, a plain forward) counts within this factor of
what the running ratio expects of it: a stall, a collection or another job's burst in one step would otherwise
set a mode's price for the next ten."""
MAX_BUCKETS = 16
"""Length buckets whose timings are kept; the least recently timed is dropped first."""
PRICED: tuple[Mode, ...] = (
    Mode.SELECTIVE,
    Mode.RECOMPUTE,
    Mode.OFFLOAD,
    Mode.COMPRESS,
    Mode.TITAN,
    Mode.ATTENTION,
    Mode.MLP,
)
"""Modes with a price to learn (storing adds nothing)."""
FORWARD_LIKE: tuple[Mode, ...] = (Mode.RECOMPUTE, Mode.ATTENTION, Mode.MLP)
"""Modes whose extra seconds are a forward run again (the block's, or a part's): until measured, they are
priced as the plain forwards every step times are (a stored block's), measured against the profile's."""


def forward_baseline(measured: Iterable[ModeSeconds]) -> tuple[float, int] | None:
    """A block's forward without checkpointing, from one step: (seconds, blocks) of the stored blocks'
    forward, or else of the recomputed blocks' rematerialisation (a forward of the block); None when
    neither ran."""
    by_mode = {m.mode: m for m in measured if m.blocks > 0}
    store = by_mode.get(Mode.STORE)
    if store is not None and store.forward_seconds > 0:
        return store.forward_seconds, store.blocks
    rec = by_mode.get(Mode.RECOMPUTE)
    if rec is not None and rec.seconds > 0:
        return rec.seconds, rec.blocks
    return None


def within(seconds: float, measured: float, profiled: float, expected: float) -> float:
    """``seconds`` measured where the profile expected ``expected``, within ``OUTLIER`` times of what the running
    sums (``measured`` over ``profiled``) make of that; as measured while the sums hold nothing."""
    if measured <= 0 or profiled <= 0 or expected <= 0:
        return seconds
    typical = measured / profiled * expected
    return min(typical * OUTLIER, max(typical / OUTLIER, seconds))


def scales_of(ratios: dict[Mode, float], levels: dict[Mode, int] | None = None) -> Scales:
    """The scales that measured ``ratios`` (measured / profiled, per mode) give: each quantised to a power
    of ``STEP``; the modes with no ratio never get a discount and are as far over the profile as the worst
    measured mode; modes at 1 left out. ``levels``: the powers in force, per mode priced before, each kept
    while its ratio stays within ``HOLD`` powers of it; updated in place."""
    priced = dict(ratios)
    if priced:
        worst = max(1.0, *priced.values())
        for mode in PRICED:
            priced.setdefault(mode, worst)
    scales = []
    for mode, ratio in sorted(priced.items()):
        exact = math.log(ratio, STEP)
        level = round(exact)
        if levels is not None:
            held = levels.get(mode)
            if held is not None and abs(exact - held) <= HOLD:
                level = held
            levels[mode] = level
        quantised = STEP**level
        if abs(quantised - 1.0) > 1e-9:
            scales.append((mode, round(quantised, 6)))
    if levels is not None:
        for mode in set(levels) - set(priced):
            del levels[mode]
    return tuple(scales)


class TimeScales:
    """Per mode, measured / predicted extra seconds, as a running ratio of decayed sums.

    A mode's forward is kept apart from its rematerialisation, with the profile's forward time of the same
    blocks: what the forward added is known only against a stored block's forward, which a step where every
    block ran selective does not show. Until some step has shown it, a mode whose forward was timed counts
    as not yet measured (a mode of :data:`FORWARD_LIKE` is priced by its rematerialisation alone). Each
    step's timing counts within ``OUTLIER`` times of what the running sums expect of it.
    """

    def __init__(self) -> None:
        self._remat: dict[Mode, float] = {}
        self._forward: dict[Mode, float] = {}
        self._forward_profiled: dict[Mode, float] = {}
        self._predicted: dict[Mode, float] = {}
        self._blocks: dict[Mode, int] = {}
        self._last: dict[Mode, int] = {}
        """The step each mode was last timed at."""
        self._base: list[float] = [0.0, 0.0]
        """Decayed sums of a plain block forward, measured and as profiled."""
        self._ratios: dict[Mode, float] = {}
        self._scales: Scales = ()
        self._levels: dict[Mode, int] = {}
        """The power of ``STEP`` in force per mode priced (:func:`scales_of`)."""

    def export_state(self) -> dict[str, Any]:
        """The decayed sums, as plain JSON-able data (mode names as keys); :meth:`restore_state` takes it back."""

        def named(d: dict[Mode, float] | dict[Mode, int]) -> dict[str, float]:
            return {m.name.lower(): v for m, v in sorted(d.items())}

        return {
            "remat": named(self._remat),
            "forward": named(self._forward),
            "forward_profiled": named(self._forward_profiled),
            "predicted": named(self._predicted),
            "blocks": named(self._blocks),
            "last_step": named(self._last),
            "base": list(self._base),
        }

    def restore_state(self, state: Any, where: str = "timing") -> None:
        """Continue from what :meth:`export_state` gave; ValueError naming the field (under ``where``),
        leaving these scales as they were, for anything else. A state without ``last_step`` (saved before
        it was kept) restores with no step of last timing."""
        if not isinstance(state, dict):
            raise ValueError(f"state: {where} must be an object, got {type(state).__name__}")
        remat, forward, profiled, predicted = (
            mode_sums(state, k, where, number) for k in ("remat", "forward", "forward_profiled", "predicted")
        )
        blocks = {m: int(v) for m, v in mode_sums(state, "blocks", where, number).items()}
        last = mode_sums(state, "last_step", where, whole_number)
        base = state.get("base", [0.0, 0.0])
        if not isinstance(base, list) or len(base) != 2:
            raise ValueError(f"state: {where}.base must be [measured, profiled], got {base!r}")
        base_sums = [number(v, f"{where}.base") for v in base]
        if not set(remat) == set(predicted) == set(forward) == set(profiled) == set(blocks):
            raise ValueError(f"state: {where}'s sums must name the same modes")
        if not set(last) <= set(blocks):
            raise ValueError(f"state: {where}.last_step names a mode never timed")
        self._remat, self._forward, self._forward_profiled = remat, forward, profiled
        self._predicted, self._blocks, self._base, self._last = predicted, blocks, base_sums, last
        self._levels = {}
        self.observe((), {})

    def observe(
        self,
        measured: Iterable[ModeSeconds],
        predicted_per_block: dict[Mode, float],
        *,
        forward_per_block: float = 0.0,
        step: int | None = None,
    ) -> None:
        """``measured`` from one step (``step``, when known); ``predicted_per_block``: the profile's mean
        extra seconds per block of each mode for the blocks that ran in it, at the step's shape;
        ``forward_per_block``: the profile's mean block forward at that shape (0: forwards are not
        compared, only rematerialisations count)."""
        measured = tuple(measured)
        base = forward_baseline(measured)
        if base is not None and forward_per_block > 0:
            profiled = base[1] * forward_per_block
            self._base[0] = self._base[0] * DECAY + within(base[0], self._base[0], self._base[1], profiled)
            self._base[1] = self._base[1] * DECAY + profiled
        for m in measured:
            expected = predicted_per_block.get(m.mode, 0.0) * m.blocks
            if m.mode == Mode.STORE or m.blocks <= 0 or expected <= 0:
                continue
            if not (math.isfinite(m.seconds) and math.isfinite(m.forward_seconds)):
                continue
            timed_forward = m.forward_seconds > 0 and forward_per_block > 0
            k = m.mode
            remat, predicted = self._remat.get(k, 0.0), self._predicted.get(k, 0.0)
            self._remat[k] = remat * DECAY + within(m.seconds, remat, predicted, expected)
            forward, profiled = self._forward.get(k, 0.0), self._forward_profiled.get(k, 0.0)
            plain = m.blocks * forward_per_block if timed_forward else 0.0
            self._forward[k] = forward * DECAY + (within(m.forward_seconds, forward, profiled, plain) if plain else 0.0)
            self._forward_profiled[k] = profiled * DECAY + plain
            self._predicted[k] = predicted * DECAY + expected
            self._blocks[k] = self._blocks.get(k, 0) + m.blocks
            if step is not None:
                self._last[k] = step
        ratios: dict[Mode, float] = {}
        for mode in self.measured_modes:
            whole = self._whole(mode)
            assert whole is not None
            ratios[mode] = min(LIMITS[1], max(LIMITS[0], whole / self._predicted[mode]))
        self._ratios = ratios
        self._scales = scales_of({**self.estimates, **ratios}, self._levels)

    @property
    def estimates(self) -> dict[Mode, float]:
        """For the modes of :data:`FORWARD_LIKE` not measured themselves, the measured / profiled seconds of a
        plain block forward, within ``LIMITS``; {} while no plain forward was timed."""
        if self._base[1] <= 0 or self._base[0] <= 0:
            return {}
        ratio = min(LIMITS[1], max(LIMITS[0], self._base[0] / self._base[1]))
        return {m: ratio for m in FORWARD_LIKE if m not in self._ratios}

    def _whole(self, mode: Mode) -> float | None:
        """The mode's decayed seconds, its forward beyond a plain forward included; None while no plain
        forward has been measured to compare its timed forward with. A mode of :data:`FORWARD_LIKE` runs
        the plain forward under a checkpoint, which adds next to nothing: its rematerialisation alone is its
        price, since the difference of two noisy forwards would swamp a part's small one (an MLP's
        rematerialisation is a tenth of its block's forward)."""
        profiled = self._forward_profiled.get(mode, 0.0)
        if profiled <= 0 or mode in FORWARD_LIKE:
            return self._remat[mode]
        if self._base[1] <= 0:
            return None
        plain = profiled * self._base[0] / self._base[1]
        return max(0.0, self._remat[mode] + self._forward[mode] - plain)

    @property
    def measured_modes(self) -> frozenset[Mode]:
        """The modes timed often enough, and against a measured plain forward where their forward was
        timed, for their own scale."""
        return frozenset(
            m
            for m, n in self._blocks.items()
            if n >= MIN_BLOCKS and self._predicted.get(m, 0) > 0 and self._whole(m) is not None
        )

    def timed_blocks(self, mode: Mode) -> int:
        """Blocks of ``mode`` timed so far (what its measured price rests on)."""
        return self._blocks.get(mode, 0)

    def last_timed(self, mode: Mode) -> int | None:
        """The step ``mode`` was last timed at; None when never (or not since a state without it)."""
        return self._last.get(mode)

    @property
    def ratios(self) -> dict[Mode, float]:
        """Measured / profiled seconds of the measured modes, within ``LIMITS``, not quantised."""
        return self._ratios

    @property
    def scales(self) -> Scales:
        """(mode, scale) for the modes whose measured seconds differ from the profile's; () for none."""
        return self._scales


class BucketTimes:
    """The modes' measured prices per length bucket, with the ones pooled over every length as the fallback.

    Each step's timings go to the pooled sums and to those of its length's bucket (``bucket_of``). At a
    length, a mode measured in its bucket (``MIN_BLOCKS`` timed blocks there) is priced by that bucket's
    ratio; any other mode by the pooled ratio; a mode measured nowhere as the pooled rule says (no
    discount, as dear as the dearest mode measured at that length). At most ``MAX_BUCKETS`` buckets are
    kept, the least recently timed dropped first.
    """

    def __init__(self, bucket_of: Callable[[int], int]) -> None:
        self.bucket_of = bucket_of
        self.pooled = TimeScales()
        self._buckets: dict[int, TimeScales] = {}
        """By bucket top, the least recently timed first."""
        self._scales: dict[int, Scales] = {}
        self._levels: dict[int, dict[Mode, int]] = {}
        """Per bucket top, the powers of ``STEP`` in force (:func:`scales_of`)."""

    def observe(
        self,
        measured: Iterable[ModeSeconds],
        predicted_per_block: dict[Mode, float],
        *,
        forward_per_block: float = 0.0,
        seq: int = 0,
        step: int | None = None,
    ) -> None:
        """One step's timings (:meth:`TimeScales.observe`), at length ``seq`` (0: unknown, pooled only)."""
        measured = tuple(measured)
        self.pooled.observe(measured, predicted_per_block, forward_per_block=forward_per_block, step=step)
        if seq:
            top = self.bucket_of(seq)
            bucket = self._buckets.pop(top, None) or TimeScales()
            bucket.observe(measured, predicted_per_block, forward_per_block=forward_per_block, step=step)
            self._buckets[top] = bucket
            while len(self._buckets) > MAX_BUCKETS:
                del self._buckets[next(iter(self._buckets))]
        self._rescale()

    def _rescale(self) -> None:
        pooled = self.pooled.ratios
        self._levels = {top: self._levels.get(top, {}) for top in self._buckets}
        estimated = self.pooled.estimates
        self._scales = {
            top: scales_of({**estimated, **b.estimates, **pooled, **b.ratios}, self._levels[top])
            for top, b in self._buckets.items()
        }

    def scales_at(self, seq: int) -> Scales:
        """The scales that price a step of length ``seq`` (0: the pooled ones)."""
        if not seq or not self._scales:
            return self.pooled.scales
        return self._scales.get(self.bucket_of(seq), self.pooled.scales)

    def _bucket(self, seq: int) -> TimeScales | None:
        """The timings of the bucket of ``seq``; None when none of its steps were timed (or ``seq`` is 0)."""
        return self._buckets.get(self.bucket_of(seq)) if seq else None

    def measured_modes_at(self, seq: int) -> frozenset[Mode]:
        """The modes measured in the bucket of ``seq`` (priced by their own scale there)."""
        bucket = self._bucket(seq)
        return bucket.measured_modes if bucket is not None else frozenset()

    def timed_blocks(self, mode: Mode, seq: int | None = None) -> int:
        """Blocks of ``mode`` timed so far: in the bucket of ``seq``, or in all (None)."""
        if seq is None:
            return self.pooled.timed_blocks(mode)
        bucket = self._bucket(seq)
        return bucket.timed_blocks(mode) if bucket is not None else 0

    def last_timed(self, mode: Mode, seq: int | None = None) -> int | None:
        """The step ``mode`` was last timed at: in the bucket of ``seq``, or at any length (None)."""
        if seq is None:
            return self.pooled.last_timed(mode)
        bucket = self._bucket(seq)
        return bucket.last_timed(mode) if bucket is not None else None

    @property
    def buckets(self) -> list[int]:
        """The tops of the buckets timed, shortest first."""
        return sorted(self._buckets)

    @property
    def scales(self) -> Scales:
        """The pooled scales (what prices a length none of whose steps were timed)."""
        return self.pooled.scales

    @property
    def measured_modes(self) -> frozenset[Mode]:
        """The modes measured over the whole job."""
        return self.pooled.measured_modes

    def export_state(self) -> dict[str, Any]:
        """The pooled sums (as :meth:`TimeScales.export_state`) and ``buckets``: [bucket top, its sums] pairs,
        the least recently timed first."""
        return {
            **self.pooled.export_state(),
            "buckets": [[top, b.export_state()] for top, b in self._buckets.items()],
        }

    def restore_state(self, state: Any) -> None:
        """Continue from what :meth:`export_state` gave (a state without ``buckets`` restores the pooled sums
        alone); ValueError naming the field, leaving these as they were, for anything else."""
        pooled = TimeScales()
        pooled.restore_state(state)
        buckets = _restored_buckets(state.get("buckets", []))
        self.pooled, self._buckets = pooled, buckets
        self._levels = {}
        self._rescale()


def _restored_buckets(raw: Any) -> dict[int, TimeScales]:
    def bucket(sums: Any, where: str) -> TimeScales:
        restored = TimeScales()
        restored.restore_state(sums, where)
        return restored

    return restored_by_length(raw, "timing.buckets", bucket, most=MAX_BUCKETS)
