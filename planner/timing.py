"""What the modes really cost: measured extra seconds against the profile's, per mode.

The profile's seconds come from the first step, which pays for cold caches
and first allocations, and selective recomputation's bookkeeping is not in
them at all. The client times each checkpointed block's rematerialisation in
backward; the ratio of those measurements to what the profile predicted for
the same blocks at the same shape, per mode, scales every option's seconds.
Scales move in steps of ``STEP`` (a new step re-prepares the solver, a
wobble does not) and only after ``MIN_BLOCKS`` timed blocks.

The profile's seconds for every recomputing mode come from the same cold
first forward, so when the modes in use measure cheaper than profiled, a
mode not yet run is taken to be as much cheaper: were it left at the
profile's figure, a plan that never tries it would never learn that it pays.
One measured dearer says nothing of the others, which keep their figures.
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
RECOMPUTING = (Mode.SELECTIVE, Mode.RECOMPUTE)
"""Modes whose profiled seconds are shares of the first step's forward time (offload's are not)."""


class TimeScales:
    """Per mode, measured / predicted extra seconds, as a running ratio of decayed sums."""

    def __init__(self) -> None:
        self._measured: dict[Mode, float] = {}
        self._predicted: dict[Mode, float] = {}
        self._blocks: dict[Mode, int] = {}
        self._scales: tuple[tuple[Mode, float], ...] = ()

    def observe(self, measured: Iterable[ModeSeconds], predicted_per_block: dict[Mode, float]) -> None:
        """``measured`` from one step; ``predicted_per_block``: the profile's mean extra seconds per block
        of each mode for the blocks that ran in it, at the step's shape."""
        for m in measured:
            expected = predicted_per_block.get(m.mode, 0.0) * m.blocks
            if m.blocks <= 0 or expected <= 0 or not math.isfinite(m.seconds):
                continue
            self._measured[m.mode] = self._measured.get(m.mode, 0.0) * DECAY + m.seconds
            self._predicted[m.mode] = self._predicted.get(m.mode, 0.0) * DECAY + expected
            self._blocks[m.mode] = self._blocks.get(m.mode, 0) + m.blocks
        ratios = {
            mode: min(LIMITS[1], max(LIMITS[0], self._measured[mode] / predicted))
            for mode, predicted in self._predicted.items()
            if self._blocks[mode] >= MIN_BLOCKS and predicted > 0
        }
        timed = [m for m in RECOMPUTING if m in ratios]
        if timed:
            spent = sum(self._measured[m] for m in timed)
            shared = min(1.0, max(LIMITS[0], spent / sum(self._predicted[m] for m in timed)))
            for mode in RECOMPUTING:
                ratios.setdefault(mode, shared)
        scales = []
        for mode, ratio in sorted(ratios.items()):
            quantised = STEP ** round(math.log(ratio, STEP))
            if abs(quantised - 1.0) > 1e-9:
                scales.append((mode, round(quantised, 6)))
        self._scales = tuple(scales)

    @property
    def scales(self) -> tuple[tuple[Mode, float], ...]:
        """(mode, scale) for the modes whose measured seconds differ from the profile's; () for none."""
        return self._scales
