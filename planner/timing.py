"""What the modes really cost: measured extra step seconds against the profile's, per mode.

A mode's cost is what it adds to a whole step: what its blocks' forward takes
beyond a stored block's forward (checkpoint bookkeeping, the selective
policy's dispatch, offload's copies) plus the rematerialisation in backward.
The client times both on the device, every step. The ratio of those
measurements to what the profile priced for the same blocks at the same
shape, per mode, scales every option's seconds. Scales move in steps of
``STEP`` (a new step re-prepares the solver, a wobble does not) and only
after ``MIN_BLOCKS`` timed blocks.

A mode not yet measured is priced pessimistically: no cheaper than the profile
says (which for selective and offload is at least recomputing the block), and
as much dearer as the dearest measured mode turned out. A profile taken on a
cold first step, with the device synchronised after each operation, has
looked cheap and dear by turns; a plan that counts on a discount never seen
is the one that runs slow.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from rematd.planner.model import Mode, ModeSeconds

STEP = 1.1
"""Scales are powers of this."""
MIN_BLOCKS = 4
"""Timed blocks of a mode before its scale departs from 1."""
DECAY = 0.9
"""Weight of the past in the running sums, per observation."""
LIMITS = (0.1, 10.0)
"""A scale stays within these: a measurement far outside them is more likely wrong than the profile."""
PRICED = (Mode.SELECTIVE, Mode.RECOMPUTE, Mode.OFFLOAD)
"""Modes with a price to learn (storing adds nothing)."""


def whole_step_seconds(measured: Iterable[ModeSeconds], baseline_per_block: float | None) -> dict[Mode, float]:
    """Per mode, the seconds its blocks added to the step: rematerialisation, plus forward time beyond
    ``baseline_per_block`` (a stored block's forward; None when no forward was timed to compare with)."""
    out: dict[Mode, float] = {}
    for m in measured:
        if m.mode == Mode.STORE or m.blocks <= 0:
            continue
        extra_forward = 0.0
        if baseline_per_block is not None and m.forward_seconds > 0:
            extra_forward = m.forward_seconds - m.blocks * baseline_per_block
        out[m.mode] = max(0.0, m.seconds + extra_forward)
    return out


def forward_baseline(measured: Iterable[ModeSeconds]) -> float | None:
    """A block's forward without checkpointing, per block, from one step: the stored blocks' forward, or
    else the recomputed blocks' rematerialisation (a forward of the block); None when neither ran."""
    by_mode = {m.mode: m for m in measured if m.blocks > 0}
    store = by_mode.get(Mode.STORE)
    if store is not None and store.forward_seconds > 0:
        return store.forward_seconds / store.blocks
    rec = by_mode.get(Mode.RECOMPUTE)
    if rec is not None and rec.seconds > 0:
        return rec.seconds / rec.blocks
    return None


class TimeScales:
    """Per mode, measured / predicted extra seconds, as a running ratio of decayed sums."""

    def __init__(self) -> None:
        self._measured: dict[Mode, float] = {}
        self._predicted: dict[Mode, float] = {}
        self._blocks: dict[Mode, int] = {}
        self._baseline_ratio: float | None = None
        self._scales: tuple[tuple[Mode, float], ...] = ()

    def observe(
        self,
        measured: Iterable[ModeSeconds],
        predicted_per_block: dict[Mode, float],
        *,
        forward_per_block: float = 0.0,
    ) -> None:
        """``measured`` from one step; ``predicted_per_block``: the profile's mean extra seconds per block
        of each mode for the blocks that ran in it, at the step's shape; ``forward_per_block``: the
        profile's mean block forward at that shape (to carry a measured forward baseline to steps
        where no block stored or recomputed)."""
        measured = tuple(measured)
        baseline = forward_baseline(measured)
        if baseline is not None and forward_per_block > 0:
            ratio = baseline / forward_per_block
            old = self._baseline_ratio
            self._baseline_ratio = ratio if old is None else DECAY * old + (1 - DECAY) * ratio
        elif baseline is None and self._baseline_ratio is not None and forward_per_block > 0:
            baseline = self._baseline_ratio * forward_per_block
        whole = whole_step_seconds(measured, baseline)
        for m in measured:
            expected = predicted_per_block.get(m.mode, 0.0) * m.blocks
            seconds = whole.get(m.mode)
            if seconds is None or expected <= 0 or not math.isfinite(seconds):
                continue
            self._measured[m.mode] = self._measured.get(m.mode, 0.0) * DECAY + seconds
            self._predicted[m.mode] = self._predicted.get(m.mode, 0.0) * DECAY + expected
            self._blocks[m.mode] = self._blocks.get(m.mode, 0) + m.blocks
        ratios = {
            mode: min(LIMITS[1], max(LIMITS[0], self._measured[mode] / predicted))
            for mode, predicted in self._predicted.items()
            if self._blocks[mode] >= MIN_BLOCKS and predicted > 0
        }
        if ratios:
            # Untried modes: never a discount, and as far over the profile as the worst tried mode.
            worst = max(1.0, *ratios.values())
            for mode in PRICED:
                ratios.setdefault(mode, worst)
        scales = []
        for mode, ratio in sorted(ratios.items()):
            quantised = STEP ** round(math.log(ratio, STEP))
            if abs(quantised - 1.0) > 1e-9:
                scales.append((mode, round(quantised, 6)))
        self._scales = tuple(scales)

    @property
    def measured_modes(self) -> frozenset[Mode]:
        """The modes timed often enough for their own scale."""
        return frozenset(m for m, n in self._blocks.items() if n >= MIN_BLOCKS)

    @property
    def scales(self) -> tuple[tuple[Mode, float], ...]:
        """(mode, scale) for the modes whose measured seconds differ from the profile's; () for none."""
        return self._scales
