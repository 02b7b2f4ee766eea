"""The store's SQLite file deleted, replaced or truncated under a serving service: seen within a second,
/readyz turns 503 with the reason, a metric says so, nothing is written into a fresh file, and the newest
step reports wait in memory until the file is back."""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from rematd import wire
from rematd.server import ServeConfig, ServiceThread
from rematd.v1 import advisor_pb2 as pb

from .test_service import hello, session, stats


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ServiceThread, Path]]:
    db = tmp_path / "r.db"
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(db)))
    svc.start()
    yield svc, db
    svc.stop()


def _report(svc: ServiceThread, job: str, steps: range) -> None:
    assert svc.service.bound is not None
    msgs = [pb.ClientMessage(hello=wire.hello_to_pb(hello(job=job)))]
    msgs += [pb.ClientMessage(stats=wire.stats_to_pb(stats(i, 3000 + i))) for i in steps]
    got, err = session(svc.service.bound.grpc, msgs)
    assert err is None, err
    assert sum(m.WhichOneof("kind") == "ack" for m in got) == len(steps)


def _ready(svc: ServiceThread) -> httpx.Response:
    assert svc.service.bound is not None
    return httpx.get(f"http://{svc.service.bound.http}/readyz", timeout=10)


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _lost_metric(svc: ServiceThread) -> str:
    assert svc.service.bound is not None
    text = httpx.get(f"http://{svc.service.bound.http}/metrics", timeout=10).text
    return next(line for line in text.splitlines() if line.startswith("rematd_store_lost "))


def test_a_deleted_record_is_seen_and_nothing_is_written_into_a_fresh_file(served: tuple[ServiceThread, Path]) -> None:
    svc, db = served
    _report(svc, "before", range(5))
    assert _ready(svc).status_code == 200
    db.unlink()
    assert _until(lambda: _ready(svc).status_code == 503)
    assert "was deleted" in _ready(svc).json()["detail"]
    assert _lost_metric(svc).endswith(" 1.0")
    assert svc.service.bound is not None
    _, err = session(svc.service.bound.grpc, [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="during")))])
    assert err is not None  # a hello is refused while the store cannot take it
    time.sleep(0.6)
    assert not db.exists()  # no fresh, empty record in its place


def test_a_record_moved_away_and_back_keeps_the_reports_sent_meanwhile(served: tuple[ServiceThread, Path]) -> None:
    svc, db = served
    _report(svc, "moved", range(3))
    aside = db.with_name("aside.db")
    os.rename(db, aside)
    sqlite3.connect(db).close()  # someone else's empty file where the store was
    assert _until(lambda: _ready(svc).status_code == 503)
    assert "replaced" in _ready(svc).json()["detail"]
    store = svc.service.core.store
    live = svc.service.core.sessions.by_key.get(("moved", 0))
    assert live is not None
    for step in range(3, 8):
        svc.service.core.on_stats(live, stats(step, 4000))
    time.sleep(0.6)
    assert store.pending() >= 5  # kept, not written into the stranger's file
    assert sqlite3.connect(db).execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)
    os.replace(aside, db)
    assert _until(lambda: _ready(svc).status_code == 200)
    assert _until(lambda: store.pending() == 0)
    assert _lost_metric(svc).endswith(" 0.0")
    steps = [r["step"] for r in store.stats("moved", limit=100)]
    assert set(range(3, 8)) <= set(steps)


def test_a_truncated_record_is_seen(served: tuple[ServiceThread, Path]) -> None:
    svc, db = served
    _report(svc, "cut", range(2))
    keep = db.with_name("keep.db")
    shutil.copy(db, keep)
    os.truncate(db, 0)
    assert _until(lambda: _ready(svc).status_code == 503)
    assert "truncated" in _ready(svc).json()["detail"]
