"""The core's writes to the store, done in order on one thread of their own.

A step's statistics, a new plan or an OOM is handed over here and the stream is answered at once:
the database's time (a slow disk, PostgreSQL across a network) is spent on this thread, never on
the event loop and never under the core's lock. One thread and one queue keep every write in the
order it was handed over, so a rank's plans land in version order. ``call`` waits for a write (a
hello is recorded before the rank counts as connected); ``drain`` waits for what was handed over
before it (a read that must see it, the end of a stream, shutdown).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger("rematd.server")

_R = TypeVar("_R")

IDLE_SECONDS = 5.0
"""An idle writer's thread ends after this long; the next write starts another."""


@dataclass(slots=True)
class _Write:
    seq: int
    what: str
    fn: Callable[[], object]
    waited: bool
    """Someone waits for it (``call``), and is given its error instead of the log."""
    error: BaseException | None = None


class StoreWriter:
    """A FIFO of writes to the store and the thread that runs them."""

    def __init__(
        self,
        *,
        on_failure: Callable[[BaseException], None] | None = None,
        describe: Callable[[BaseException], str] | None = None,
    ) -> None:
        self.on_failure = on_failure
        """Called with the error of each write that failed while nobody waited for it (the core counts it)."""
        self._describe = describe or (lambda err: f"{type(err).__name__}: {err}")
        self._cv = threading.Condition()
        self._queue: collections.deque[_Write] = collections.deque()
        self._submitted = 0
        self._done = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failures = 0
        """Writes that failed while nobody waited for them (logged)."""

    def pending(self) -> int:
        with self._cv:
            return self._submitted - self._done

    def submit(self, what: str, fn: Callable[[], object]) -> int:
        """Hand ``fn`` over to be run in turn; an error it raises is logged and counted, never raised here.
        Returns its ticket, for :meth:`wait`."""
        return self._enqueue(what, fn, waited=False).seq

    def wait(self, ticket: int, timeout: float | None = None) -> bool:
        """Wait until the write of ``ticket`` (and every one before it) is done or failed; False on timeout."""
        if threading.current_thread() is self._thread:
            return False
        return self._wait_for(ticket, timeout)

    def call(self, what: str, fn: Callable[[], _R]) -> _R:
        """Run ``fn`` in turn after everything handed over before it; returns its result or raises its error."""
        if threading.current_thread() is self._thread:
            return fn()  # a write that hands over another: in order already
        result: list[_R] = []
        item = self._enqueue(what, lambda: result.append(fn()), waited=True)
        self._wait_for(item.seq)
        if item.error is not None:
            raise item.error
        return result[0]

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until what was handed over before this call is written (or failed); False on timeout."""
        if threading.current_thread() is self._thread:
            return False
        with self._cv:
            target = self._submitted
        return self._wait_for(target, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued, then stop the thread; later writes run on the caller's thread (the core
        outlived its writer). Writes the store has not taken within ``timeout`` are given up: logged with
        their number, and dropped rather than run beside the caller's (which would break their order)."""
        self.drain(timeout)
        with self._cv:
            self._closed = True
            lost = len(self._queue)
            self._queue.clear()
            self._done = self._submitted
            thread = self._thread
            self._cv.notify_all()
        if lost:
            log.error("the store did not take %d queued write(s) in time; they are not written", lost)
        if thread is not None:
            thread.join(timeout)

    def _enqueue(self, what: str, fn: Callable[[], object], *, waited: bool) -> _Write:
        with self._cv:
            if not self._closed:
                self._submitted += 1
                item = _Write(self._submitted, what, fn, waited)
                self._queue.append(item)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="rematd-store-writer", daemon=True)
                    self._thread.start()
                self._cv.notify_all()
                return item
        item = _Write(0, what, fn, waited)
        self._run(item)
        return item

    def _wait_for(self, seq: int, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._done >= seq, timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._cv.wait_for(lambda: bool(self._queue) or self._closed, IDLE_SECONDS) or not self._queue:
                    self._thread = None
                    return
                item = self._queue.popleft()
            self._run(item)
            with self._cv:
                self._done = max(self._done, item.seq)
                self._cv.notify_all()

    def _run(self, item: _Write) -> None:
        try:
            item.fn()
        except Exception as err:
            if item.waited:
                item.error = err
                return
            self.failures += 1
            log.error("writing %s to the store failed: %s", item.what, self._describe(err))
            if self.on_failure is not None:
                try:
                    self.on_failure(err)
                except Exception:
                    log.exception("counting a failed write failed")
