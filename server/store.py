"""The record of jobs, plans, stats and OOM events: SQLite by default, PostgreSQL by URL.

SQLAlchemy Core over hand-written, numbered migrations recorded in a
``schema_version`` table. Plans, OOM events and operator controls are written
at once (a restart loses none); step statistics go through a write-behind
buffer flushed in batches, because one row per rank per second is most of the
write load (``rematd.server.writebehind``). Reads of what the buffer holds
(statistics, ranks' last steps, jobs) flush it first, so they see every write
before them; other reads do not wait on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, make_url, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import StaticPool

from rematd.server.config import StoreConfig
from rematd.server.writebehind import WriteBehind

log = logging.getLogger("rematd.server")

# Placeholders the DDL uses so one migration text fits both dialects.
_TYPES = {
    "sqlite": {"ID": "INTEGER PRIMARY KEY AUTOINCREMENT", "FLOAT": "REAL"},
    "postgresql": {"ID": "BIGSERIAL PRIMARY KEY", "FLOAT": "DOUBLE PRECISION"},
}

# Each migration is applied once, in order, inside one transaction; never edit one that shipped.
MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (
        1,
        "jobs, ranks, plans, stats, OOM events",
        (
            """CREATE TABLE IF NOT EXISTS jobs (
                job TEXT PRIMARY KEY,
                created_at {FLOAT} NOT NULL,
                updated_at {FLOAT} NOT NULL,
                world_size BIGINT NOT NULL,
                num_blocks BIGINT NOT NULL,
                budget_bytes BIGINT NOT NULL,
                model_fingerprint TEXT NOT NULL)""",
            """CREATE TABLE IF NOT EXISTS ranks (
                job TEXT NOT NULL REFERENCES jobs(job),
                rank BIGINT NOT NULL,
                device TEXT NOT NULL,
                state TEXT NOT NULL,
                last_stats TEXT,
                PRIMARY KEY (job, rank))""",
            """CREATE TABLE IF NOT EXISTS plans (
                id {ID},
                job TEXT NOT NULL REFERENCES jobs(job),
                rank BIGINT NOT NULL,
                version BIGINT NOT NULL,
                checkpoint_every BIGINT NOT NULL,
                blocks TEXT NOT NULL,
                predicted_peak_bytes BIGINT NOT NULL,
                predicted_overhead_ratio {FLOAT} NOT NULL,
                target_bytes BIGINT NOT NULL,
                reason TEXT NOT NULL,
                created_at {FLOAT} NOT NULL)""",
            "CREATE INDEX IF NOT EXISTS plans_by_job ON plans (job, id)",
            """CREATE TABLE IF NOT EXISTS stats (
                id {ID},
                job TEXT NOT NULL REFERENCES jobs(job),
                rank BIGINT NOT NULL,
                step BIGINT NOT NULL,
                time {FLOAT} NOT NULL,
                peak_bytes BIGINT NOT NULL,
                budget_bytes BIGINT NOT NULL,
                predicted_peak_bytes BIGINT NOT NULL,
                plan_version BIGINT NOT NULL,
                seq_len BIGINT NOT NULL,
                batch BIGINT NOT NULL,
                step_seconds {FLOAT} NOT NULL)""",
            "CREATE INDEX IF NOT EXISTS stats_by_job ON stats (job, id)",
            """CREATE TABLE IF NOT EXISTS oom_events (
                id {ID},
                job TEXT NOT NULL REFERENCES jobs(job),
                rank BIGINT NOT NULL,
                step BIGINT NOT NULL,
                time {FLOAT} NOT NULL,
                seq_len BIGINT NOT NULL,
                batch BIGINT NOT NULL,
                plan_version BIGINT NOT NULL,
                message TEXT NOT NULL)""",
        ),
    ),
    (
        2,
        "operator controls, fleet warm start, time-range and down-sampling indexes",
        (
            "ALTER TABLE jobs ADD COLUMN device TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE jobs ADD COLUMN ended_at {FLOAT}",
            """CREATE TABLE IF NOT EXISTS job_controls (
                job TEXT PRIMARY KEY,
                pin_blocks TEXT,
                pin_every BIGINT,
                margin_ratio {FLOAT},
                budget_bytes BIGINT,
                ended_at {FLOAT},
                revision BIGINT NOT NULL,
                updated_at {FLOAT} NOT NULL)""",
            """CREATE TABLE IF NOT EXISTS warm_plans (
                model_fingerprint TEXT NOT NULL,
                device TEXT NOT NULL,
                shape_bucket BIGINT NOT NULL,
                job TEXT NOT NULL,
                blocks TEXT NOT NULL,
                num_blocks BIGINT NOT NULL,
                budget_bytes BIGINT NOT NULL,
                updated_at {FLOAT} NOT NULL,
                PRIMARY KEY (model_fingerprint, device, shape_bucket))""",
            "CREATE INDEX IF NOT EXISTS stats_by_rank_step ON stats (job, rank, step)",
            "CREATE INDEX IF NOT EXISTS stats_by_time ON stats (job, time)",
            "CREATE INDEX IF NOT EXISTS ooms_by_job ON oom_events (job, id)",
        ),
    ),
    (
        3,
        "plans keep their modes and per-length tables; pins and warm starts by mode",
        (
            # NULL on rows written before: read back as their blocks recomputing and the rest storing.
            "ALTER TABLE plans ADD COLUMN modes TEXT",
            "ALTER TABLE plans ADD COLUMN shape_plans TEXT",
            "ALTER TABLE job_controls ADD COLUMN pin_modes TEXT",
            "ALTER TABLE warm_plans ADD COLUMN modes TEXT",
            "ALTER TABLE warm_plans ADD COLUMN shape_plans TEXT",
        ),
    ),
    (
        4,
        "what each rank's controller learned; a row readiness rewrites to find out the record takes writes",
        (
            """CREATE TABLE IF NOT EXISTS learned_state (
                job TEXT NOT NULL,
                rank BIGINT NOT NULL,
                state TEXT NOT NULL,
                updated_at {FLOAT} NOT NULL,
                PRIMARY KEY (job, rank))""",
            "CREATE TABLE IF NOT EXISTS write_probe (id BIGINT PRIMARY KEY, written_at {FLOAT} NOT NULL)",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]


class StoreError(RuntimeError):
    """The record cannot be opened: a URL rematd cannot use, a database out of reach, a file it cannot create."""


def is_record_error(err: BaseException) -> bool:
    """Whether ``err`` came from the database (or the disk under it), not from a bug in rematd."""
    return isinstance(err, (sa_exc.SQLAlchemyError, StoreError, OSError))


def database_url(db: str | Path) -> str:
    """A SQLAlchemy URL from ``--db``: a URL stays as it is, anything else is a SQLite path."""
    s = str(db)
    if "://" in s:
        if s.startswith("postgresql://"):
            # psycopg 3 is the driver the postgres extra installs.
            return "postgresql+psycopg://" + s[len("postgresql://") :]
        return s
    if s == ":memory:":
        return "sqlite:///:memory:"
    return f"sqlite:///{Path(s).expanduser()}"


def _why(err: BaseException) -> str:
    """What went wrong opening the record, in one line, without SQLAlchemy's background links."""
    if isinstance(err, sa_exc.NoSuchModuleError):
        return "no database of that kind: give a SQLite path, sqlite:///PATH or postgresql://USER@HOST/DB"
    if isinstance(err, sa_exc.ArgumentError):
        return f"not a database URL ({str(err).splitlines()[0]})"
    if isinstance(err, ImportError):
        return f"its driver is not installed ({err}); install rematd[postgres] for PostgreSQL"
    if isinstance(err, sa_exc.DBAPIError):
        return (
            f"cannot use the database: {str(err.orig).strip().splitlines()[0] if str(err.orig).strip() else err.orig!r}"
        )
    if isinstance(err, OSError):
        return f"{err.strerror or err}{f' ({err.filename})' if err.filename else ''}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def redact_url(url: str) -> str:
    """A database URL without its password, for messages and logs."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def _row(r: Any, drop: Sequence[str] = ("id", "job")) -> dict[str, Any]:
    d = dict(r)
    for k in drop:
        d.pop(k, None)
    return d


_UPSERT_JOB = """INSERT INTO jobs (job, created_at, updated_at, world_size, num_blocks, budget_bytes,
        model_fingerprint, device, ended_at)
    VALUES (:job, :now, :now, :ws, :nb, :b, :fp, :dev, NULL)
    ON CONFLICT(job) DO UPDATE SET updated_at=excluded.updated_at, world_size=excluded.world_size,
    num_blocks=excluded.num_blocks, budget_bytes=excluded.budget_bytes,
    model_fingerprint=excluded.model_fingerprint, device=excluded.device, ended_at=NULL"""
_UPSERT_RANK = """INSERT INTO ranks (job, rank, device, state) VALUES (:job, :rank, :device, :state)
    ON CONFLICT(job, rank) DO UPDATE SET device=excluded.device, state=excluded.state"""
_ADD_PLAN = """INSERT INTO plans (job, rank, version, checkpoint_every, blocks, predicted_peak_bytes,
    predicted_overhead_ratio, target_bytes, reason, created_at, modes, shape_plans)
    VALUES (:job, :rank, :version, :every, :blocks, :peak, :overhead, :target, :reason, :now, :modes, :table)"""
# A plan's rows, with the job's block count for plans recorded before modes were kept.
_PLANS = "SELECT plans.*, jobs.num_blocks AS job_blocks FROM plans JOIN jobs ON jobs.job = plans.job"

STORE, RECOMPUTE = "store", "recompute"
# Modes are kept one letter a block, as the demo prints them: a plan of 4096 blocks with a table of
# ten lengths is 40 KB of letters, where a JSON list of names would be ten times that.
_LETTER = {"store": ".", "selective": "s", "recompute": "R", "offload": "O"}
_NAME = {letter: name for name, letter in _LETTER.items()}


def pack_modes(names: Sequence[str]) -> str:
    return "".join(_LETTER[n] for n in names)


def unpack_modes(letters: str) -> list[str]:
    return [_NAME[c] for c in letters]


def _pack_table(table: Sequence[dict[str, Any]]) -> str:
    return json.dumps([{**e, "modes": pack_modes(e["modes"])} for e in table])


def _unpack_table(text: str | None) -> list[dict[str, Any]]:
    return [{**e, "modes": unpack_modes(e["modes"])} for e in json.loads(text)] if text else []


def derived_modes(blocks: Sequence[int], num_blocks: int) -> list[str]:
    """The modes of a plan recorded with blocks only: those recompute, the others store."""
    chosen = set(blocks)
    return [RECOMPUTE if i in chosen else STORE for i in range(num_blocks)]


def _plan_out(r: Any, drop: Sequence[str] = ("id", "job")) -> dict[str, Any]:
    d = _row(r, drop)
    n = d.pop("job_blocks", None)
    d["blocks"] = json.loads(d["blocks"])
    if d.get("modes") is not None:
        d["modes"] = unpack_modes(d["modes"])
    else:
        d["modes"] = derived_modes(d["blocks"], int(n) if n is not None else max(d["blocks"], default=-1) + 1)
    d["shape_plans"] = _unpack_table(d.get("shape_plans"))
    return d


def _plan_params(job: str, rank: int, plan: dict[str, Any], now: float) -> dict[str, Any]:
    return {
        "job": job,
        "rank": rank,
        "version": plan["version"],
        "every": plan["checkpoint_every"],
        "blocks": json.dumps(list(plan["blocks"])),
        "peak": plan["predicted_peak_bytes"],
        "overhead": plan["predicted_overhead_ratio"],
        "target": plan["target_bytes"],
        "reason": plan["reason"],
        "now": now,
        "modes": pack_modes(plan["modes"]) if plan.get("modes") is not None else None,
        "table": _pack_table(plan.get("shape_plans") or []),
    }


class Store:
    """Thread-safe access to the record."""

    def __init__(self, db: str | Path | StoreConfig) -> None:
        self.config = db if isinstance(db, StoreConfig) else StoreConfig(url=database_url(db))
        url = self.config.url if "://" in self.config.url else database_url(self.config.url)
        self.path = str(db) if not isinstance(db, StoreConfig) else url
        self.dialect = "postgresql" if url.startswith("postgresql") else "sqlite"
        # SQLite has one writer; PostgreSQL gets the same serialisation per process, which is cheap
        # because the write-behind buffer turns many small writes into few transactions.
        self._lock = threading.RLock()
        self._wal = False
        self.failing_since: float | None = None
        """When (monotonic) writes to the record began to fail; None while they succeed."""
        self.last_failure = ""
        self.on_write_failure: Callable[[], None] | None = None
        """Called once per failed write (the core counts them in a metric)."""
        self._last_probe = 0.0
        try:
            self.engine = self._engine(url)
            self.migrate()
        except StoreError:
            raise
        except (sa_exc.SQLAlchemyError, OSError, ImportError) as err:
            raise StoreError(_why(err)) from err
        self.buffer = WriteBehind(self.engine, self._lock, self.config.max_buffered)
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="rematd-store-flush", daemon=True)
        self._flusher.start()

    def _engine(self, url: str) -> Engine:
        if self.dialect == "sqlite":
            memory = url.endswith(":memory:")
            self._wal = not memory
            database = make_url(url).database
            if database and not memory:
                Path(database).parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(
                url,
                connect_args={"check_same_thread": False, "timeout": 30},
                poolclass=StaticPool if memory else None,
            )

            @event.listens_for(engine, "connect")
            def _pragmas(dbapi: Any, _record: Any) -> None:
                # No journal mode here: it is the file's, set once the file is known to be rematd's.
                cur = dbapi.cursor()
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()

            return engine
        return create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=4)

    # -- schema -------------------------------------------------------------------

    def _ddl(self, sql: str) -> str:
        return sql.format(**_TYPES[self.dialect])

    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return self._version(conn)

    def _version(self, conn: Connection) -> int:
        """The record's schema version; 0 for an empty database; StoreError for another application's."""
        tables = set(conn.dialect.get_table_names(conn))
        if not tables:
            return 0
        if "schema_version" in tables:
            columns = {c["name"] for c in conn.dialect.get_columns(conn, "schema_version")}
            first = None
            if {"version", "description", "applied_at"} <= columns:
                first = conn.execute(text("SELECT description FROM schema_version WHERE version = 1")).scalar()
            if first != MIGRATIONS[0][1]:
                raise StoreError(self._foreign(tables))
            return int(conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar() or 0)
        if {"meta", "jobs", "plans"} <= tables:
            # A record from before numbered migrations: its tables are migration 1's.
            return 1
        raise StoreError(self._foreign(tables))

    @staticmethod
    def _applied(conn: Connection) -> set[int]:
        return {int(v) for v in conn.execute(text("SELECT version FROM schema_version")).scalars()}

    def _foreign(self, tables: set[str]) -> str:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        return (
            f"database {redact_url(self.path)} is not a rematd record (it holds tables {shown}); "
            "left untouched: give rematd a database of its own"
        )

    @contextlib.contextmanager
    def _migration_lock(self) -> Iterator[None]:
        """Only one process migrates at a time (workers and replicas start together)."""
        url = self.engine.url
        if self.dialect == "sqlite" and url.database and url.database != ":memory:":
            with open(f"{url.database}.migrate-lock", "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
        else:
            yield

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Connection]:
        """One transaction that DDL cannot leave: pysqlite commits before DDL on its own, so SQLite's is
        opened and closed by hand on a connection the driver does not manage."""
        if self.dialect != "sqlite":
            with self.engine.begin() as conn:
                # Held to the end of the transaction: replicas starting together migrate one after another.
                conn.execute(text("SELECT pg_advisory_xact_lock(736572)"))
                yield conn
            return
        with self.engine.connect() as plain:
            conn = plain.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")

    def migrate(self) -> None:
        """Bring the schema up to date, one transaction per migration.

        Nothing is altered (not even SQLite's journal mode) before the database is known to be
        rematd's: empty, or with rematd's ``schema_version``. A migration that fails leaves the
        version before it intact, and the next start tries it again.
        """
        create = self._ddl(
            "CREATE TABLE IF NOT EXISTS schema_version "
            "(version BIGINT PRIMARY KEY, description TEXT NOT NULL, applied_at {FLOAT} NOT NULL)"
        )
        with self._lock, self._migration_lock():
            with self._transaction() as conn:
                current = self._version(conn)
                if current > SCHEMA_VERSION:
                    raise StoreError(
                        f"database {redact_url(self.path)} has schema version {current}; "
                        f"this rematd knows up to {SCHEMA_VERSION}"
                    )
                if current == 1 and not conn.dialect.has_table(conn, "schema_version"):
                    conn.execute(text(create))
                    conn.execute(
                        text("INSERT INTO schema_version VALUES (1, :d, :t)"), {"d": MIGRATIONS[0][1], "t": time.time()}
                    )
                applied = self._applied(conn) if current else set()
            # Each one missing, not only those above the highest applied: a record may lack one below it.
            for version, description, statements in MIGRATIONS:
                if version in applied:
                    continue
                with self._transaction() as conn:
                    conn.execute(text(create))
                    if version in self._applied(conn):
                        continue  # another process applied it while this one waited
                    for sql in statements:
                        conn.execute(text(self._ddl(sql)))
                    conn.execute(
                        text("INSERT INTO schema_version VALUES (:v, :d, :t)"),
                        {"v": version, "d": description, "t": time.time()},
                    )
            if self._wal:
                with self.engine.connect() as plain:
                    plain.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("PRAGMA journal_mode=WAL")

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
            log.error("the record cannot be written (%s): %d buffered step report(s) are lost", _why(err), pending)
        self.engine.dispose()

    # -- health -------------------------------------------------------------------

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Track whether writes succeed: readiness and a metric show a record that cannot be written."""
        try:
            yield
        except Exception as err:
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            self.last_failure = _why(err)
            if self.on_write_failure is not None:
                self.on_write_failure()
            raise

    def writable(self, probe_every: float = 1.0) -> bool:
        """Whether the record takes writes. While writes fail, a probe write (at most one per
        ``probe_every`` seconds) finds out when it takes them again, with or without traffic: only
        the probe clears a failure, since a write that changed nothing succeeds on a full disk too."""
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

    # -- plumbing -----------------------------------------------------------------

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

    def _flush_loop(self) -> None:
        failing = False
        while not self._closed.wait(self.config.flush_seconds):
            try:
                self.flush()
            except Exception:  # the next round tries again; a lost database must not kill the thread
                if not failing:  # once per outage, not four times a second
                    log.error("writing step reports to the record failed (%s); retrying", self.last_failure)
                failing = True
            else:
                if failing and self.failing_since is None:
                    log.info("the record takes writes again")
                    failing = False

    def pending(self) -> int:
        return self.buffer.pending()

    def flush(self) -> None:
        """Write buffered statistics in one transaction (rows the database refuses are set aside)."""
        if not self.buffer.pending():
            return
        with self._writing():
            self.buffer.flush()

    # -- writes -------------------------------------------------------------------

    def open_rank(
        self,
        *,
        job: str,
        rank: int,
        now: float,
        world_size: int,
        num_blocks: int,
        budget_bytes: int,
        fingerprint: str,
        device: str = "",
        plan: dict[str, Any] | None = None,
    ) -> None:
        """A rank's hello, in one transaction: its job, the rank as connected, the plan it starts on."""
        with self._writing(), self._lock, self.engine.begin() as conn:
            conn.execute(
                text(_UPSERT_JOB),
                {"job": job, "now": now, "ws": world_size, "nb": num_blocks, "b": budget_bytes, "fp": fingerprint,
                 "dev": device},
            )  # fmt: skip
            conn.execute(text(_UPSERT_RANK), {"job": job, "rank": rank, "device": device, "state": "connected"})
            if plan is not None:
                conn.execute(text(_ADD_PLAN), _plan_params(job, rank, plan, now))

    def set_rank_state(self, *, job: str, rank: int | None = None, state: str) -> None:
        if rank is None:
            self._write("UPDATE ranks SET state=:state WHERE job=:job", {"state": state, "job": job})
        else:
            self._write(
                "UPDATE ranks SET state=:state WHERE job=:job AND rank=:rank",
                {"state": state, "job": job, "rank": rank},
            )

    def end_job(self, job: str, now: float) -> None:
        self._write("UPDATE jobs SET ended_at=:now WHERE job=:job", {"now": now, "job": job})

    def end_job_if_done(self, job: str, now: float) -> None:
        """Mark the job ended when every rank the record has of it said goodbye (on any worker or replica)."""
        self._write(
            """UPDATE jobs SET ended_at=:now WHERE job=:job AND ended_at IS NULL AND NOT EXISTS
               (SELECT 1 FROM ranks WHERE ranks.job=:job AND ranks.state <> 'ended')""",
            {"now": now, "job": job},
        )

    def add_plan(self, *, job: str, rank: int, plan: dict[str, Any], now: float) -> None:
        self._write(_ADD_PLAN, _plan_params(job, rank, plan, now))

    def add_stats(self, *, job: str, rank: int, row: dict[str, Any]) -> None:
        """Buffer one step's statistics; written within ``flush_seconds``."""
        if self.buffer.add(job=job, rank=rank, row=row):
            self.flush()

    def add_oom(self, *, job: str, rank: int, row: dict[str, Any]) -> None:
        self._write(
            """INSERT INTO oom_events (job, rank, step, time, seq_len, batch, plan_version, message)
               VALUES (:job, :rank, :step, :time, :seq_len, :batch, :plan_version, :message)""",
            {**{k: row[k] for k in ("step", "time", "seq_len", "batch", "plan_version", "message")},
             "job": job, "rank": rank},
        )  # fmt: skip

    def set_controls(self, job: str, controls: dict[str, Any], now: float) -> int:
        """Replace a job's operator controls; returns their new revision."""
        with self._writing(), self._lock, self.engine.begin() as conn:
            rev = int(conn.execute(text("SELECT COALESCE(MAX(revision), 0) FROM job_controls")).scalar() or 0) + 1
            params = {
                "job": job,
                "pb": json.dumps(controls["pin_blocks"]) if controls.get("pin_blocks") is not None else None,
                "pm": pack_modes(controls["pin_modes"]) if controls.get("pin_modes") is not None else None,
                "pe": controls.get("pin_every"),
                "mr": controls.get("margin_ratio"),
                "bb": controls.get("budget_bytes"),
                "ea": controls.get("ended_at"),
                "rev": rev,
                "now": now,
            }
            conn.execute(
                text(
                    """INSERT INTO job_controls (job, pin_blocks, pin_every, margin_ratio, budget_bytes, ended_at,
                       revision, updated_at, pin_modes) VALUES (:job, :pb, :pe, :mr, :bb, :ea, :rev, :now, :pm)
                       ON CONFLICT(job) DO UPDATE SET pin_blocks=excluded.pin_blocks, pin_every=excluded.pin_every,
                       pin_modes=excluded.pin_modes,
                       margin_ratio=excluded.margin_ratio, budget_bytes=excluded.budget_bytes,
                       ended_at=excluded.ended_at, revision=excluded.revision, updated_at=excluded.updated_at"""
                ),
                params,
            )
            return rev

    def controls_since(self, revision: int) -> list[dict[str, Any]]:
        """Controls changed after ``revision`` (every worker and replica polls this)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                text("SELECT * FROM job_controls WHERE revision > :r ORDER BY revision"), {"r": revision}
            ).mappings()
            out = []
            for r in rows:
                d = dict(r)
                d["pin_blocks"] = json.loads(d["pin_blocks"]) if d["pin_blocks"] is not None else None
                d["pin_modes"] = unpack_modes(d["pin_modes"]) if d.get("pin_modes") is not None else None
                out.append(d)
            return out

    def remember_warm_plan(
        self,
        *,
        fingerprint: str,
        device: str,
        bucket: int,
        job: str,
        blocks: Sequence[int],
        num_blocks: int,
        budget_bytes: int,
        now: float,
        modes: Sequence[str] | None = None,
        shape_plans: Sequence[dict[str, Any]] = (),
    ) -> None:
        self._write(
            """INSERT INTO warm_plans (model_fingerprint, device, shape_bucket, job, blocks, num_blocks, budget_bytes,
               updated_at, modes, shape_plans) VALUES (:fp, :dev, :bucket, :job, :blocks, :nb, :budget, :now, :modes,
               :table)
               ON CONFLICT(model_fingerprint, device, shape_bucket) DO UPDATE SET job=excluded.job,
               blocks=excluded.blocks, num_blocks=excluded.num_blocks, budget_bytes=excluded.budget_bytes,
               updated_at=excluded.updated_at, modes=excluded.modes, shape_plans=excluded.shape_plans""",
            {"fp": fingerprint, "dev": device, "bucket": bucket, "job": job, "blocks": json.dumps(list(blocks)),
             "nb": num_blocks, "budget": budget_bytes, "now": now,
             "modes": pack_modes(modes) if modes is not None else None, "table": _pack_table(shape_plans)},
        )  # fmt: skip

    def warm_plan(self, *, fingerprint: str, device: str, bucket: int) -> dict[str, Any] | None:
        rows = self._read(
            "SELECT * FROM warm_plans WHERE model_fingerprint=:fp AND device=:dev AND shape_bucket=:bucket",
            {"fp": fingerprint, "dev": device, "bucket": bucket},
            fresh=False,
        )
        if not rows:
            return None
        d = dict(rows[0])
        d["blocks"] = json.loads(d["blocks"])
        has = d.get("modes") is not None
        d["modes"] = unpack_modes(d["modes"]) if has else derived_modes(d["blocks"], int(d["num_blocks"]))
        d["shape_plans"] = _unpack_table(d.get("shape_plans"))
        return d

    def save_learned(self, *, job: str, rank: int, state: dict[str, Any], now: float) -> None:
        """What a rank's controller learned, kept beside its plan history for a restarted service."""
        self._write(
            """INSERT INTO learned_state VALUES (:job, :rank, :state, :now)
               ON CONFLICT(job, rank) DO UPDATE SET state=excluded.state, updated_at=excluded.updated_at""",
            {"job": job, "rank": rank, "state": json.dumps(state), "now": now},
        )

    def learned(self, *, job: str, rank: int) -> dict[str, Any] | None:
        rows = self._read(
            "SELECT state FROM learned_state WHERE job=:job AND rank=:rank", {"job": job, "rank": rank}, fresh=False
        )
        if not rows:
            return None
        state = json.loads(rows[0]["state"])
        return state if isinstance(state, dict) else None

    # -- housekeeping -------------------------------------------------------------

    def compact(self, now: float | None = None) -> dict[str, int]:
        """Down-sample old statistics and apply retention; returns rows deleted by kind."""
        self.flush()
        now = time.time() if now is None else now
        cutoff = now - self.config.retention_days * 86400.0
        with self._lock, self.engine.begin() as conn:
            # Beyond the latest keep_steps per rank, keep the highest peak of each time bucket.
            sampled = conn.execute(
                text(
                    """DELETE FROM stats WHERE id IN (
                         SELECT id FROM (
                           SELECT id,
                             ROW_NUMBER() OVER (PARTITION BY job, rank ORDER BY step DESC, id DESC) AS age,
                             ROW_NUMBER() OVER (PARTITION BY job, rank, CAST(time / :bucket AS BIGINT)
                                                ORDER BY peak_bytes DESC, id) AS pick
                           FROM stats) t
                         WHERE t.age > :keep AND t.pick > 1)"""
                ),
                {"bucket": self.config.bucket_seconds, "keep": self.config.keep_steps},
            ).rowcount
            old_stats = conn.execute(text("DELETE FROM stats WHERE time < :c"), {"c": cutoff}).rowcount
            old_ooms = conn.execute(text("DELETE FROM oom_events WHERE time < :c"), {"c": cutoff}).rowcount
            idle = [
                r[0]
                for r in conn.execute(
                    text(
                        """SELECT job FROM jobs WHERE updated_at < :c AND NOT EXISTS
                           (SELECT 1 FROM ranks WHERE ranks.job = jobs.job AND ranks.state = 'connected')"""
                    ),
                    {"c": cutoff},
                )
            ]
            for job in idle:
                for table in ("stats", "oom_events", "plans", "learned_state", "ranks", "job_controls", "jobs"):
                    conn.execute(text(f"DELETE FROM {table} WHERE job=:j"), {"j": job})
            conn.execute(text("DELETE FROM warm_plans WHERE updated_at < :c"), {"c": cutoff})
        return {"downsampled": sampled, "expired_stats": old_stats, "expired_ooms": old_ooms, "expired_jobs": len(idle)}

    # -- reads --------------------------------------------------------------------

    def jobs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._read("SELECT * FROM jobs ORDER BY created_at, job")]

    def job(self, job: str) -> dict[str, Any] | None:
        rows = self._read("SELECT * FROM jobs WHERE job=:job", {"job": job})
        return dict(rows[0]) if rows else None

    def all_ranks(self) -> list[dict[str, Any]]:
        out = []
        for r in self._read("SELECT * FROM ranks ORDER BY job, rank"):
            d = dict(r)
            d["last_stats"] = json.loads(d["last_stats"]) if d["last_stats"] else None
            out.append(d)
        return out

    def last_rank_stats(self, job: str, rank: int) -> dict[str, Any] | None:
        """A rank's last statistics: the buffer's newest if it holds one, else the record's. The buffer is
        not written first: a hello must not wait for other jobs' rows."""
        pending = self.buffer.last(job, rank)
        if pending is not None:
            return pending
        rows = self._read(
            "SELECT last_stats FROM ranks WHERE job=:job AND rank=:rank", {"job": job, "rank": rank}, fresh=False
        )
        return json.loads(rows[0]["last_stats"]) if rows and rows[0]["last_stats"] else None

    def ranks(self, job: str) -> list[dict[str, Any]]:
        out = []
        for r in self._read("SELECT * FROM ranks WHERE job=:job ORDER BY rank", {"job": job}):
            d = dict(r)
            d["last_stats"] = json.loads(d["last_stats"]) if d["last_stats"] else None
            out.append(d)
        return out

    def plans(self, job: str) -> list[dict[str, Any]]:
        out = []
        for r in self._read(f"{_PLANS} WHERE plans.job=:job ORDER BY plans.id", {"job": job}, fresh=False):
            out.append(_plan_out(r))
        return out

    def latest_rank_plans(self) -> dict[tuple[str, int], dict[str, Any]]:
        """Each rank's newest plan, by (job, rank)."""
        rows = self._read(f"{_PLANS} WHERE plans.id IN (SELECT MAX(id) FROM plans GROUP BY job, rank)", fresh=False)
        out = {}
        for r in rows:
            d = _plan_out(r, ("id",))
            out[(d.pop("job"), int(d["rank"]))] = d
        return out

    def latest_plans(self) -> dict[str, dict[str, Any]]:
        """Each job's newest plan."""
        rows = self._read(f"{_PLANS} WHERE plans.id IN (SELECT MAX(id) FROM plans GROUP BY job)", fresh=False)
        out = {}
        for r in rows:
            d = _plan_out(r, ("id",))
            out[d.pop("job")] = d
        return out

    def stats(
        self,
        job: str,
        limit: int,
        *,
        since: float | None = None,
        until: float | None = None,
        rank: int | None = None,
    ) -> list[dict[str, Any]]:
        where = ["job=:job"]
        params: dict[str, Any] = {"job": job, "limit": limit}
        if since is not None:
            where.append("time >= :since")
            params["since"] = since
        if until is not None:
            where.append("time <= :until")
            params["until"] = until
        if rank is not None:
            where.append("rank = :rank")
            params["rank"] = rank
        rows = self._read(
            f"SELECT * FROM (SELECT * FROM stats WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT :limit) t "
            "ORDER BY id",
            params,
        )
        return [_row(r) for r in rows]

    def count_stats(self, job: str | None = None) -> int:
        if job is None:
            rows = self._read("SELECT COUNT(*) AS n FROM stats")
        else:
            rows = self._read("SELECT COUNT(*) AS n FROM stats WHERE job=:job", {"job": job})
        return int(rows[0]["n"])

    def last_plan_version(self, job: str, rank: int) -> int:
        rows = self._read(
            "SELECT MAX(version) AS v FROM plans WHERE job=:job AND rank=:rank",
            {"job": job, "rank": rank},
            fresh=False,
        )
        return int(rows[0]["v"] or 0)

    def last_plan(self, job: str, rank: int) -> dict[str, Any] | None:
        rows = self._read(
            f"{_PLANS} WHERE plans.job=:job AND plans.rank=:rank ORDER BY plans.id DESC LIMIT 1",
            {"job": job, "rank": rank},
            fresh=False,
        )
        return _plan_out(rows[0]) if rows else None

    def ooms(self, job: str) -> list[dict[str, Any]]:
        return [
            _row(r)
            for r in self._read("SELECT * FROM oom_events WHERE job=:job ORDER BY id", {"job": job}, fresh=False)
        ]

    def oom_counts(self) -> dict[str, int]:
        return {
            r["job"]: int(r["n"])
            for r in self._read("SELECT job, COUNT(*) AS n FROM oom_events GROUP BY job", fresh=False)
        }
