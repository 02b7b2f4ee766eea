"""Two processes writing one job's rows at once on a real PostgreSQL: the store takes a job's row before its
ranks' rows in every transaction, so its own writes never deadlock, and a transaction the database rolls back
to settle a conflict with anything else runs again instead of failing a hello or the store's health."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy import exc as sa_exc

from rematd.server.config import StoreConfig
from rematd.server.core.advisor import AdvisorCore
from rematd.server.metrics.registry import Metrics
from rematd.server.store.conflicts import conflicted
from rematd.server.store.database import database_url
from rematd.server.store.store import Store

from .test_service_store import postgres_url  # noqa: F401  (a fixture)

WAITING = 0.3
"""Long enough for a store's transaction to reach the row the test's own transaction holds."""


@pytest.fixture
def pg(postgres_url: str) -> Iterator[tuple[Store, Engine]]:  # noqa: F811
    store = Store(StoreConfig(url=database_url(postgres_url)))
    other = create_engine(database_url(postgres_url))
    try:
        yield store, other
    finally:
        store.close()
        other.dispose()


def _hello(store: Store, job: str) -> None:
    store.open_rank(job=job, rank=0, now=time.time(), world_size=1, num_blocks=4, budget_bytes=10_000, fingerprint="fp")


def _in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # carried to the test's thread
            errors.append(err)

    thread = threading.Thread(target=run, name="store-write", daemon=True)
    thread.start()
    return thread, errors


def test_a_flush_takes_the_jobs_row_before_the_ranks_as_a_hello_does(pg: tuple[Store, Engine]) -> None:
    """Another transaction holds the job's row, and then takes the rank's: the flush waits for the job's row
    without holding the rank's, so nobody is rolled back (taking the rank's first, it deadlocked)."""
    store, other = pg
    _hello(store, "ordered")
    store.add_stats(job="ordered", rank=0, row=_row(1))
    with other.connect() as conn, conn.begin():
        conn.execute(text("UPDATE jobs SET world_size=1 WHERE job='ordered'"))
        flushing, errors = _in_thread(store.flush)
        time.sleep(WAITING)
        conn.execute(text("UPDATE ranks SET device='cpu' WHERE job='ordered' AND rank=0"))
    flushing.join(30)
    assert not flushing.is_alive() and not errors, errors
    assert store.transactions.conflicts == 0
    assert store.failing_since is None
    assert store.count_stats("ordered") == 1


def test_a_hello_the_database_rolls_back_for_a_deadlock_runs_again(pg: tuple[Store, Engine]) -> None:
    """A transaction that takes the rank's row and then the job's deadlocks with a hello (the job's, then the
    rank's): PostgreSQL rolls the hello back, which runs again once the other is done, and the store still
    counts as healthy."""
    store, other = pg
    core = AdvisorCore(store, Metrics())  # counts the store's conflicts
    _hello(store, "crossed")
    store.set_rank_state(job="crossed", rank=0, state="ended")
    with other.connect() as conn, conn.begin():
        conn.execute(text("UPDATE ranks SET device='cpu' WHERE job='crossed' AND rank=0"))
        opening, errors = _in_thread(lambda: _hello(store, "crossed"))
        time.sleep(WAITING)
        # The hello waited first, so its deadlock check runs first: it is the transaction rolled back.
        conn.execute(text("UPDATE jobs SET world_size=1 WHERE job='crossed'"))
    opening.join(30)
    assert not opening.is_alive() and not errors, errors
    assert store.transactions.conflicts == 1
    assert store.failing_since is None
    assert core.metrics.registry.get_sample_value("rematd_store_conflicts_total") == 1.0
    with other.connect() as conn:
        state, holder = conn.execute(text("SELECT state, holder FROM ranks WHERE job='crossed' AND rank=0")).one()
    assert (state, holder) == ("connected", store.holder)


def test_only_a_conflict_runs_again(tmp_path: Path) -> None:
    """Any other error of the database (here a broken constraint) is raised at once, not run again."""
    store = Store(tmp_path / "r.db")
    try:
        with pytest.raises(sa_exc.IntegrityError) as failed:
            store.transactions.run(lambda conn: conn.execute(text("INSERT INTO ranks (job, rank) VALUES (NULL, 0)")))
        assert not conflicted(failed.value)
        assert store.transactions.conflicts == 0
    finally:
        store.close()


def _row(step: int) -> dict[str, object]:
    return {"step": step, "time": 100.0 + step, "peak_bytes": 900 + step, "budget_bytes": 10_000,
            "predicted_peak_bytes": 950, "plan_version": 1, "seq_len": 16, "batch": 2, "step_seconds": 0.5}  # fmt: skip
