"""The record of jobs, plans, stats and OOM events: SQLite by default, PostgreSQL by URL.

SQLAlchemy Core over hand-written, numbered migrations. The parts, each its own module:
reaching the database (``database``), the schema and its migrations (``schema``), how columns
hold values (``rows``), the plumbing writes and reads share (``record``), the writes and the
write-behind thread (``store_writes``, ``writebehind``), the reads (``store_reads``) and the
compaction (``compaction``). ``Store`` puts them together; the names other modules import from
here stay here.

A slow database, for a test without a mock: a ``before_cursor_execute`` listener on
``Store.engine`` runs before every statement the store sends, the write-behind buffer's included.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from pathlib import Path

from sqlalchemy import exc as sa_exc

from rematd.server import schema
from rematd.server.compaction import compact
from rematd.server.config import StoreConfig
from rematd.server.database import (
    StoreError,
    database_url,
    dialect_of,
    is_record_error,
    open_engine,
    redact_url,
    why,
)
from rematd.server.record_file import FileWatch, sqlite_file
from rematd.server.rows import RECOMPUTE, STORE, derived_modes, pack_modes, unpack_modes
from rematd.server.schema import _TYPES, MIGRATIONS, SCHEMA_VERSION
from rematd.server.store_reads import StoreReads
from rematd.server.store_writes import StoreWrites

__all__ = [
    "MIGRATIONS",
    "RECOMPUTE",
    "SCHEMA_VERSION",
    "STORE",
    "_TYPES",
    "Store",
    "StoreConfig",
    "StoreError",
    "database_url",
    "derived_modes",
    "is_record_error",
    "pack_modes",
    "redact_url",
    "unpack_modes",
]

log = logging.getLogger("rematd.server")


class Store(StoreWrites, StoreReads):
    """Thread-safe access to the record.

    ``engine`` (a SQLAlchemy ``Engine``) is the one every statement goes through; ``buffer`` holds
    step statistics not yet written.
    """

    def __init__(self, db: str | Path | StoreConfig) -> None:
        config = db if isinstance(db, StoreConfig) else StoreConfig(url=database_url(db))
        url = config.url if "://" in config.url else database_url(config.url)
        self.path = str(db) if not isinstance(db, StoreConfig) else url
        self.dialect = dialect_of(url)
        lock = threading.RLock()
        try:
            engine = open_engine(url)
            schema.migrate(engine, path=self.path, lock=lock)
        except StoreError:
            raise
        except (sa_exc.SQLAlchemyError, OSError, ImportError) as err:
            raise StoreError(why(err)) from err
        super().__init__(engine, config, lock)
        file = sqlite_file(url)
        self.watch = FileWatch(file) if file else None
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="rematd-store-flush", daemon=True)
        self._flusher.start()

    def migrate(self) -> None:
        """Bring the schema up to date (``Store`` does on opening the record): each missing migration, atomically."""
        schema.migrate(self.engine, path=self.path, lock=self._lock)

    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return schema.version(conn, self.path)

    def compact(self, now: float | None = None, live: Collection[str] = ()) -> dict[str, int]:
        """Down-sample old statistics and apply retention, keeping every row of the ``live`` jobs; returns rows
        deleted by kind."""
        self.flush()
        with self._writing(), self._lock, self.engine.begin() as conn:
            return compact(conn, self.config, time.time() if now is None else now, live)

    def close(self) -> None:
        """Write what is buffered and let go of the database; a record that cannot be written loses the
        buffered rows, said in one line of the log, rather than failing the shutdown."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._flusher.join(5)
        pending = self.pending()
        try:
            self.flush()
        except Exception as err:
            log.error("the record cannot be written (%s): %d buffered step report(s) are lost", why(err), pending)
        self.engine.dispose()
