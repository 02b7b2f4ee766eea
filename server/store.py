"""The record of jobs, plans, stats and OOM events: one SQLite file."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    world_size INTEGER NOT NULL,
    num_blocks INTEGER NOT NULL,
    budget_bytes INTEGER NOT NULL,
    model_fingerprint TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ranks (
    job TEXT NOT NULL REFERENCES jobs(job),
    rank INTEGER NOT NULL,
    device TEXT NOT NULL,
    state TEXT NOT NULL,
    last_stats TEXT,
    PRIMARY KEY (job, rank)
);
CREATE TABLE IF NOT EXISTS plans (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL REFERENCES jobs(job),
    rank INTEGER NOT NULL,
    version INTEGER NOT NULL,
    checkpoint_every INTEGER NOT NULL,
    blocks TEXT NOT NULL,
    predicted_peak_bytes INTEGER NOT NULL,
    predicted_overhead_ratio REAL NOT NULL,
    target_bytes INTEGER NOT NULL,
    reason TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS plans_by_job ON plans (job, id);
CREATE TABLE IF NOT EXISTS stats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL REFERENCES jobs(job),
    rank INTEGER NOT NULL,
    step INTEGER NOT NULL,
    time REAL NOT NULL,
    peak_bytes INTEGER NOT NULL,
    budget_bytes INTEGER NOT NULL,
    predicted_peak_bytes INTEGER NOT NULL,
    plan_version INTEGER NOT NULL,
    seq_len INTEGER NOT NULL,
    batch INTEGER NOT NULL,
    step_seconds REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS stats_by_job ON stats (job, id);
CREATE TABLE IF NOT EXISTS oom_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL REFERENCES jobs(job),
    rank INTEGER NOT NULL,
    step INTEGER NOT NULL,
    time REAL NOT NULL,
    seq_len INTEGER NOT NULL,
    batch INTEGER NOT NULL,
    plan_version INTEGER NOT NULL,
    message TEXT NOT NULL
);
"""

SCHEMA_VERSION = "1"


class Store:
    """Thread-safe access to the SQLite record. Every write is one transaction."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        with self._lock:
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            elif row["value"] != SCHEMA_VERSION:
                raise RuntimeError(
                    f"database {self.path} has schema version {row['value']}, this rematd expects {SCHEMA_VERSION}"
                )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, params: tuple[Any, ...]) -> None:
        with self._lock:
            self._db.execute(sql, params)

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    # -- writes ---------------------------------------------------------------

    def upsert_job(
        self, *, job: str, now: float, world_size: int, num_blocks: int, budget_bytes: int, fingerprint: str
    ) -> None:
        self._write(
            """INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT(job) DO UPDATE SET updated_at=excluded.updated_at, world_size=excluded.world_size,
               num_blocks=excluded.num_blocks, budget_bytes=excluded.budget_bytes,
               model_fingerprint=excluded.model_fingerprint""",
            (job, now, now, world_size, num_blocks, budget_bytes, fingerprint),
        )

    def upsert_rank(self, *, job: str, rank: int, device: str, state: str) -> None:
        self._write(
            """INSERT INTO ranks (job, rank, device, state) VALUES (?, ?, ?, ?)
               ON CONFLICT(job, rank) DO UPDATE SET device=excluded.device, state=excluded.state""",
            (job, rank, device, state),
        )

    def set_rank_state(self, *, job: str, rank: int, state: str) -> None:
        self._write("UPDATE ranks SET state=? WHERE job=? AND rank=?", (state, job, rank))

    def add_plan(self, *, job: str, rank: int, plan: dict[str, Any], now: float) -> None:
        self._write(
            """INSERT INTO plans (job, rank, version, checkpoint_every, blocks, predicted_peak_bytes,
               predicted_overhead_ratio, target_bytes, reason, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (
                job,
                rank,
                plan["version"],
                plan["checkpoint_every"],
                json.dumps(plan["blocks"]),
                plan["predicted_peak_bytes"],
                plan["predicted_overhead_ratio"],
                plan["target_bytes"],
                plan["reason"],
                now,
            ),
        )

    def add_stats(self, *, job: str, rank: int, row: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    """INSERT INTO stats (job, rank, step, time, peak_bytes, budget_bytes, predicted_peak_bytes,
                       plan_version, seq_len, batch, step_seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                    (
                        job,
                        rank,
                        row["step"],
                        row["time"],
                        row["peak_bytes"],
                        row["budget_bytes"],
                        row["predicted_peak_bytes"],
                        row["plan_version"],
                        row["seq_len"],
                        row["batch"],
                        row["step_seconds"],
                    ),
                )
                self._db.execute("UPDATE ranks SET last_stats=? WHERE job=? AND rank=?", (json.dumps(row), job, rank))
                self._db.execute(
                    "UPDATE jobs SET updated_at=?, budget_bytes=? WHERE job=?", (row["time"], row["budget_bytes"], job)
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def add_oom(self, *, job: str, rank: int, row: dict[str, Any]) -> None:
        self._write(
            """INSERT INTO oom_events (job, rank, step, time, seq_len, batch, plan_version, message)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
            (job, rank, row["step"], row["time"], row["seq_len"], row["batch"], row["plan_version"], row["message"]),
        )

    # -- reads ----------------------------------------------------------------

    def jobs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._read("SELECT * FROM jobs ORDER BY created_at, job")]

    def job(self, job: str) -> dict[str, Any] | None:
        rows = self._read("SELECT * FROM jobs WHERE job=?", (job,))
        return dict(rows[0]) if rows else None

    def ranks(self, job: str) -> list[dict[str, Any]]:
        out = []
        for r in self._read("SELECT * FROM ranks WHERE job=? ORDER BY rank", (job,)):
            d = dict(r)
            d["last_stats"] = json.loads(d["last_stats"]) if d["last_stats"] else None
            out.append(d)
        return out

    def plans(self, job: str) -> list[dict[str, Any]]:
        out = []
        for r in self._read("SELECT * FROM plans WHERE job=? ORDER BY id", (job,)):
            d = dict(r)
            d["blocks"] = json.loads(d["blocks"])
            del d["id"], d["job"]
            out.append(d)
        return out

    def stats(self, job: str, limit: int) -> list[dict[str, Any]]:
        rows = self._read(
            "SELECT * FROM (SELECT * FROM stats WHERE job=? ORDER BY id DESC LIMIT ?) ORDER BY id", (job, limit)
        )
        out = []
        for r in rows:
            d = dict(r)
            del d["id"], d["job"]
            out.append(d)
        return out

    def last_plan_version(self, job: str, rank: int) -> int:
        rows = self._read("SELECT MAX(version) AS v FROM plans WHERE job=? AND rank=?", (job, rank))
        return int(rows[0]["v"] or 0)

    def ooms(self, job: str) -> list[dict[str, Any]]:
        out = []
        for r in self._read("SELECT * FROM oom_events WHERE job=? ORDER BY id", (job,)):
            d = dict(r)
            del d["id"], d["job"]
            out.append(d)
        return out
