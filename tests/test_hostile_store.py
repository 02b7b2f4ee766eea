"""A store that is rematd's or refused: atomic migrations, foreign databases left untouched (SQLite, PostgreSQL)."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from sqlalchemy import create_engine, text

from bench.served import launch, stop
from rematd.server.config import StoreConfig
from rematd.server.store import schema
from rematd.server.store.database import StoreError, database_url
from rematd.server.store.schema import SCHEMA_VERSION
from rematd.server.store.store import Store
from rematd.server.store.write_probe import PROBE_EVERY_S, PROBE_TIMEOUT_S

from .fleet_helpers import RawRank
from .test_service_store import new_cluster, postgres_url  # noqa: F401  (a fixture)

TOKEN = "hostile-store-token-0123456789"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _serve(db: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0", "--db", db],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _columns(db: Path, table: str) -> set[str]:
    con = sqlite3.connect(db)
    try:
        return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
    finally:
        con.close()


_SHIPPED = schema.MIGRATIONS


def _broken(last: str) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """The shipped migrations plus one whose last statement is ``last``."""
    return (
        *_SHIPPED,
        (
            SCHEMA_VERSION + 1,
            "a test migration",
            ("ALTER TABLE jobs ADD COLUMN probe TEXT", "CREATE TABLE probe_table (x BIGINT)", last),
        ),
    )


def test_a_migration_failing_on_its_last_statement_leaves_the_previous_version_and_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "r.db"
    Store(db).close()
    monkeypatch.setattr(schema, "MIGRATIONS", _broken("THIS IS NOT SQL"))
    monkeypatch.setattr(schema, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    for _ in range(2):  # and again: the failure repeats as itself, not as "duplicate column name"
        with pytest.raises(StoreError, match="syntax error"):
            Store(db)
        assert "probe" not in _columns(db, "jobs")
        assert not _columns(db, "probe_table")
        con = sqlite3.connect(db)
        assert con.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == SCHEMA_VERSION
        con.close()
    # The fixed migration applies on the next start.
    monkeypatch.setattr(schema, "MIGRATIONS", _broken("CREATE INDEX probe_index ON probe_table (x)"))
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION + 1
    store.close()
    assert "probe" in _columns(db, "jobs")


def test_a_fresh_record_failing_in_its_second_migration_keeps_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = _SHIPPED[0], _SHIPPED[1]
    broken = (first, (second[0], second[1], (*second[2], "ALTER TABLE nowhere ADD COLUMN x TEXT")))
    monkeypatch.setattr(schema, "MIGRATIONS", (*broken, *_SHIPPED[2:]))
    db = tmp_path / "r.db"
    with pytest.raises(StoreError, match="nowhere"):
        Store(db)
    assert "device" not in _columns(db, "jobs") and not _columns(db, "job_controls")
    monkeypatch.undo()
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION
    store.close()


@pytest.mark.parametrize(
    "ddl",
    [
        "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT); INSERT INTO users VALUES (1, 'ann')",
        "CREATE TABLE jobs (id INTEGER PRIMARY KEY, cron TEXT); INSERT INTO jobs VALUES (1, '* * * * *')",
        "CREATE TABLE schema_version (version INTEGER, name TEXT); INSERT INTO schema_version VALUES (7, 'theirs')",
    ],
    ids=["users", "own-jobs", "own-schema-version"],
)
def test_another_applications_sqlite_file_is_refused_untouched(tmp_path: Path, ddl: str) -> None:
    db = tmp_path / "theirs.db"
    con = sqlite3.connect(db)
    con.executescript(ddl)
    con.close()
    before = _digest(db)
    with pytest.raises(StoreError, match="not a rematd store"):
        Store(db)
    assert _digest(db) == before
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    con.close()
    assert not Path(f"{db}-wal").exists()


def test_serve_exits_2_on_a_foreign_sqlite_file(tmp_path: Path) -> None:
    db = tmp_path / "theirs.db"
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT); INSERT INTO users VALUES (1, 'ann')")
    con.close()
    before = _digest(db)
    done = _serve(str(db))
    assert done.returncode == 2, done.stderr
    assert "not a rematd store" in done.stderr and "users" in done.stderr
    assert "Traceback" not in done.stderr
    assert _digest(db) == before


def test_a_non_database_file_is_refused_with_status_2(tmp_path: Path) -> None:
    db = tmp_path / "notes.txt"
    db.write_bytes(b"not a database at all\n" * 100)
    before = _digest(db)
    done = _serve(str(db))
    assert done.returncode == 2, done.stderr
    assert _digest(db) == before


def _pg_db(url: str, name: str) -> str:
    """A new database on the fixture's cluster, for one test."""
    engine = create_engine(database_url(url), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        conn.execute(text(f"CREATE DATABASE {name}"))
    engine.dispose()
    base, query = url.split("?", 1)
    return f"{base.rsplit('/', 1)[0]}/{name}?{query}"


def _pg_tables(url: str) -> set[str]:
    engine = create_engine(database_url(url))
    with engine.connect() as conn:
        names = {r[0] for r in conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"))}
    engine.dispose()
    return names


def test_another_applications_postgresql_database_is_refused_untouched(postgres_url: str) -> None:  # noqa: F811
    url = _pg_db(postgres_url, "theirs")
    engine = create_engine(database_url(url))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE jobs (id BIGINT PRIMARY KEY, cron TEXT)"))
    engine.dispose()
    with pytest.raises(StoreError, match="not a rematd store"):
        Store(StoreConfig(url=database_url(url)))
    assert _pg_tables(url) == {"jobs"}
    done = _serve(url)
    assert done.returncode == 2, done.stderr
    assert _pg_tables(url) == {"jobs"}


def test_a_postgresql_migration_is_one_transaction(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    url = _pg_db(postgres_url, "halfway")
    Store(StoreConfig(url=database_url(url))).close()
    monkeypatch.setattr(schema, "MIGRATIONS", _broken("THIS IS NOT SQL"))
    monkeypatch.setattr(schema, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(StoreError):
        Store(StoreConfig(url=database_url(url)))
    assert "probe_table" not in _pg_tables(url)
    monkeypatch.setattr(schema, "MIGRATIONS", _broken("CREATE INDEX probe_index ON probe_table (x)"))
    store = Store(StoreConfig(url=database_url(url)))
    assert store.schema_version() == SCHEMA_VERSION + 1
    store.close()


def test_a_rematd_record_is_still_switched_to_wal(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    Store(db).close()
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()


def test_reads_while_postgresql_is_away_answer_503_and_say_so_once(tmp_path: Path) -> None:
    cluster = new_cluster()
    try:
        cluster.start()
        srv = launch(cluster.create(), "--log-level", "warning")
        assert srv.proc.stdout is not None
        out = srv.proc.stdout
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(iter(out.readline, "")), daemon=True).start()
        try:
            with httpx.Client(base_url=srv.http, timeout=10) as http:
                assert http.get("/api/v1/jobs").status_code == 200
                cluster.stop()
                before = len(lines)
                answers = [http.get(path).status_code for path in ("/api/v1/jobs", "/api/v1/jobs/any") * 25]
                assert set(answers) == {503}, answers
                during = lines[before:]
                said = [line for line in during if "REST reads cannot reach the store" in line]
                assert len(said) == 1, during[:20]
                assert len(during) <= 10, during[:20]  # the store's own chores say a line or two of their own
                assert not any("Traceback" in line for line in during), during[:20]
                cluster.start()
                deadline = time.monotonic() + 30
                while http.get("/api/v1/jobs").status_code != 200:
                    assert time.monotonic() < deadline, "reads did not come back with the store"
                    time.sleep(0.2)
                time.sleep(0.2)
                assert any("REST reads reach the store again" in line for line in lines), lines[-10:]
        finally:
            stop(srv.proc)
    finally:
        cluster.remove()


def test_a_frozen_database_turns_readiness_to_503_within_the_probe_timeout() -> None:
    """PostgreSQL stopped (SIGSTOP: its connections open, nothing answering): ``/readyz`` never waits on it,
    answers 503 saying so once a probe write is overdue, and so do REST reads, while hellos are told to try again
    (UNAVAILABLE) at once; all serve again once the server goes on."""
    cluster = new_cluster()
    try:
        cluster.start()
        srv = launch(cluster.create(), "--log-level", "warning", env={"REMATD_TOKEN": TOKEN})
        try:
            with httpx.Client(base_url=srv.http, timeout=10) as http:
                assert http.get("/readyz").status_code == 200
                cluster.freeze()
                frozen = time.monotonic()
                try:
                    while True:
                        began = time.monotonic()
                        ready = http.get("/readyz")
                        assert time.monotonic() - began < 1.0, "readiness waited on the database"
                        if ready.status_code == 503:
                            break
                        assert ready.status_code == 200
                        assert time.monotonic() - frozen < PROBE_TIMEOUT_S + PROBE_EVERY_S + 3, "still ready"
                        time.sleep(0.1)
                    assert "has not answered a probe write" in ready.json()["detail"], ready.json()
                    assert http.get("/healthz").status_code == 200
                    began = time.monotonic()
                    read = http.get("/api/v1/jobs")
                    assert read.status_code == 503 and read.headers["retry-after"], read.text
                    assert "not answering" in read.json()["detail"], read.text
                    with pytest.raises(grpc.RpcError) as refused:
                        RawRank(srv.grpc, "while-frozen", 0, 1, token=TOKEN).connect()
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
                    assert "not answering" in str(refused.value.details())
                    # Each would wait for the thaw below (never, within their 10 s) without the refusal.
                    assert time.monotonic() - began < 8.0, "a read or a hello waited on the database"
                finally:
                    cluster.thaw()
                deadline = time.monotonic() + 30
                while http.get("/readyz").status_code != 200:
                    assert time.monotonic() < deadline, "not ready again after the database went on"
                    time.sleep(0.2)
                assert http.get("/api/v1/jobs").status_code == 200
                rank = RawRank(srv.grpc, "after-the-freeze", 0, 1, token=TOKEN)
                rank.connect()
                rank.close()
        finally:
            stop(srv.proc)
    finally:
        cluster.remove()
