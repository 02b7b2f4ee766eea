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
from typing import Any

from rematd.planner.model import Mode, ModeSeconds

STEP = 1.1
"""Scales are powers of this."""
MIN_BLOCKS = 4
"""Timed blocks of a mode before its scale departs from 1."""
DECAY = 0.9
"""Weight of the past in the running sums, per observation."""
LIMITS = (0.1, 10.0)
"""A scale stays within these: a measurement far outside them is more likely wrong than the profile."""
MAX_SUM = 1e12
"""Bound on a restored decayed sum (seconds or blocks): anything larger is not a measurement."""
PRICED: tuple[Mode, ...] = (Mode.SELECTIVE, Mode.RECOMPUTE, Mode.OFFLOAD, Mode.COMPRESS)
"""Modes with a price to learn (storing adds nothing)."""


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


class TimeScales:
    """Per mode, measured / predicted extra seconds, as a running ratio of decayed sums.

    A mode's forward is kept apart from its rematerialisation, with the profile's forward time of the same
    blocks: what the forward added is known only against a stored block's forward, which a step where every
    block ran selective does not show. Until some step has shown it, a mode whose forward was timed counts
    as not yet measured.
    """

    def __init__(self) -> None:
        self._remat: dict[Mode, float] = {}
        self._forward: dict[Mode, float] = {}
        self._forward_profiled: dict[Mode, float] = {}
        self._predicted: dict[Mode, float] = {}
        self._blocks: dict[Mode, int] = {}
        self._base: list[float] = [0.0, 0.0]
        """Decayed sums of a plain block forward, measured and as profiled."""
        self._scales: tuple[tuple[Mode, float], ...] = ()

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
            "base": list(self._base),
        }

    def restore_state(self, state: Any) -> None:
        """Continue from what :meth:`export_state` gave; ValueError naming the field, leaving these scales
        as they were, for anything else."""
        if not isinstance(state, dict):
            raise ValueError(f"state: timing must be an object, got {type(state).__name__}")

        def number(value: Any, what: str) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"state: {what} must be a number, got {value!r}")
            if (isinstance(value, float) and math.isnan(value)) or not 0 <= value <= MAX_SUM:
                raise ValueError(f"state: {what} must be a finite number in [0, {MAX_SUM:g}], got {value!r}")
            return float(value)

        def sums(key: str) -> dict[Mode, float]:
            raw = state.get(key, {})
            if not isinstance(raw, dict):
                raise ValueError(f"state: timing.{key} must be an object of modes, got {raw!r}")
            out: dict[Mode, float] = {}
            for name, value in raw.items():
                mode = Mode.__members__.get(name.upper()) if isinstance(name, str) else None
                if mode is None:
                    raise ValueError(f"state: timing.{key} has an unknown mode {name!r}")
                out[mode] = number(value, f"timing.{key}.{name}")
            return out

        remat, forward, profiled, predicted = (sums(k) for k in ("remat", "forward", "forward_profiled", "predicted"))
        blocks = {m: int(v) for m, v in sums("blocks").items()}
        base = state.get("base", [0.0, 0.0])
        if not isinstance(base, list) or len(base) != 2:
            raise ValueError(f"state: timing.base must be [measured, profiled], got {base!r}")
        base_sums = [number(v, "timing.base") for v in base]
        if not set(remat) == set(predicted) == set(forward) == set(profiled) == set(blocks):
            raise ValueError("state: timing's sums must name the same modes")
        self._remat, self._forward, self._forward_profiled = remat, forward, profiled
        self._predicted, self._blocks, self._base = predicted, blocks, base_sums
        self.observe((), {})

    def observe(
        self,
        measured: Iterable[ModeSeconds],
        predicted_per_block: dict[Mode, float],
        *,
        forward_per_block: float = 0.0,
    ) -> None:
        """``measured`` from one step; ``predicted_per_block``: the profile's mean extra seconds per block
        of each mode for the blocks that ran in it, at the step's shape; ``forward_per_block``: the
        profile's mean block forward at that shape (0: forwards are not compared, only
        rematerialisations count)."""
        measured = tuple(measured)
        base = forward_baseline(measured)
        if base is not None and forward_per_block > 0:
            self._base[0] = self._base[0] * DECAY + base[0]
            self._base[1] = self._base[1] * DECAY + base[1] * forward_per_block
        for m in measured:
            expected = predicted_per_block.get(m.mode, 0.0) * m.blocks
            if m.mode == Mode.STORE or m.blocks <= 0 or expected <= 0:
                continue
            if not (math.isfinite(m.seconds) and math.isfinite(m.forward_seconds)):
                continue
            timed_forward = m.forward_seconds > 0 and forward_per_block > 0
            k = m.mode
            self._remat[k] = self._remat.get(k, 0.0) * DECAY + m.seconds
            self._forward[k] = self._forward.get(k, 0.0) * DECAY + (m.forward_seconds if timed_forward else 0.0)
            self._forward_profiled[k] = self._forward_profiled.get(k, 0.0) * DECAY + (
                m.blocks * forward_per_block if timed_forward else 0.0
            )
            self._predicted[k] = self._predicted.get(k, 0.0) * DECAY + expected
            self._blocks[k] = self._blocks.get(k, 0) + m.blocks
        ratios: dict[Mode, float] = {}
        for mode in self.measured_modes:
            whole = self._whole(mode)
            assert whole is not None
            ratios[mode] = min(LIMITS[1], max(LIMITS[0], whole / self._predicted[mode]))
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

    def _whole(self, mode: Mode) -> float | None:
        """The mode's decayed seconds, its forward beyond a plain forward included; None while no plain
        forward has been measured to compare its timed forward with."""
        profiled = self._forward_profiled.get(mode, 0.0)
        if profiled <= 0:
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

    @property
    def scales(self) -> tuple[tuple[Mode, float], ...]:
        """(mode, scale) for the modes whose measured seconds differ from the profile's; () for none."""
        return self._scales
