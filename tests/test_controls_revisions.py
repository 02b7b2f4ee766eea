"""Operator controls reach every process that shares the store: each process polls for revisions above the newest
it read, so no write may be numbered at or below a revision a poller has passed, its own writes' included."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event

from rematd.server.config import StoreConfig
from rematd.server.core.advisor import AdvisorCore
from rematd.server.core.controls import Controls
from rematd.server.metrics.registry import Metrics
from rematd.server.store.database import database_url
from rematd.server.store.store import Store

from .test_service import hello
from .test_service_store import postgres_url  # noqa: F401  (a fixture)


def test_a_process_that_writes_controls_still_reads_the_ones_written_before_by_another(tmp_path: Path) -> None:
    """Two workers on one store: B pins a job, then A tunes another before its next poll. A's poll still finds
    B's pin (A once took its own write's revision as read, above B's)."""
    a, b = AdvisorCore(Store(tmp_path / "r.db"), Metrics()), AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    try:
        a.open_session(hello(job="tuned"))
        b.open_session(hello(job="pinned"))
        b.pin("pinned", pin_every=2)
        a.tune("tuned", {"margin_ratio": 0.2})
        a.refresh_controls()
        assert a.job_controls("pinned")["pin_every"] == 2
        assert a.job_controls("tuned")["margin_ratio"] == 0.2
        b.refresh_controls()
        assert b.job_controls("tuned")["margin_ratio"] == 0.2
    finally:
        a.store.close()
        b.store.close()


def test_a_change_written_on_one_process_keeps_what_another_wrote_before(tmp_path: Path) -> None:
    """An operator pins a job through one worker and tunes it through another at once: the tune keeps the pin
    (it changed the other worker's stale copy of the job's controls, which had none)."""
    a, b = AdvisorCore(Store(tmp_path / "r.db"), Metrics()), AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    try:
        a.open_session(hello(job="both"))
        a.pin("both", pin_every=2)
        assert b.tune("both", {"margin_ratio": 0.2})["pin_every"] == 2
        a.refresh_controls()
        assert (a.job_controls("both")["pin_every"], a.job_controls("both")["margin_ratio"]) == (2, 0.2)
    finally:
        a.store.close()
        b.store.close()


@pytest.fixture
def two(postgres_url: str) -> Iterator[tuple[Store, Store]]:  # noqa: F811
    stores = Store(StoreConfig(url=database_url(postgres_url))), Store(StoreConfig(url=database_url(postgres_url)))
    try:
        yield stores
    finally:
        for store in stores:
            store.close()


def test_controls_written_at_once_by_two_replicas_are_numbered_in_commit_order(two: tuple[Store, Store]) -> None:
    """Replica A's write of controls is held between its statement and its commit while replica B writes too and a
    poller reads. B's write waits for A's commit, so the poller, which polls on from the newest revision it read,
    sees both, each under a revision of its own (without the wait both took one revision, and the poller, having
    read B's, never read A's)."""
    a, b = two
    reached, release = threading.Event(), threading.Event()

    def hold(_conn: object) -> None:
        if threading.current_thread().name == "replica-a":
            reached.set()
            release.wait(10)

    event.listen(a.engine, "commit", hold)
    writers = [
        threading.Thread(target=a.set_controls, args=("job-a", Controls().as_row("job-a"), 1.0), name="replica-a"),
        threading.Thread(target=b.set_controls, args=("job-b", Controls().as_row("job-b"), 2.0), name="replica-b"),
    ]
    writers[0].start()
    assert reached.wait(10)
    writers[1].start()
    writers[1].join(0.5)
    seen = {row["job"]: row["revision"] for row in b.controls_since(0)}
    release.set()
    for w in writers:
        w.join(10)
        assert not w.is_alive()
    newest = max(seen.values(), default=0)
    seen |= {row["job"]: row["revision"] for row in b.controls_since(newest)}
    assert set(seen) == {"job-a", "job-b"}, seen
    assert seen["job-a"] < seen["job-b"], seen
