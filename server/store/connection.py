"""The store's connection to its database, and whether writes to it succeed.

Opening the database (its schema brought up to date), the one lock every write of this process takes, the
tracking of failed writes (readiness and a metric show a store that cannot be written), the probes that find
out when it takes them again, the SQLite file's watch, the write-behind buffer's flushing thread, and closing.
The store's writes (``store_writes``) and reads (``store_reads``) go through what this holds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy import exc as sa_exc

from rematd.server.config import StoreConfig
from rematd.server.store import schema
from rematd.server.store.columns import Params
from rematd.server.store.conflicts import Transactions
from rematd.server.store.database import StoreError, database_url, dialect_of, open_engine, unpooled, warm, why
from rematd.server.store.file_watch import FileWatch, Keeper, check_journal, sqlite_file
from rematd.server.store.holders import HOLDER_TIMEOUT_SECONDS, new_holder
from rematd.server.store.write_behind import WriteBehind
from rematd.server.store.write_probe import WriteProbe

log = logging.getLogger("rematd.server")


def _opened(url: str, path: str, lock: threading.RLock) -> Engine:
    """An engine on ``url`` with the schema brought up to date; StoreError naming what is wrong."""
    try:
        file = sqlite_file(url)
        if file:
            check_journal(file)
        engine = open_engine(url)
        schema.migrate(engine, path=path, lock=lock)
    except StoreError:
        raise
    except (sa_exc.SQLAlchemyError, OSError, ImportError) as err:
        raise StoreError(why(err)) from err
    return engine


_PROBE = "INSERT INTO write_probe VALUES (1, :t) ON CONFLICT(id) DO UPDATE SET written_at = excluded.written_at"


class StoreConnection:
    """The database the store is opened on, and the health of its writes.

    ``engine`` (a SQLAlchemy ``Engine``) is the one every statement goes through; ``buffer`` holds
    step statistics not yet written.
    """

    def __init__(self, db: str | Path | StoreConfig) -> None:
        config = db if isinstance(db, StoreConfig) else StoreConfig(url=database_url(db))
        url = config.url if "://" in config.url else database_url(config.url)
        self.path = str(db) if not isinstance(db, StoreConfig) else url
        self.dialect = dialect_of(url)
        self.config = config
        self._lock = threading.RLock()
        self.engine = _opened(url, self.path, self._lock)
        """The SQLAlchemy engine every statement of the store goes through. Tests may listen to its events:
        ``sqlalchemy.event.listen(store.engine, "before_cursor_execute", slow)`` with a ``slow`` that sleeps
        makes a slow database without a mock (``slow(conn, cursor, statement, parameters, context, many)``)."""
        warm(self.engine)
        self.transactions = Transactions(self.engine, self._lock)
        """Every write's transaction, run again when the database ends it to settle a conflict."""
        self.buffer = WriteBehind(self.transactions, config.max_buffered)
        file = sqlite_file(url)
        self.watch = FileWatch(file) if file else None
        """The SQLite file the store was opened on (None for PostgreSQL or memory)."""
        self.keeper = Keeper(file) if file else None
        self.failing_since: float | None = None
        """When (monotonic) writes to the store began to fail; None while they succeed."""
        self.last_failure = ""
        self.on_write_failure: Callable[[], None] | None = None
        """Called once per failed write (the core counts them in a metric)."""
        self._last_probe = 0.0
        self._probe_engine = unpooled(self.engine) if self.dialect != "sqlite" else None
        self._server_probe = WriteProbe(self._probe_server) if self.dialect != "sqlite" else None
        """A database server's probe writes, on a thread of their own from the start, each over a new connection
        (None for SQLite)."""
        self.lost = ""
        """Why the store's file is not the store any more ("" while it is): writes stop until it is back."""
        self.holder = new_holder()
        """This process's name on the ranks it opens (``holders``)."""
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="rematd-store-flush", daemon=True)
        self._flusher.start()
        if self._server_probe is not None:
            self._server_probe.start()  # the store's state is whole: a probe may record a failure in it

    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return schema.version(conn, self.path)

    def close(self) -> None:
        """Write what is buffered and let go of the database; a store that cannot be written loses the
        buffered rows, said in one line of the log, rather than failing the shutdown."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server_probe is not None:
            self._server_probe.close()
        if self._probe_engine is not None:
            self._probe_engine.dispose()
        self._flusher.join(5)
        pending = self.pending()
        try:
            self.flush()
        except Exception as err:
            log.error("the store cannot be written (%s): %d buffered step report(s) are lost", why(err), pending)
        with contextlib.suppress(Exception):
            # A process that stopped holds nothing: a rank it left connected reads as lost at once.
            self._write("DELETE FROM holders WHERE holder=:holder", {"holder": self.holder})
        self.engine.dispose()
        if self.keeper is not None:
            if self.check_file():
                self._journal_aside()  # again: nothing may have reached it since, but nothing must be left
            self.keeper.close()
        if self.watch is not None:
            self.watch.close()

    # -- the health of writes ------------------------------------------------------------

    def check_file(self) -> str:
        """Look at the store's file (deleted, replaced, truncated?); returns why it is lost, or ""."""
        if self.watch is None:
            return ""
        problem = self.watch.problem()
        if problem and not self.lost:
            self._journal_aside()
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

    def _journal_aside(self) -> None:
        """The file moved away: its journal, which names the path, goes into the file itself now, so that
        whatever takes the path (another application's database) is not handed the store's pages."""
        if self.keeper is None or self.watch is None or not self.watch.moved:
            return
        with self._lock:
            emptied = self.keeper.empty_journal()
        if not emptied:
            log.error("the journal %s-wal could not be emptied into the store's own file", self.watch.path)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Track whether writes succeed: readiness and a metric show a store that cannot be written."""
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
        """Whether the store takes writes, answered without waiting on the database. While writes to a SQLite
        file fail, a probe write (at most one per ``probe_every`` seconds) finds out when it takes them again,
        with or without traffic: only the probe clears a failure, since a write that changed nothing succeeds
        on a full disk too. A database server is probed on a thread of its own all the time
        (:class:`WriteProbe`), so that readiness fails while it cannot be reached, or does not answer, even
        when nothing else writes."""
        if self.check_file():
            return False
        if self._server_probe is not None:
            problem, since = self._server_probe.problem()
            if problem:
                if self.failing_since is None:
                    self.failing_since = since if since is not None else time.monotonic()
                self.last_failure = problem
            return not problem and self.failing_since is None
        if self.failing_since is None:
            return True
        now = time.monotonic()
        if now - self._last_probe >= probe_every:
            self._last_probe = now
            with contextlib.suppress(Exception):
                self._probe_write()
        return self.failing_since is None

    def stalled(self) -> str:
        """Why the database server is not answering, known without waiting on it ("" while it answers, and for
        SQLite): work that would wait on it should not start."""
        return self._server_probe.late() if self._server_probe is not None else ""

    def _probe_write(self) -> None:
        """A write of a new value (SQLite skips a write that leaves a row as it was); its success clears a
        failure."""
        with self._writing():
            self.transactions.run(lambda conn: conn.execute(text(_PROBE), {"t": time.time()}))
        self.failing_since = None

    def _probe_server(self) -> None:
        """:meth:`_probe_write` over a connection opened for it, as a hello needs one when the pool must grow:
        a server out of connections refuses it while the pool's own still work, and the store is not ready."""
        assert self._probe_engine is not None
        with self._writing(), self._probe_engine.begin() as conn:
            conn.execute(text(_PROBE), {"t": time.time()})
        self.failing_since = None

    def _write(self, sql: str, params: Params | list[Params]) -> None:
        with self._writing():
            self.transactions.run(lambda conn: conn.execute(text(sql), params))

    def _read(self, sql: str, params: Params | None = None, *, fresh: bool = True) -> list[Params]:
        """Rows of a query; ``fresh`` (for what the buffer holds) writes the buffer first."""
        if fresh:
            try:
                self.flush()
            except Exception:  # a store that cannot be written can still be read: without the buffered rows
                log.warning("reading the store without its buffered rows: %s", self.last_failure)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql), params or {}).mappings()]

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

    def _liveness(self) -> Params:
        """The parameters of ``RANK_STATE``."""
        return {"holder": self.holder, "alive": time.time() - HOLDER_TIMEOUT_SECONDS}

    def _flush_loop(self) -> None:
        """The write-behind thread: writes the buffer every ``flush_seconds`` until the store closes."""
        failing = False
        while not self._closed.wait(self.config.flush_seconds):
            try:
                self.check_file()
                self.flush()
            except Exception:  # the next round tries again; a lost database must not kill the thread
                if not failing:  # once per outage, not four times a second
                    log.error("writing step reports to the store failed (%s); retrying", self.last_failure)
                failing = True
            else:
                if failing and self.failing_since is None:
                    log.info("the store takes writes again")
                    failing = False
