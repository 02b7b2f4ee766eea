"""How the store talks to its database: one write lock, the health of writes, reads that see the buffer.

Every write of this process takes one lock (SQLite has one writer; PostgreSQL gets the same
serialisation per process, which is cheap because the write-behind buffer turns many small writes
into few transactions). Reads take no lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Engine, text

from rematd.server.config import StoreConfig
from rematd.server.database import StoreError, why
from rematd.server.record_file import FileWatch
from rematd.server.writebehind import WriteBehind

log = logging.getLogger("rematd.server")


class RecordAccess:
    """The plumbing the store's writes and reads share."""

    def __init__(self, engine: Engine, config: StoreConfig, write_lock: threading.RLock) -> None:
        self.engine = engine
        """The SQLAlchemy engine every statement of the store goes through. Tests may listen to its events:
        ``sqlalchemy.event.listen(store.engine, "before_cursor_execute", slow)`` with a ``slow`` that sleeps
        makes a slow database without a mock (``slow(conn, cursor, statement, parameters, context, many)``)."""
        self.config = config
        self._lock = write_lock
        self.failing_since: float | None = None
        """When (monotonic) writes to the record began to fail; None while they succeed."""
        self.last_failure = ""
        self.on_write_failure: Callable[[], None] | None = None
        """Called once per failed write (the core counts them in a metric)."""
        self._last_probe = 0.0
        self.buffer = WriteBehind(engine, write_lock, config.max_buffered)
        self.watch: FileWatch | None = None
        """The SQLite file the record was opened on (None for PostgreSQL or memory)."""
        self.lost = ""
        """Why the record's file is not the record any more ("" while it is): writes stop until it is back."""

    def check_file(self) -> str:
        """Look at the record's file (deleted, replaced, truncated?); returns why it is lost, or ""."""
        if self.watch is None:
            return ""
        problem = self.watch.problem()
        if problem and not self.lost:
            log.error(
                "%s; writes stop (step reports are kept in memory, the newest %d) until it is back or the service "
                "restarts",
                problem,
                self.buffer.max_buffered * 4,
            )
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            self.last_failure = problem
        elif self.lost and not problem:
            log.info("the database file %s is back; writes resume", self.watch.path)
        self.lost = problem
        return problem

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Track whether writes succeed: readiness and a metric show a record that cannot be written."""
        try:
            if self.lost:
                # Not into a file no name reaches, nor into a fresh empty one.
                raise StoreError(self.lost)
            yield
        except Exception as err:
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            self.last_failure = why(err)
            if self.on_write_failure is not None:
                self.on_write_failure()
            raise

    def writable(self, probe_every: float = 1.0) -> bool:
        """Whether the record takes writes. While writes fail, a probe write (at most one per
        ``probe_every`` seconds) finds out when it takes them again, with or without traffic: only
        the probe clears a failure, since a write that changed nothing succeeds on a full disk too."""
        if self.check_file():
            return False
        if self.failing_since is None:
            return True
        now = time.monotonic()
        if now - self._last_probe >= probe_every:
            self._last_probe = now
            with contextlib.suppress(Exception), self._writing(), self._lock, self.engine.begin() as conn:
                # A new value each time: SQLite skips a write that leaves a row as it was.
                conn.execute(
                    text(
                        "INSERT INTO write_probe VALUES (1, :t) "
                        "ON CONFLICT(id) DO UPDATE SET written_at = excluded.written_at"
                    ),
                    {"t": time.time()},
                )
                self.failing_since = None
        return self.failing_since is None

    def _write(self, sql: str, params: dict[str, Any] | list[dict[str, Any]]) -> None:
        with self._writing(), self._lock, self.engine.begin() as conn:
            conn.execute(text(sql), params)

    def _read(self, sql: str, params: dict[str, Any] | None = None, *, fresh: bool = True) -> list[Any]:
        """Rows of a query; ``fresh`` (for what the buffer holds) writes the buffer first."""
        if fresh:
            try:
                self.flush()
            except Exception:  # a record that cannot be written can still be read: without the buffered rows
                log.warning("reading the record without its buffered rows: %s", self.last_failure)
        with self.engine.connect() as conn:
            return list(conn.execute(text(sql), params or {}).mappings().all())

    def pending(self) -> int:
        return self.buffer.pending()

    def flush(self) -> None:
        """Write buffered statistics in one transaction (rows the database refuses are set aside)."""
        if self.buffer.idle():
            return
        if self.lost:
            self.buffer.bound()
        with self._writing():
            self.buffer.flush()
