"""A token bucket: how often one rank may send what costs the service a plan and a row in the store."""

from __future__ import annotations

import time
from collections.abc import Callable

OOM_BURST = 10
"""OOM events a rank may report at once."""
OOM_PER_SECOND = 1.0
"""OOM events a rank may report per second after its burst (a step that runs out of memory takes longer)."""


class Bucket:
    """``burst`` at once, refilled at ``rate`` a second."""

    __slots__ = ("_at", "_clock", "_tokens", "burst", "rate")

    def __init__(
        self, burst: float = OOM_BURST, rate: float = OOM_PER_SECOND, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.rate = rate
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    def take(self) -> bool:
        """Whether one more may go now."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False
