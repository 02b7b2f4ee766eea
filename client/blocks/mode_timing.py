"""Timing what each mode of a block costs in a real step, for the planner: its forward, and its
rematerialisation in backward.

On the CPU a clock around each; on CUDA a pair of events, read once a whole
step's events have completed (at the end of a later step at the latest), so
that nothing waits for the device and a step's forwards are never counted
without its rematerialisations.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from rematd.planner import Mode, ModeSeconds

# CUDA event pairs not yet read are kept this many at most (a job that never lets the device catch up).
MAX_PENDING = 4096

FORWARD, REMAT = 0, 1

_Pair = tuple[Mode, int, "torch.cuda.Event", "torch.cuda.Event"]


class RecomputeTimer:
    """Adds up, per mode, how long forwards and rematerialisations took since the last :meth:`take`."""

    __slots__ = ("_blocks", "_current", "_forward", "_pending", "_remat", "_steps", "store_blocks", "store_seconds")

    def __init__(self) -> None:
        self.store_seconds = 0.0
        self.store_blocks = 0
        """Storing blocks' forwards timed on the host clock, added up by the blocks themselves (the common case,
        kept apart from the per-mode tables so that it costs a block two additions)."""
        self._forward: dict[Mode, float] = {}
        self._remat: dict[Mode, float] = {}
        self._blocks: dict[Mode, int] = {}
        self._current: list[_Pair] = []
        self._steps: deque[list[_Pair]] = deque()
        self._pending = 0

    def run(self, mode: Mode, fn: Callable[..., Any], cuda: bool, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` rematerialising a block, timed; an exception (the checkpoint stopping
        the recomputation early, as it does once it has what backward needs) still counts what ran."""
        return self._timed(REMAT, mode, fn, cuda, *args, **kwargs)

    def forward(self, mode: Mode, fn: Callable[..., Any], cuda: bool, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a block's forward in ``mode``, timed."""
        return self._timed(FORWARD, mode, fn, cuda, *args, **kwargs)

    def _timed(self, kind: int, mode: Mode, fn: Callable[..., Any], cuda: bool, *args: Any, **kwargs: Any) -> Any:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                if self._pending < MAX_PENDING:
                    self._current.append((mode, kind, start, end))
                    self._pending += 1
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._add(mode, kind, time.perf_counter() - began)

    def add_events(self, mode: Mode, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """A pair of events recorded around backward-side work of ``mode`` (offload's wait for its copies)."""
        if self._pending < MAX_PENDING:
            self._current.append((mode, REMAT, start, end))
            self._pending += 1

    def add_forward(self, mode: Mode, seconds: float) -> None:
        """A block's forward in ``mode``, timed on the host clock by its caller."""
        self._forward[mode] = self._forward.get(mode, 0.0) + seconds
        self._blocks[mode] = self._blocks.get(mode, 0) + 1

    def add_seconds(self, mode: Mode, seconds: float) -> None:
        """Backward-side seconds of ``mode`` timed on the host clock."""
        self._add(mode, REMAT, seconds)

    def _add(self, mode: Mode, kind: int, seconds: float) -> None:
        if kind == FORWARD:
            self._forward[mode] = self._forward.get(mode, 0.0) + seconds
            self._blocks[mode] = self._blocks.get(mode, 0) + 1
        else:
            self._remat[mode] = self._remat.get(mode, 0.0) + seconds

    def forget(self) -> None:
        """Drop what was timed since the last :meth:`take` (a step that failed)."""
        self._pending -= len(self._current)
        self._current = []
        self.store_seconds, self.store_blocks = 0.0, 0
        self._forward.clear()
        self._remat.clear()
        self._blocks.clear()

    def take(self) -> Timed:
        """What was timed in the steps read since the last call, as it was added up, and start over: on CUDA
        the steps whose events have all completed (this one's too when the device has caught up). Made into
        the planner's records by :func:`mode_seconds`, off the training thread."""
        if self._current:
            self._steps.append(self._current)
            self._current = []
        while self._steps and self._steps[0][-1][3].query():
            for mode, kind, start, end in self._steps.popleft():
                self._add(mode, kind, start.elapsed_time(end) / 1000.0)
                self._pending -= 1
        store = (self.store_blocks, self.store_seconds)
        self.store_seconds, self.store_blocks = 0.0, 0
        if not self._blocks and not self._remat:
            return store, None
        tables = (self._blocks, self._remat, self._forward)
        self._blocks, self._remat, self._forward = {}, {}, {}
        return store, tables


Timed = tuple[tuple[int, float], tuple[dict[Mode, int], dict[Mode, float], dict[Mode, float]] | None]
"""What :meth:`RecomputeTimer.take` hands over: the storing blocks' forwards (blocks, seconds), and per mode the
blocks that ran a forward, their rematerialisations' and their forwards' seconds (None: nothing else timed)."""


def mode_seconds(timed: Timed) -> tuple[ModeSeconds, ...]:
    """The planner's records of what :meth:`RecomputeTimer.take` handed over: per mode whose blocks ran a
    forward (a rematerialisation without one is a step's that was forgotten)."""
    (stored, stored_seconds), tables = timed
    if tables is None:
        return (ModeSeconds(Mode.STORE, stored, 0.0, stored_seconds),) if stored else ()
    blocks, remat, forward = tables
    if stored:
        blocks = {**blocks, Mode.STORE: blocks.get(Mode.STORE, 0) + stored}
        forward = {**forward, Mode.STORE: forward.get(Mode.STORE, 0.0) + stored_seconds}
    return tuple(ModeSeconds(m, blocks[m], remat.get(m, 0.0), forward.get(m, 0.0)) for m in sorted(blocks) if blocks[m])
