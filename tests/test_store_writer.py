"""The core's writes handed to one writer thread: in order, waited for where they must be, and a failed
one logged and counted without ending the stream it came from (a real SQLite file)."""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from rematd.server.core.advisor import AdvisorCore
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store
from rematd.server.store.writer import StoreWriter

from .test_service import hello, stats


def test_writes_run_in_the_order_they_were_handed_over_off_the_callers_thread() -> None:
    writer = StoreWriter()
    done: list[tuple[int, str]] = []
    gate = threading.Event()
    writer.submit("a gate", lambda: gate.wait(5))
    for i in range(50):
        writer.submit(f"write {i}", lambda i=i: done.append((i, threading.current_thread().name)))
    assert writer.pending() == 51 and done == [], "handing over does not wait for the writes"
    gate.set()
    assert writer.drain(5)
    assert [i for i, _ in done] == list(range(50))
    assert {name for _, name in done} == {"rematd-store-writer"}
    assert writer.call("a read-back", lambda: len(done)) == 50
    writer.close()


def test_a_failed_write_is_logged_and_counted_and_the_next_one_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    failed: list[BaseException] = []
    writer = StoreWriter(on_failure=failed.append)
    after: list[int] = []

    def broken() -> None:
        raise RuntimeError("the disk is full")

    with caplog.at_level(logging.ERROR, logger="rematd.server"):
        writer.submit("a doomed row", broken)
        writer.submit("the next row", lambda: after.append(1))
        assert writer.drain(5)
    assert after == [1] and writer.failures == 1 and [str(e) for e in failed] == ["the disk is full"]
    assert "writing a doomed row to the store failed" in caplog.text and "the disk is full" in caplog.text
    # Waited for, the error goes to the one waiting (a hello the store refuses), uncounted.
    with pytest.raises(RuntimeError, match="disk is full"):
        writer.call("a hello", broken)
    assert writer.failures == 1
    writer.close()
    assert writer.call("after close", lambda: "inline") == "inline"


def test_a_plan_the_record_refuses_is_counted_and_the_rank_goes_on(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    core = AdvisorCore(Store(db), Metrics())
    try:
        s, first = core.open_session(hello(job="refused"))
        with sqlite3.connect(db) as conn:
            conn.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON plans WHEN NEW.job = 'refused' "
                "BEGIN SELECT RAISE(ABORT, 'refused by the database'); END"
            )
        new = core.on_stats(s, stats(0, 9500, seq=128))
        assert new is not None and new.version == first.version + 1, "the rank is sent its plan all the same"
        assert core.drain_writes(5)
        assert core.writer.failures == 1
        assert core.metrics.registry.get_sample_value("rematd_store_write_failures_total") == 1.0
        core.on_stats(s, stats(1, 500))  # the stream goes on
        assert s.last_step == 1
        assert [p["version"] for p in core.job_plans("refused")] == [first.version]
        core.close_session(s, ended=True)
        assert core.get_job("refused")["state"] == "ended"
    finally:
        core.close()
        core.store.close()


def test_the_core_puts_the_steps_oom_risk_in_its_statistics_row(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.db")
    core = AdvisorCore(store, Metrics())
    try:
        s, _ = core.open_session(hello(job="risky"))
        core.on_stats(s, stats(0, 9900))
        risk = s.planner.oom_risk
        assert 0.0 < risk <= 1.0
        buffered = store.buffer.last("risky", 0)
        assert buffered is not None and buffered["oom_risk"] == risk
        job = core.get_job("risky")
        assert job["ranks"][0]["last_stats"]["oom_risk"] == risk
        # The stats table keeps it once its schema has the column; it never holds another value.
        rows = core.job_stats("risky")
        assert len(rows) == 1 and rows[0]["oom_risk"] == risk
        core.close_session(s, ended=True)
    finally:
        core.close()
        store.close()


def test_close_waits_for_every_write_handed_over(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.db")
    core = AdvisorCore(store, Metrics())
    s, _ = core.open_session(hello(job="closing"))
    gate = threading.Event()
    core.writer.submit("a slow write", lambda: gate.wait(5))
    core.on_stats(s, stats(0, 9500, seq=128))  # a new plan, queued behind the slow write
    assert core.writer.pending() >= 2
    threading.Timer(0.2, gate.set).start()
    started = time.monotonic()
    core.close()
    assert time.monotonic() - started >= 0.1 and core.writer.pending() == 0
    assert len(store.plans("closing")) == 2
    store.close()


def test_a_rank_forgotten_while_its_resume_is_recorded_is_registered_again(tmp_path: Path) -> None:
    """A resume records itself outside the registry's lock: expiry can forget the rank meanwhile. The
    resumed rank must be registered again, or its goodbye goes unrecorded and it stays connected."""
    store = Store(tmp_path / "r.db")
    core = AdvisorCore(store, Metrics())
    try:
        first, _ = core.open_session(hello(job="x", rank=0))
        core.close_session(first, ended=False)
        gate = threading.Event()
        core.writer.submit("a slow record", lambda: gate.wait(10))
        back = dataclasses.replace(hello(job="x", rank=0), plan_version=first.sent.version, session_secret=first.secret)
        out: dict[str, object] = {}
        resume = threading.Thread(target=lambda: out.setdefault("session", core.open_session(back)[0]))
        resume.start()
        deadline = time.monotonic() + 5
        while core.writer.pending() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the resume waits on the writer, outside the registry's lock
        assert core.expire_sessions(now=time.monotonic() + 10_000) == 1
        gate.set()
        resume.join(10)
        resumed = out["session"]
        assert resumed is first and core.sessions.by_key.get(("x", 0)) is resumed
        core.close_session(first, ended=True)
        assert core.drain_writes(5)
        assert [r["state"] for r in store.ranks("x")] == ["ended"]
        assert store.job("x")["ended_at"] is not None
    finally:
        core.close()
        store.close()


def test_close_gives_up_writes_the_record_does_not_take_in_time(caplog: pytest.LogCaptureFixture) -> None:
    writer = StoreWriter()
    gate = threading.Event()
    ran: list[int] = []
    writer.submit("a stuck write", lambda: gate.wait(10))
    for i in range(3):
        writer.submit(f"write {i}", lambda i=i: ran.append(i))
    thread = writer._thread
    assert thread is not None
    with caplog.at_level(logging.ERROR, logger="rematd.server"):
        writer.close(timeout=0.2)
    assert "3 queued write(s)" in caplog.text
    gate.set()
    thread.join(5)  # the stuck write returns; whatever the thread would still run, it has run when it ends
    assert not thread.is_alive(), "the writer's thread goes on after the stuck write returned"
    assert ran == [], "given up, not run beside later writes"
    writer.submit("after close", lambda: ran.append(99))
    assert ran == [99], "after close a write runs on the caller's thread"
