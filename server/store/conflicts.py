"""Transactions the database ends to settle a conflict between two of them, run again.

PostgreSQL rolls back one transaction of a deadlock, or one that cannot be serialised after another, and
says to run it again (SQLSTATE class 40): nothing is wrong with the database nor with what was written. Two
replicas (or two workers) of the service write the same job's rows, a rank's hello on one while the other
writes the stream's last statistics, so such a conflict is rare but normal. Every transaction of the store
takes a job's row before its ranks' rows, which leaves no deadlock among its own writes; a conflict with
anything else (an operator's session, a migration) is run again here, with a short jittered pause, rather
than failing a hello or counting the store as failing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc

_R = TypeVar("_R")

CONFLICT_SQLSTATES = frozenset({"40P01", "40001"})
"""deadlock_detected and serialization_failure: the transaction was rolled back and may simply run again."""
ATTEMPTS = 4
"""Runs of one transaction at most; the last conflict is raised."""
PAUSE_SECONDS = 0.02
"""The pause before the first run again, doubled before each next one (each jittered by half)."""


def conflicted(err: BaseException) -> bool:
    """Whether ``err`` is the database settling a conflict between transactions (worth running again)."""
    return isinstance(err, sa_exc.DBAPIError) and getattr(err.orig, "sqlstate", None) in CONFLICT_SQLSTATES


class Transactions:
    """Runs a function in one transaction under the store's write lock, again after a conflict."""

    def __init__(self, engine: Engine, lock: AbstractContextManager[object]) -> None:
        self.engine = engine
        self._lock = lock
        self.conflicts = 0
        """Transactions the database rolled back to settle a conflict, and that ran again."""
        self.on_conflict: Callable[[], None] | None = None
        """Called once for each of them (the core counts them in a metric)."""

    def run(self, fn: Callable[[Connection], _R]) -> _R:
        """``fn(conn)`` in a transaction; run again (the lock let go meanwhile) while the database ends it with a
        conflict, at most ``ATTEMPTS`` times; any other error is raised at once."""
        attempt = 0
        while True:
            try:
                with self._lock, self.engine.begin() as conn:
                    return fn(conn)
            except sa_exc.DBAPIError as err:
                attempt += 1
                if not conflicted(err) or attempt >= ATTEMPTS:
                    raise
                self.conflicts += 1
                if self.on_conflict is not None:
                    self.on_conflict()
            time.sleep(PAUSE_SECONDS * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
