"""Reaching the store's database: URLs, the engine, and what to say when it cannot be used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import NullPool, StaticPool

STORE_AWAY = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError)
"""Errors of the database itself being out of reach (a restart, a failover, a full pool), not of what was asked of
it: worth another try."""


class StoreError(RuntimeError):
    """The store cannot be opened: a URL rematd cannot use, a database out of reach, a file it cannot create."""


def is_store_error(err: BaseException) -> bool:
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


def redact_url(url: str) -> str:
    """A database URL without its password, for messages and logs."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def why(err: BaseException) -> str:
    """What went wrong with the store, in one line, without SQLAlchemy's background links."""
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


def dialect_of(url: str) -> str:
    return "postgresql" if url.startswith("postgresql") else "sqlite"


SQLITE_CONNECTIONS = 8
"""Connections to a SQLite file the store keeps open, opened at start (``warm``): a burst of connections that
takes every descriptor of the process for a moment must find the store with the descriptors it needs."""


def warm(engine: Engine) -> None:
    """Open the connections the pool keeps, now, while descriptors are to be had (SQLite files only)."""
    if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
        return
    held = [engine.connect() for _ in range(SQLITE_CONNECTIONS)]
    for conn in held:
        conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").close()  # opens the journal and its index
    for conn in held:
        conn.close()


PROBE_CONNECT_SECONDS = 5
"""How long a probe waits for a new connection to a database server (the probe says it is late before)."""


def unpooled(engine: Engine) -> Engine:
    """An engine on ``engine``'s database server that opens a connection for each use and closes it after."""
    # libpq's option (psycopg's drivers); another driver waits as it does.
    libpq = engine.url.get_driver_name() in ("psycopg", "psycopg2")
    connect = {"connect_timeout": PROBE_CONNECT_SECONDS} if libpq else {}
    return create_engine(engine.url, poolclass=NullPool, connect_args=connect)


def open_engine(url: str) -> Engine:
    """The engine of a store's URL; a SQLite file's folder is created."""
    if dialect_of(url) != "sqlite":
        return create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=4)
    memory = url.endswith(":memory:")
    database = make_url(url).database
    if database and not memory:
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    pooled = {} if memory else {"pool_size": SQLITE_CONNECTIONS, "max_overflow": SQLITE_CONNECTIONS}
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": 30},
        poolclass=StaticPool if memory else None,
        **pooled,
    )

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi: Any, _record: Any) -> None:
        # No journal mode here: it is the file's, set once the file is known to be rematd's.
        cur = dbapi.cursor()
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    return engine
