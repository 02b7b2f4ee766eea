"""The store: jobs, their ranks, plans, step statistics, OOM events, operator controls and warm-start
plans, in SQLite by default or PostgreSQL by URL.

SQLAlchemy Core over hand-written, numbered migrations (``schema``). Every write of this process takes
one lock (SQLite has one writer; PostgreSQL gets the same serialisation per process, which is cheap
because the write-behind buffer turns many small writes into few transactions); reads take none.
Plans, OOM events and operator controls are written at once (a restart loses none); step statistics
go through the write-behind buffer (``write_behind``), written at least every ``flush_seconds``.
Reads of what that buffer holds (statistics, ranks' last steps, jobs) write it first, so they see
every write before them; other reads do not wait on it.

A slow database, for a test without a mock: a ``before_cursor_execute`` listener on
``Store.engine`` runs before every statement the store sends, the write-behind buffer's included.
"""

from __future__ import annotations

from rematd.server.store.store_reads import StoreReads
from rematd.server.store.store_writes import StoreWrites


class Store(StoreWrites, StoreReads):
    """Thread-safe access to the store: its writes (``store_writes``) and reads (``store_reads``) over one
    connection (``connection``).

    ``engine`` (a SQLAlchemy ``Engine``) is the one every statement goes through; ``buffer`` holds
    step statistics not yet written.
    """
