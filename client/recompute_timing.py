"""Timing each checkpointed block's rematerialisation in backward, per mode, for the planner.

On the CPU a clock around the recomputation; on CUDA a pair of events,
read once they have completed (at the end of a later step at the latest),
so that nothing waits for the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rematd.planner import Mode, ModeSeconds

# CUDA event pairs not yet complete are kept this long at most (a step that never synchronises).
MAX_PENDING = 4096


class RecomputeTimer:
    """Adds up, per mode, how long the recomputations took since the last :meth:`take`."""

    def __init__(self) -> None:
        self._seconds: dict[Mode, float] = {}
        self._blocks: dict[Mode, int] = {}
        self._pending: list[tuple[Mode, torch.cuda.Event, torch.cuda.Event]] = []

    def run(self, mode: Mode, fn: Callable[..., Any], cuda: bool, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, timed; an exception (the checkpoint stopping the recomputation early,
        as it does once it has what backward needs) still counts what ran."""
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                if len(self._pending) < MAX_PENDING:
                    self._pending.append((mode, start, end))
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._add(mode, time.perf_counter() - began)

    def _add(self, mode: Mode, seconds: float) -> None:
        self._seconds[mode] = self._seconds.get(mode, 0.0) + seconds
        self._blocks[mode] = self._blocks.get(mode, 0) + 1

    def take(self) -> tuple[ModeSeconds, ...]:
        """What was timed since the last call (CUDA pairs that have completed), and start over."""
        waiting = []
        for mode, start, end in self._pending:
            if end.query():
                self._add(mode, start.elapsed_time(end) / 1000.0)
            else:
                waiting.append((mode, start, end))
        self._pending = waiting
        out = tuple(ModeSeconds(m, self._blocks[m], self._seconds[m]) for m in sorted(self._seconds))
        self._seconds.clear()
        self._blocks.clear()
        return out
