"""The store's schema: numbered migrations, and the runner that applies the missing ones.

Each migration is recorded in a ``schema_version`` table and applied in one transaction, by one
process at a time. A database that is not rematd's (tables of its own, another ``schema_version``)
is refused before anything in it is touched, not even SQLite's journal mode.
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
import time
from collections.abc import Iterator

from sqlalchemy import Connection, Engine, text

from rematd.server.store.database import StoreError, redact_url

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
                rank BIGINT NOT NULL, step BIGINT NOT NULL, time {FLOAT} NOT NULL,
                peak_bytes BIGINT NOT NULL, budget_bytes BIGINT NOT NULL, predicted_peak_bytes BIGINT NOT NULL,
                plan_version BIGINT NOT NULL, seq_len BIGINT NOT NULL, batch BIGINT NOT NULL,
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
        "what each rank's controller learned; a row readiness rewrites to find out the store takes writes",
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
    (
        5,
        "each step's out-of-memory risk",
        # NULL on rows written before, and on rows of clients that do not measure it.
        ("ALTER TABLE stats ADD COLUMN oom_risk {FLOAT}",),
    ),
    (
        6,
        "the step length each plan was made at",
        # NULL on plans written before.
        ("ALTER TABLE plans ADD COLUMN seq_len BIGINT",),
    ),
    (
        7,
        "which process holds each connected rank, and when each process was last seen",
        (
            # NULL on rows written before: a rank left connected by a process before it is no one's now.
            "ALTER TABLE ranks ADD COLUMN holder TEXT",
            "CREATE TABLE IF NOT EXISTS holders (holder TEXT PRIMARY KEY, seen_at {FLOAT} NOT NULL)",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]


def ddl(sql: str, dialect: str) -> str:
    return sql.format(**_TYPES[dialect])


def version(conn: Connection, path: str) -> int:
    """The store's schema version; 0 for an empty database; StoreError for another application's."""
    tables = set(conn.dialect.get_table_names(conn))
    if not tables:
        return 0
    if "schema_version" in tables:
        columns = {c["name"] for c in conn.dialect.get_columns(conn, "schema_version")}
        first = None
        if {"version", "description", "applied_at"} <= columns:
            first = conn.execute(text("SELECT description FROM schema_version WHERE version = 1")).scalar()
        if first != MIGRATIONS[0][1]:
            raise StoreError(_foreign(tables, path))
        return int(conn.execute(text("SELECT MAX(version) FROM schema_version")).scalar() or 0)
    if {"meta", "jobs", "plans"} <= tables:
        # A store from before numbered migrations: its tables are migration 1's.
        return 1
    raise StoreError(_foreign(tables, path))


def _applied(conn: Connection) -> set[int]:
    return {int(v) for v in conn.execute(text("SELECT version FROM schema_version")).scalars()}


def _foreign(tables: set[str], path: str) -> str:
    shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
    return (
        f"database {redact_url(path)} is not a rematd store (it holds tables {shown}); "
        "left untouched: give rematd a database of its own"
    )


def _sqlite_file(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:")


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """Only one process migrates at a time (workers and replicas start together)."""
    if _sqlite_file(engine):
        with open(f"{engine.url.database}.migrate-lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    else:
        yield


@contextlib.contextmanager
def _transaction(engine: Engine) -> Iterator[Connection]:
    """One transaction that DDL cannot leave: pysqlite commits before DDL on its own, so SQLite's is
    opened and closed by hand on a connection the driver does not manage."""
    if engine.dialect.name != "sqlite":
        with engine.begin() as conn:
            # Held to the end of the transaction: replicas starting together migrate one after another.
            conn.execute(text("SELECT pg_advisory_xact_lock(736572)"))
            yield conn
        return
    with engine.connect() as plain:
        conn = plain.execution_options(isolation_level="AUTOCOMMIT")
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.exec_driver_sql("ROLLBACK")
            raise
        conn.exec_driver_sql("COMMIT")


def migrate(engine: Engine, *, path: str, lock: threading.RLock) -> None:
    """Bring the schema up to date, one transaction per migration.

    Nothing is altered (not even SQLite's journal mode) before the database is known to be
    rematd's: empty, or with rematd's ``schema_version``. A migration that fails leaves the
    version before it intact, and the next start tries it again. ``lock`` is the store's write
    lock: no write of this process runs while the schema changes.
    """
    dialect = engine.dialect.name
    create = ddl(
        "CREATE TABLE IF NOT EXISTS schema_version "
        "(version BIGINT PRIMARY KEY, description TEXT NOT NULL, applied_at {FLOAT} NOT NULL)",
        dialect,
    )
    with lock, _migration_lock(engine):
        with _transaction(engine) as conn:
            current = version(conn, path)
            if current > SCHEMA_VERSION:
                raise StoreError(
                    f"database {redact_url(path)} has schema version {current}; "
                    f"this rematd knows up to {SCHEMA_VERSION}"
                )
            if current == 1 and not conn.dialect.has_table(conn, "schema_version"):
                conn.execute(text(create))
                conn.execute(
                    text("INSERT INTO schema_version VALUES (1, :d, :t)"), {"d": MIGRATIONS[0][1], "t": time.time()}
                )
            applied = _applied(conn) if current else set()
        # Each one missing, not only those above the highest applied: a store may lack one below it.
        for number, description, statements in MIGRATIONS:
            if number in applied:
                continue
            with _transaction(engine) as conn:
                conn.execute(text(create))
                if number in _applied(conn):
                    continue  # another process applied it while this one waited
                for sql in statements:
                    conn.execute(text(ddl(sql, dialect)))
                conn.execute(
                    text("INSERT INTO schema_version VALUES (:v, :d, :t)"),
                    {"v": number, "d": description, "t": time.time()},
                )
        if _sqlite_file(engine):
            with engine.connect() as plain:
                plain.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("PRAGMA journal_mode=WAL")
