"""Items from the training thread to one reader thread, handed over without waking the reader.

Waking a thread costs the training thread tens of microseconds (a lock, a notify, often a switch of the
interpreter's lock), every step. A step's figures are appended instead, and while steps come the reader looks
for them about once a step; after :data:`IDLE_S` without one it waits to be woken. What must not wait (an
out-of-memory error, a goodbye, a step of a new length) is posted with ``wake=True``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")

MIN_POLL_S = 0.001
MAX_POLL_S = 0.05
"""How often the reader looks for items while they come unannounced: every step or so, within these bounds."""

IDLE_S = 1.0
"""Seconds without an item after which the reader waits to be woken by the next."""


class Mailbox(Generic[T]):
    """A bounded queue whose :meth:`post` wakes the reader only when asked to, or when the reader sleeps."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._sleeping = False
        self._last = time.monotonic()
        self.poll_s = MAX_POLL_S
        """How often the reader looks while items come (set by the reader to about a step)."""

    def post(self, item: T, *, wake: bool = False) -> bool:
        """Append ``item`` (any thread); False when the mailbox was full and its oldest item was dropped."""
        kept = True
        if len(self._items) >= self.maxsize:
            try:
                self._items.popleft()
                kept = False
            except IndexError:
                pass
        self._items.append(item)
        if wake or self._sleeping:
            with self._cond:
                self._cond.notify()
        return kept

    def get(self, timeout: float) -> T:
        """The oldest item (the reader's thread); waits at most ``timeout`` seconds, else raises
        :class:`queue.Empty`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self._items.popleft()
            except IndexError:
                pass
            else:
                self._last = time.monotonic()
                return item
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise queue.Empty
            with self._cond:
                if now - self._last >= IDLE_S:
                    self._sleeping = True
                    # Looked at again with the flag up: an item posted before it woke nobody.
                    if not self._items:
                        self._cond.wait(left)
                    self._sleeping = False
                else:
                    self._cond.wait(min(left, max(MIN_POLL_S, min(MAX_POLL_S, self.poll_s))))

    def wake(self) -> None:
        """Have the reader look now (something besides the items changed)."""
        with self._cond:
            self._cond.notify()
