"""When the service's garbage collector runs, so that it neither lets ended streams' memory wait nor stalls the loop.

The collector runs on the event loop's thread and holds everything while it runs. A full collection visits
every object alive, and each rank's session (its planner, its tables) is thousands of them: at 10,000 ranks
one full collection takes most of a second, every stream waiting. Those objects live as long as their rank,
so once they have settled they are frozen (``gc.freeze``): later collections, the interpreter's own full
ones included, visit only what was made since. What the frozen objects turn into garbage (a rank that
went, in a reference cycle) is found at the next full collection this class asks for, which thaws them
first.
"""

from __future__ import annotations

import asyncio
import gc
import time

from rematd.server.runtime.allocator import give_back


class Collections:
    """Collections soon after streams end: of the young generations at most one per ``interval`` seconds,
    and a full one once the streams that ended since the last received ``full_after_bytes``; and, once new
    sessions have stopped arriving for ``settle`` seconds (or every ``freeze_every`` seconds while they
    keep arriving), a young collection and a freeze of what survived it.

    A stream leaves its call's objects, the buffers of the messages it received among them, in
    reference cycles inside gRPC. The service raises the collector's thresholds (``rematd.server.run``),
    so a flood of streams that allocate few objects each but hold a message's worth of memory (a
    rejected 1 MiB hello) would wait long for a collection; and what was alive at a young collection
    moves to the oldest generation, which only a full one visits. Counting bytes keeps full
    collections as rare as the traffic that needs them. Once streams that received at least
    ``quiet_after_bytes`` have stopped ending for ``quiet`` seconds, what they left below
    ``full_after_bytes`` gets a full collection and the allocator's free pages go back to the system:
    8 rejected hellos of 1 MiB at once, each 16 MiB once parsed, left 117 MiB resident 3 s after the
    burst without this, all of it free in glibc's arenas.
    """

    def __init__(
        self,
        interval: float = 0.25,
        full_after_bytes: int = 16 << 20,
        settle: float = 2.0,
        freeze_every: float = 30.0,
        quiet: float = 1.0,
        quiet_after_bytes: int = 1 << 20,
    ) -> None:
        self.interval = interval
        self.full_after_bytes = full_after_bytes
        self.quiet = quiet
        self.quiet_after_bytes = quiet_after_bytes
        self._quiet_due = False
        self._since_quiet = 0
        self.settle = settle
        self.freeze_every = freeze_every
        self._due = False
        self._last = 0.0
        self._bytes = 0
        self._opened_at: float | None = None
        """When the latest session not yet frozen opened."""
        self._first_open: float | None = None
        self._freeze_due = False
        self.freezes = 0
        self.full = 0

    def request(self, received_bytes: int) -> None:
        """A stream ended, having received ``received_bytes``."""
        self._bytes += received_bytes
        self._since_quiet += received_bytes
        if self._due:
            return
        self._due = True
        delay = max(0.0, self._last + self.interval - time.monotonic())
        asyncio.get_running_loop().call_later(delay, self._collect)

    def opened(self) -> None:
        """A session opened: its objects will live as long as the rank, and are frozen once arrivals settle."""
        now = time.monotonic()
        self._opened_at = now
        if self._first_open is None:
            self._first_open = now
        if not self._freeze_due:
            self._freeze_due = True
            asyncio.get_running_loop().call_later(self.settle, self._maybe_freeze)

    def _maybe_freeze(self) -> None:
        now = time.monotonic()
        if self._opened_at is None or self._first_open is None:
            self._freeze_due = False
            return
        quiet = now - self._opened_at >= self.settle
        if not quiet and now - self._first_open < self.freeze_every:
            asyncio.get_running_loop().call_later(self._opened_at + self.settle - now, self._maybe_freeze)
            return
        self._freeze_due = False
        self._opened_at = self._first_open = None
        # Young garbage is found first, so that only what survives is frozen.
        gc.collect(1)
        gc.freeze()
        self.freezes += 1

    def _collect(self) -> None:
        self._due = False
        self._last = time.monotonic()
        if self._bytes >= self.full_after_bytes:
            self._full()
        else:
            gc.collect(1)
        if self._since_quiet >= self.quiet_after_bytes and not self._quiet_due:
            self._quiet_due = True
            asyncio.get_running_loop().call_later(self.quiet, self._when_quiet)
        # The ended streams' messages are freed now: their pages go back to the system, not to idle arenas.
        give_back()

    def _full(self) -> None:
        self._bytes = 0
        # Thawed first: what ended streams left behind may be among the frozen objects.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.full += 1

    def _when_quiet(self) -> None:
        """Once no stream has ended for ``quiet`` seconds: a full collection for what the last streams left,
        and the free pages back to the system. Some of a stream's memory is freed only after the collection
        that follows its end (gRPC lets go of a call's buffers later): this trim finds it free."""
        since = time.monotonic() - self._last
        if since < self.quiet:
            asyncio.get_running_loop().call_later(self.quiet - since, self._when_quiet)
            return
        self._quiet_due = False
        self._since_quiet = 0
        if self._bytes >= self.quiet_after_bytes:
            self._full()
        give_back()
