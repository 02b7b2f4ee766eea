"""Sums over runs of consecutive hull segments, per cap, so that a scan of the sorted segments can
skip a whole run where it takes every segment of it.

A segment holds for caps in ``[lo, hi)``, so what a run of them frees (and adds) at a cap is a step
function of the cap, with a step at each segment's ``lo`` and ``hi``: kept per run as the sorted
steps and the sums from each step on. A scan then costs one bisection per run it skips and a walk
through the one run where the bytes it needs are met, instead of a walk through every segment before.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

RUN = 32
"""Segments per run: about the square root of the segments of a thousand unlike blocks."""


class Runs:
    """Per run of ``RUN`` consecutive segments: the bytes freed and seconds added by those that hold
    at a cap."""

    def __init__(self, segments: Sequence[tuple[int, int, float, int, float]]) -> None:
        """``segments``: (bytes freed per block, blocks, seconds added per block, lo, hi), in scan order."""
        self.steps: list[list[int]] = []
        self.freed: list[list[int]] = []
        self.added: list[list[float]] = []
        for start in range(0, len(segments), RUN):
            self._add_run(segments[start : start + RUN])

    def _add_run(self, run: Sequence[tuple[int, int, float, int, float]]) -> None:
        events: dict[int, list[tuple[int, float]]] = {}
        for freed, w, added, lo, hi in run:
            events.setdefault(lo, []).append((freed * w, added * w))
            if hi != float("inf"):
                events.setdefault(int(hi), []).append((-freed * w, -added * w))
        steps, freed_at, added_at = [], [], []
        freed_sum, added_sum = 0, 0.0
        for at in sorted(events):
            for f, a in events[at]:
                freed_sum += f
                added_sum += a
            steps.append(at)
            freed_at.append(freed_sum)
            added_at.append(added_sum)
        self.steps.append(steps)
        self.freed.append(freed_at)
        self.added.append(added_at)

    def at(self, run: int, cap: int) -> tuple[int, float]:
        """What the segments of ``run`` that hold at ``cap`` free and add, all of them taken whole."""
        p = bisect_right(self.steps[run], cap) - 1
        return (self.freed[run][p], self.added[run][p]) if p >= 0 else (0, 0.0)

    def __len__(self) -> int:
        return len(self.steps)
