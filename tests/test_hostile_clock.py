"""Retention against a wall clock that jumps: a month forward must not delete a running job's statistics nor a
disconnected job's plan history (a real SQLite record and the real core)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from rematd.server.core.advisor import AdvisorCore
from rematd.server.store.retention_clock import RetentionClock
from rematd.server.store.store import Store

from .test_service import hello, stats

MONTH = 31 * 86400.0


def _trained(core: AdvisorCore, job: str, *, ended: bool | None) -> None:
    """A rank that reported a few steps; its stream then ends (``ended``: with a goodbye) or stays open (None)."""
    session, _ = core.open_session(hello(job=job))
    for step in range(3):
        core.on_stats(session, stats(step, 3000 + step))
    if ended is not None:
        core.close_session(session, ended=ended)


@pytest.fixture
def core(tmp_path: Path) -> AdvisorCore:
    c = AdvisorCore(Store(tmp_path / "r.db"))
    _trained(c, "running", ended=None)
    _trained(c, "away", ended=False)
    _trained(c, "finished", ended=True)
    c.drain_writes(10)
    c.store.flush()
    return c


def test_a_wall_clock_a_month_ahead_deletes_nothing(core: AdvisorCore, caplog: pytest.LogCaptureFixture) -> None:
    core.retention_clock.wall = lambda: time.time() + MONTH
    with caplog.at_level(logging.WARNING, logger="rematd.server"):
        deleted = core.compact()
    assert deleted["expired_stats"] == 0 and deleted["expired_jobs"] == 0
    assert any("wall clock moved" in r.getMessage() for r in caplog.records)
    for job in ("running", "away", "finished"):
        assert len(core.store.stats(job, limit=10)) == 3
    assert core.store.plans("away")


def test_jobs_with_an_open_or_resumable_session_keep_their_rows_however_old(core: AdvisorCore) -> None:
    # Past retention by any clock: only the job whose ranks all said goodbye goes.
    deleted = core.store.compact(now=time.time() + MONTH, live=core.sessions.live_jobs())
    assert deleted["expired_jobs"] == 1
    assert core.store.job("finished") is None
    assert len(core.store.stats("running", limit=10)) == 3
    assert len(core.store.stats("away", limit=10)) == 3 and core.store.plans("away")


def test_a_clock_that_keeps_pace_is_followed() -> None:
    now = [1000.0, 50.0]
    clock = RetentionClock(max_jump_seconds=60, wall=lambda: now[0], mono=lambda: now[1])
    now[0] += 30
    now[1] += 29
    assert clock.now() == 1030.0  # a drift within the bound is the wall clock's
    now[0] += MONTH
    now[1] += 10
    assert clock.now() == pytest.approx(1040.0)  # a jump is not
