"""A step's figures as the training thread leaves them at the step's end, made into the planner's record later.

Building :class:`~rematd.planner.messages.StepStats` (two dozen validated fields, a record per mode timed) costs tens of
microseconds on a training thread whose caches the step just filled with the model's work. The step's end keeps
the raw figures instead; whoever reads the statistics first (the planner's thread, the stream's, or
``h.last_stats``) builds them once.
"""

from __future__ import annotations

import threading

from rematd.client.blocks.mode_timing import Timed, mode_seconds
from rematd.client.memory.sources import MemorySample, SavedFigures, saved_sample
from rematd.planner import Mode, Shape
from rematd.planner.messages import StepStats

_BUILDING = threading.RLock()
"""Held while a record's statistics (or memory sample) are built: whichever thread asks first builds them once."""


class StepRecord:
    """One step's raw figures; :meth:`stats` is its report."""

    __slots__ = ("_figures", "_memory", "_stats", "budget_bytes", "shape", "static_bytes", "step")

    def __init__(
        self,
        step: int,
        shape: Shape,
        budget_bytes: int,
        static_bytes: int,
        memory: MemorySample | SavedFigures,
        figures: tuple[float, int, Timed, int, float, tuple[Mode, ...], float, int] | None,
    ) -> None:
        self.step = step
        self.shape = shape
        self.budget_bytes = budget_bytes
        self.static_bytes = static_bytes
        self._memory = memory
        """The step's memory sample, or on the CPU the figures it is made of."""
        self._figures = figures
        """The step seconds, plan version, what the timer took, recompiles and their seconds, the
        modes run when not the plan's, rematd's seconds on the training thread, and the bytes the router's
        choices added to the peak."""
        self._stats: StepStats | None = None

    @classmethod
    def of(cls, stats: StepStats) -> StepRecord:
        """A record of statistics already built (a step replayed to a backend)."""
        memory = MemorySample(
            peak_allocated_bytes=stats.peak_allocated_bytes,
            saved_peak_bytes=stats.saved_peak_bytes,
            **stats.allocator_figures(),
        )
        record = cls(stats.step, stats.shape, stats.budget_bytes, stats.static_bytes, memory, None)
        record._stats = stats
        return record

    def memory(self) -> MemorySample:
        """The step's memory sample (built at the first call, from any thread)."""
        memory = self._memory
        if isinstance(memory, tuple):
            with _BUILDING:
                memory = self._memory
                if isinstance(memory, tuple):
                    memory = self._memory = saved_sample(memory)
        return memory

    def stats(self) -> StepStats:
        """The step's statistics, built at the first call (from any thread: every call returns the same
        object, which a caller may compare by identity to tell a new step)."""
        stats = self._stats
        if stats is not None:
            return stats
        with _BUILDING:
            stats = self._stats
            if stats is None:
                stats = self._stats = self._build()
        return stats

    def _build(self) -> StepStats:
        assert self._figures is not None, "a record made of statistics has them"
        sample = self.memory()
        elapsed, version, timed, recompiles, compile_seconds, modes, thread, routed = self._figures
        return StepStats(
            step=self.step,
            peak_allocated_bytes=sample.peak_allocated_bytes,
            step_seconds=elapsed,
            plan_version=version,
            shape=self.shape,
            saved_peak_bytes=sample.saved_peak_bytes,
            budget_bytes=self.budget_bytes,
            static_bytes=self.static_bytes,
            mode_seconds=mode_seconds(timed),
            recompiles=recompiles,
            compile_seconds=compile_seconds,
            modes=modes,
            thread_seconds=thread,
            routed_bytes=routed,
            **sample.allocator_figures(),
        )
