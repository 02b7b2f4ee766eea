"""Repeated log lines, limited: a flood of one error (an accept that fails, a refused connection) must not
fill the disk the store lives on. Under file-descriptor exhaustion one line per accept retry once
grew the log by 221 MB in 16 s."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

LINES_PER_WINDOW = 5
"""Lines of one kind (logger, level and message template) written per window."""
WINDOW_SECONDS = 60.0
"""The window; what was held back is counted on the next line of that kind written after it."""


class RepeatLimit(logging.Filter):
    """A filter for a handler: at most ``lines`` records of one kind per ``window`` seconds; the next one let
    through after a window says how many were held back."""

    def __init__(
        self,
        lines: int = LINES_PER_WINDOW,
        window: float = WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.lines = lines
        self.window = window
        self.clock = clock
        self._lock = threading.Lock()
        # kind -> [window start, written in it, held back since the last written]
        self._seen: dict[tuple[str, int, str], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            seen = self._seen.get(kind)
            if seen is None or now - seen[0] >= self.window:
                held = int(seen[2]) if seen is not None else 0
                if len(self._seen) > 4096:  # many kinds: forget the old ones rather than grow
                    self._seen.clear()
                self._seen[kind] = [now, 1.0, 0.0]
                if held:
                    record.msg = f"{record.msg} ({held} more like this held back over the last {self.window:.0f} s)"
                return True
            if seen[1] < self.lines:
                seen[1] += 1
                return True
            seen[2] += 1
            return False
