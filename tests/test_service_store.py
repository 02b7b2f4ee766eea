"""The store: migrations, down-sampling, retention, restarts, warm starts; SQLite and a real PostgreSQL."""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from sqlalchemy import text

from bench.postgres import Cluster, pg_bin
from rematd import wire
from rematd.planner import Mode
from rematd.planner.messages import BlockProfile, Hello
from rematd.server.config import StoreConfig
from rematd.server.core.advisor import AdvisorCore
from rematd.server.metrics.registry import Metrics
from rematd.server.store.database import database_url
from rematd.server.store.rows import WarmPlanRow
from rematd.server.store.schema import _TYPES, MIGRATIONS, SCHEMA_VERSION
from rematd.server.store.store import Store
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .helpers import live_server
from .test_service import _fields, hello, stats


def new_cluster() -> Cluster:
    """A throw-away PostgreSQL cluster (not started yet); the test is skipped where PostgreSQL is absent."""
    bindir = pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL binaries are absent (Debian package 'postgresql', see scripts/system-packages.txt)")
    return Cluster(bindir)


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A throw-away PostgreSQL cluster in a temp dir, on a unix socket only (no TCP port at all)."""
    cluster = new_cluster()
    try:
        cluster.start()
        yield cluster.create()
    finally:
        cluster.remove()


def _exercise(store: Store) -> None:
    core = AdvisorCore(store, Metrics())
    s, plan = core.open_session(hello(job="db-job"))
    assert plan.version == 1
    new = core.on_stats(s, stats(0, 9500, seq=128))
    assert new is not None
    core.on_oom(s, wire.oom_from_pb(pb.OomEvent(step=1, message="CUDA out of memory")))
    core.pin("db-job", pin_every=1)
    core.close_session(s, ended=False)
    assert [p["version"] for p in core.job_plans("db-job")][:2] == [1, 2]
    assert core.job_ooms("db-job")[0]["message"] == "CUDA out of memory"
    assert core.job_stats("db-job")[0]["peak_bytes"] == 9500
    # Controls written by one core (a worker or a replica) reach another through the store.
    other = AdvisorCore(store, Metrics())
    assert other.job_controls("db-job")["pin_every"] == 1
    core.unpin("db-job")
    other.refresh_controls()
    assert other.job_controls("db-job")["pin_every"] is None
    # Modes and the per-length table, and pins by mode, on this database too.
    recorded = core.job_plans("db-job")
    assert all(len(p["modes"]) == 4 for p in recorded) and recorded[1]["shape_plans"]
    assert recorded[1]["blocks"] == [i for i, m in enumerate(recorded[1]["modes"]) if m != "store"]
    core.pin("db-job", pin_modes=["recompute", "store", "store", "recompute"])
    other.refresh_controls()
    assert other.job_controls("db-job")["pin_modes"] == ["recompute", "store", "store", "recompute"]
    # A rank left connected by a process that is gone (a ghost) reads as lost.
    core.open_session(hello(job="ghost-job"))
    assert store.heartbeat() == []
    assert core.get_job("ghost-job")["ranks"][0]["state"] == "connected"
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE ranks SET holder='another-host:1:gone' WHERE job='ghost-job'"))
    assert core.get_job("ghost-job")["ranks"][0]["state"] == "disconnected"
    # The upserts the tables build: a job said hello to again keeps its creation time; a warm plan kept again for
    # the same model, device and size replaces the first.
    job = store.job("db-job")
    assert job is not None
    store.open_rank(job="db-job", rank=7, now=job["created_at"] + 100, world_size=8, num_blocks=4, budget_bytes=77,
                    fingerprint=job["model_fingerprint"])  # fmt: skip
    store.set_rank_state(job="db-job", rank=7, state="ended")
    again = store.job("db-job")
    assert (
        again is not None
        and again["created_at"] == job["created_at"]
        and again["updated_at"] == job["created_at"] + 100
    )
    assert again["world_size"] == 8 and again["budget_bytes"] == 77 and again["ended_at"] is None
    warm: WarmPlanRow = {"model_fingerprint": "fp-w", "device": "cpu", "shape_bucket": 10, "job": "db-job",
                         "blocks": [1], "num_blocks": 4, "budget_bytes": 10, "shape_plans": [], "updated_at": 1.0,
                         "modes": ["store", "recompute", "store", "store"]}  # fmt: skip
    store.remember_warm_plan(warm)
    second: WarmPlanRow = {**warm, "blocks": [0, 3], "modes": ["recompute", "store", "store", "recompute"],
                           "updated_at": 2.0}  # fmt: skip
    store.remember_warm_plan(second)
    assert store.warm_plan(fingerprint="fp-w", device="cpu", bucket=10) == second


def test_sqlite_record(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.db")
    assert store.schema_version() == SCHEMA_VERSION
    _exercise(store)
    store.close()


def test_postgresql_record(postgres_url: str) -> None:
    store = Store(StoreConfig(url=database_url(postgres_url)))
    assert store.dialect == "postgresql" and store.schema_version() == SCHEMA_VERSION
    _exercise(store)
    assert store.compact(now=time.time() + 10 * 365 * 86400)["expired_jobs"] == 2  # the ghost's too
    store.close()


def test_a_record_from_before_migrations_is_upgraded(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    con = sqlite3.connect(db)
    con.executescript(
        """CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE jobs (job TEXT PRIMARY KEY, created_at REAL NOT NULL, updated_at REAL NOT NULL,
            world_size INTEGER NOT NULL, num_blocks INTEGER NOT NULL, budget_bytes INTEGER NOT NULL,
            model_fingerprint TEXT NOT NULL);
        INSERT INTO jobs VALUES ('old-job', 1.0, 2.0, 1, 4, 1000, 'fp');
        CREATE TABLE ranks (job TEXT, rank INTEGER, device TEXT, state TEXT, last_stats TEXT, PRIMARY KEY (job, rank));
        CREATE TABLE plans (id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT, rank INTEGER, version INTEGER,
            checkpoint_every INTEGER, blocks TEXT, predicted_peak_bytes INTEGER, predicted_overhead_ratio REAL,
            target_bytes INTEGER, reason TEXT, created_at REAL);
        CREATE TABLE stats (id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT, rank INTEGER, step INTEGER, time REAL,
            peak_bytes INTEGER, budget_bytes INTEGER, predicted_peak_bytes INTEGER, plan_version INTEGER,
            seq_len INTEGER, batch INTEGER, step_seconds REAL);
        CREATE TABLE oom_events (id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT, rank INTEGER, step INTEGER,
            time REAL, seq_len INTEGER, batch INTEGER, plan_version INTEGER, message TEXT);"""
    )
    con.close()
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.job("old-job") is not None and store.job("old-job")["ended_at"] is None  # type: ignore[index]
    store.close()
    con = sqlite3.connect(db)
    con.execute("INSERT INTO schema_version VALUES (999, 'from the future', 0)")
    con.commit()
    con.close()
    with pytest.raises(RuntimeError, match="999"):
        Store(db)


def test_a_record_of_schema_2_is_upgraded_and_its_plans_read_back_with_modes(tmp_path: Path) -> None:
    """A store written before plans kept their modes: migrations 1-2 as they shipped, rows as rematd wrote them."""
    db = tmp_path / "v2.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE schema_version (version BIGINT PRIMARY KEY, description TEXT NOT NULL, applied_at REAL)")
    for version, description, statements in MIGRATIONS[:2]:
        for sql in statements:
            con.execute(sql.format(**_TYPES["sqlite"]))
        con.execute("INSERT INTO schema_version VALUES (?, ?, 0)", (version, description))
    con.executescript(
        """INSERT INTO jobs (job, created_at, updated_at, world_size, num_blocks, budget_bytes, model_fingerprint,
               device, ended_at) VALUES ('old-job', 1.0, 2.0, 1, 4, 10000, 'abc', 'cpu', NULL);
        INSERT INTO ranks VALUES ('old-job', 0, 'cpu', 'disconnected', NULL);
        INSERT INTO plans (job, rank, version, checkpoint_every, blocks, predicted_peak_bytes,
               predicted_overhead_ratio, target_bytes, reason, created_at)
           VALUES ('old-job', 0, 1, 0, '[]', 4000, 0.0, 9000, 'initial plan from profile', 1.0),
                  ('old-job', 0, 2, 2, '[0, 2]', 3000, 0.2, 9000, 'tighten: predicted peak over target', 2.0);
        INSERT INTO job_controls VALUES ('old-job', '[1, 3]', NULL, NULL, NULL, NULL, 1, 2.0);
        INSERT INTO warm_plans VALUES ('abc', 'cpu', 7, 'old-job', '[1, 3]', 4, 10000, 2.0);"""
    )
    con.commit()
    con.close()

    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION >= 3
    plans = store.plans("old-job")
    assert [p["modes"] for p in plans] == [
        ["store"] * 4,
        ["recompute", "store", "recompute", "store"],
    ], "blocks recompute, the others store"
    assert [p["shape_plans"] for p in plans] == [[], []]
    assert plans[1]["blocks"] == [0, 2] and plans[1]["reason"].startswith("tighten")
    assert store.latest_plans()["old-job"]["modes"] == plans[1]["modes"]
    assert store.last_plan("old-job", 0) == plans[1]
    warm = store.warm_plan(fingerprint="abc", device="cpu", bucket=7)
    assert warm is not None and warm["modes"] == ["store", "recompute", "store", "recompute"]
    # The old pin still holds, and a new job of that model starts warm from the old record's plan.
    core = AdvisorCore(store, Metrics())
    assert core.job_controls("old-job")["pin_blocks"] == [1, 3] and core.job_controls("old-job")["pin_modes"] is None
    s, plan = core.open_session(hello(job="new-job"))
    assert plan.reason.startswith("warm start from job old-job"), plan.reason
    assert plan.block_modes(4) == (Mode.STORE, Mode.RECOMPUTE, Mode.STORE, Mode.RECOMPUTE)
    core.close_session(s, ended=True)
    # New rows keep their own modes next to the old ones.
    assert store.plans("new-job")[0]["modes"] == ["store", "recompute", "store", "recompute"]
    store.close()
    again = Store(db)
    assert again.schema_version() == SCHEMA_VERSION and len(again.plans("old-job")) == 2
    again.close()


def test_a_month_long_job_stays_small(tmp_path: Path) -> None:
    store = Store(StoreConfig(url=database_url(tmp_path / "r.db"), keep_steps=100, bucket_seconds=3600))
    core = AdvisorCore(store, Metrics())
    s, _ = core.open_session(hello(job="long"))
    core.close_session(s, ended=False)
    start = float(int(time.time()) - 30 * 86400)  # whole seconds: the retention boundary is exact
    # A month of one step a minute, written straight into the store.
    rows = [
        {"step": i, "time": start + 60 * i, "peak_bytes": 1000 + (5000 if i == 777 else i % 50), "budget_bytes": 10_000,
         "predicted_peak_bytes": 900, "plan_version": 1, "seq_len": 64, "batch": 1, "step_seconds": 0.1}
        for i in range(30 * 24 * 60)
    ]  # fmt: skip
    for r in rows:
        store.add_stats(job="long", rank=0, row=r)
    before = store.count_stats("long")
    assert before == len(rows)
    done = store.compact(now=start + 30 * 86400 + 60)
    after = store.count_stats("long")
    assert done["downsampled"] + done["expired_stats"] == before - after
    assert after <= 100 + 30 * 24 + 2, after
    kept = store.stats("long", 100_000)
    assert [r["step"] for r in kept[-100:]] == list(range(len(rows) - 100, len(rows))), "the last steps are all kept"
    assert any(r["peak_bytes"] == 6000 for r in kept), "a bucket keeps its highest peak"
    # Retention drops what is older than its window.
    short = Store(StoreConfig(url=database_url(tmp_path / "r.db"), keep_steps=100, retention_days=7))
    short.compact(now=start + 30 * 86400 + 60)
    assert min(r["time"] for r in short.stats("long", 100_000)) >= start + 23 * 86400 - 1
    short.close()
    store.close()


def _big_hello(job: str, *, plan_version: int = 0, budget: int = 6000) -> Hello:
    return Hello(
        **{
            **_fields(hello(job=job, budget=budget, n=8)),
            "device_name": "NVIDIA H100",
            "model_fingerprint": "gpt-fp",
            "plan_version": plan_version,
            "blocks": tuple(
                BlockProfile(index=i, name=f"h.{i}", saved_bytes=1000, input_bytes=100, forward_seconds=0.01)
                for i in range(8)
            ),
        }
    )


def test_fleet_warm_start(tmp_path: Path) -> None:
    core = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    s, first = core.open_session(_big_hello("first"))
    # The plan tightens under pressure (a peak over the target under the first plan), then holds.
    core.on_stats(s, dataclasses.replace(stats(0, 5900, budget=6000, seq=64), plan_version=first.version))
    held = s.sent
    for step in range(1, 30):
        core.on_stats(s, stats(step, 4000, budget=6000, seq=64))
    core.close_session(s, ended=True)
    assert held.blocks != first.blocks
    s2, plan = core.open_session(_big_hello("second"))
    assert plan.blocks == s.sent.blocks and plan.reason.startswith("warm start from job first"), plan
    assert core.job_plans("second")[0]["reason"].startswith("warm start from job first")
    # Another device type, or a rank resuming, starts cold.
    other = Hello(**{**_fields(_big_hello("third")), "device_name": "NVIDIA A100"})
    _, cold = core.open_session(other)
    assert "warm start" not in cold.reason
    core.close_session(s2, ended=True)


def test_restarting_the_process_loses_no_plan_or_event(tmp_path: Path) -> None:
    with live_server(tmp_path) as srv:
        msgs = [
            pb.ClientMessage(hello=wire.hello_to_pb(hello(job="durable"))),
            pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 9500, seq=128))),
            pb.ClientMessage(oom=pb.OomEvent(step=1, message="boom")),
        ]
        with grpc.insecure_channel(srv.grpc) as ch:
            call = pb_grpc.AdvisorStub(ch).Session(iter(msgs), timeout=10)
            got = list(call)
        versions = [m.plan.version for m in got if m.WhichOneof("kind") == "plan"]
        # Stop at once after the stream: nothing is given time to settle.
    with live_server(tmp_path) as again, httpx.Client(base_url=again.url, timeout=10) as http:
        plans = http.get("/api/v1/jobs/durable/plans").json()["plans"]
        assert [p["version"] for p in plans] == versions
        assert [o["message"] for o in http.get("/api/v1/jobs/durable/ooms").json()["ooms"]] == ["boom"]
        assert [r["step"] for r in http.get("/api/v1/jobs/durable/stats").json()["stats"]] == [0]


def test_a_migration_missing_below_the_highest_applied_is_applied(tmp_path: Path) -> None:
    db = tmp_path / "gap.db"
    Store(db).close()
    con = sqlite3.connect(db)
    # A store at every version but 3: migration 3's columns absent, and so is its row.
    for table, column in [
        ("plans", "modes"),
        ("plans", "shape_plans"),
        ("job_controls", "pin_modes"),
        ("warm_plans", "modes"),
        ("warm_plans", "shape_plans"),
    ]:
        con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    con.execute("DELETE FROM schema_version WHERE version = 3")
    con.commit()
    before = dict(con.execute("SELECT version, applied_at FROM schema_version").fetchall())
    con.close()
    assert sorted(before) == [v for v in range(1, SCHEMA_VERSION + 1) if v != 3]
    store = Store(db)
    try:
        AdvisorCore(store, Metrics()).open_session(hello(job="after-the-gap"))  # writes a plan with its modes
    finally:
        store.close()
    con = sqlite3.connect(db)
    after = dict(con.execute("SELECT version, applied_at FROM schema_version").fetchall())
    modes = con.execute("SELECT modes FROM plans WHERE job = 'after-the-gap'").fetchall()
    con.close()
    assert sorted(after) == list(range(1, SCHEMA_VERSION + 1)) and {k: after[k] for k in before} == before, (
        "only 3 was applied"
    )
    assert len(modes) == 1 and modes[0][0], "the plan's modes are kept in migration 3's column"
