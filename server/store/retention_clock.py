"""The time retention judges age by: the wall clock, unless it jumped.

Rows carry wall-clock times (they must mean something after a restart), so retention compares them
with the wall clock. A wall clock set forward by a month (a bad NTP source, an operator's typo)
would make every row look a month old and compaction delete it. The wall clock is followed while
it keeps pace with the monotonic clock; a jump larger than ``max_jump_seconds`` since the last
reading is ignored (logged): retention goes on from where the monotonic clock says the wall clock
should be, for as long as the process runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("rematd.server")

MAX_JUMP_SECONDS = 3600.0
"""A wall clock that moved this much more (or less) than the monotonic clock since the last reading jumped."""


class RetentionClock:
    """Wall-clock seconds for retention, anchored to the monotonic clock."""

    def __init__(
        self,
        max_jump_seconds: float = MAX_JUMP_SECONDS,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_jump_seconds = max_jump_seconds
        self.wall = wall
        self.mono = mono
        self._anchor = (wall(), mono())

    def now(self) -> float:
        w, m = self.wall(), self.mono()
        expected = self._anchor[0] + (m - self._anchor[1])
        if abs(w - expected) > self.max_jump_seconds:
            log.warning(
                "the wall clock moved %+.0f s against the monotonic clock; retention ignores the jump and "
                "judges age by the monotonic clock until the service restarts",
                w - expected,
            )
            return expected
        self._anchor = (w, m)
        return w
