"""Error records that a fault repeating on every record cannot turn into a flood in the training job's log."""

from __future__ import annotations

import logging
import math
import time

log = logging.getLogger("rematd.client")


class Throttled:
    """Error records at most once per ``every_s``; the next one says how many were held back."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last = -math.inf
        self._held = 0

    def error(self, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        self.log(logging.ERROR, msg, *args, exc_info=exc_info)

    def log(self, level: int, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._held += 1
            return
        if self._held:
            msg, args = msg + " (%d more like it since the last report)", (*args, self._held)
        self._last, self._held = now, 0
        log.log(level, msg, *args, exc_info=exc_info)
