"""Steady steps folded into fewer reports, for as long as the service allows.

A rank whose plan has held, with no risk and no loosening under way, gives
the service nothing new each step; the service says so with a report
interval in its acks. Until that interval has passed, a step like the last
one reported (same shape, plan, modes run and budget, peak within ``PEAK_BAND``, no
allocator retry or out-of-memory error, no less room on the device and no
more fragmentation than a grain of the budget) is folded into the next report. A
step that differs is reported at once, after what was folded before it.
"""

from __future__ import annotations

import dataclasses
import math

from rematd.planner import Mode, ModeSeconds
from rematd.planner.messages import StepStats
from rematd.planner.risk import GRAIN, device_room_bytes

PEAK_BAND = 0.02
"""How far a peak may move from the last one reported and still count as steady."""


def _near(a: int, b: int) -> bool:
    return abs(a - b) <= PEAK_BAND * max(a, b)


def _room_held(step: StepStats, reported: StepStats) -> bool:
    """No less room on the device (another process took memory) and no more fragmentation than a grain of
    the budget: either shrinks what the plan may use, which the service must hear at once."""
    grain = max(1, step.budget_bytes // GRAIN)
    room, was = device_room_bytes(step), device_room_bytes(reported)
    if room is not None and was is not None and room + grain < was:
        return False
    return step.inactive_split_bytes <= reported.inactive_split_bytes + grain


def steady(step: StepStats, reported: StepStats) -> bool:
    """Whether ``step`` tells the service nothing that ``reported`` did not."""
    return (
        step.shape == reported.shape
        and step.plan_version == reported.plan_version
        and step.modes == reported.modes
        and step.budget_bytes == reported.budget_bytes
        and step.alloc_retries == reported.alloc_retries
        and step.oom_count == reported.oom_count
        and step.routed_bytes == reported.routed_bytes
        and _near(step.peak_allocated_bytes, reported.peak_allocated_bytes)
        and _near(step.saved_peak_bytes, reported.saved_peak_bytes)
        and _room_held(step, reported)
    )


def fold(earlier: StepStats, later: StepStats) -> StepStats:
    """One report for both: the later step's values, the larger peaks, the mean step time, the
    rematerialisation seconds and rematd's seconds on the training thread of both."""
    steps = earlier.steps + later.steps
    seconds: dict[Mode, ModeSeconds] = {}
    for m in (*earlier.mode_seconds, *later.mode_seconds):
        had = seconds.get(m.mode)
        seconds[m.mode] = (
            m
            if had is None
            else ModeSeconds(
                m.mode, had.blocks + m.blocks, had.seconds + m.seconds, had.forward_seconds + m.forward_seconds
            )
        )
    return dataclasses.replace(
        later,
        steps=steps,
        mode_seconds=tuple(seconds[m] for m in sorted(seconds)),
        peak_allocated_bytes=max(earlier.peak_allocated_bytes, later.peak_allocated_bytes),
        peak_reserved_bytes=max(earlier.peak_reserved_bytes, later.peak_reserved_bytes),
        saved_peak_bytes=max(earlier.saved_peak_bytes, later.saved_peak_bytes),
        step_seconds=(earlier.step_seconds * earlier.steps + later.step_seconds * later.steps) / steps,
        recompiles=earlier.recompiles + later.recompiles,
        compile_seconds=earlier.compile_seconds + later.compile_seconds,
        thread_seconds=earlier.thread_seconds + later.thread_seconds,
        routed_bytes=max(earlier.routed_bytes, later.routed_bytes),
    )


class Folder:
    """Decides, step by step, what goes out now; used by the stream's sending side only."""

    def __init__(self) -> None:
        self.interval = 0.0
        """Seconds the service allows between reports of steady steps (0: report every step)."""
        self.pending: StepStats | None = None
        """Steps folded and not yet reported."""
        self._reported: StepStats | None = None
        self._reported_at = -math.inf

    def restart(self) -> None:
        """A new stream: nothing reported on it yet, and no interval until its service says so."""
        self.interval = 0.0
        self._reported = None

    def offer(self, step: StepStats, now: float) -> list[StepStats]:
        """The reports to send now that ``step`` has ended (none while it is folded)."""
        reported = self._reported
        if (
            self.interval > 0
            and reported is not None
            and now - self._reported_at < self.interval
            and steady(step, reported)
        ):
            self.pending = step if self.pending is None else fold(self.pending, step)
            return []
        out = [] if self.pending is None else [self.pending]
        if self.pending is not None and reported is not None and steady(step, reported):
            out = [fold(self.pending, step)]  # the interval is up: one report for all of them
        else:
            out.append(step)
        self.pending = None
        self._mark(out[-1], now)
        return out

    def due(self, now: float, *, force: bool = False) -> StepStats | None:
        """What was folded, once the interval is up (or at once with ``force``)."""
        if self.pending is None or not (force or now - self._reported_at >= self.interval):
            return None
        report, self.pending = self.pending, None
        self._mark(report, now)
        return report

    def _mark(self, report: StepStats, now: float) -> None:
        self._reported = report
        self._reported_at = now
