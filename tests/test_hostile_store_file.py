"""The store's SQLite file deleted, replaced or truncated under a serving service: seen within a second,
/readyz turns 503 with the reason, a metric says so, nothing is written into a fresh file, and the newest
step reports wait in memory until the file is back."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from bench.served import launch, stop
from rematd import wire
from rematd.server import ServeConfig, ServiceThread
from rematd.server.core.advisor import AdvisorCore
from rematd.server.store.database import StoreError
from rematd.server.store.store import Store
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

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


def _flush_rounds(store: Store) -> Callable[[], int]:
    """How many rounds the store's write-behind thread has finished from now on: each looks at the file, then
    writes what is buffered (or finds it cannot). What a round would have written, it has written when it ends."""
    rounds = 0
    flush = store.flush

    def counted() -> None:
        nonlocal rounds
        try:
            flush()
        finally:
            if threading.current_thread() is store._flusher:  # not a flush of another caller's
                rounds += 1

    store.flush = counted  # type: ignore[method-assign]
    return lambda: rounds


def _after_rounds(store: Store, rounds: int, why: str) -> None:
    """Wait until the write-behind thread has finished ``rounds`` more rounds (``why`` says what for)."""
    done = _flush_rounds(store)
    assert _until(lambda: done() >= rounds), f"the store's write-behind thread ran {done()} rounds, not {rounds}, {why}"


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
    _after_rounds(svc.service.core.store, 2, "after the hello")
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
    _after_rounds(store, 2, "after the reports")
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


def _foreign(path: Path) -> None:
    """Another application's SQLite file at ``path``, made aside and moved there (as a deploy script would)."""
    made = path.with_name("made-elsewhere.db")
    con = sqlite3.connect(made)
    con.execute("CREATE TABLE notes (x TEXT)")
    con.executemany("INSERT INTO notes VALUES (?)", [(f"note {i}",) for i in range(100)])
    con.commit()
    con.close()
    os.replace(made, path)


def _notes(path: Path) -> int:
    con = sqlite3.connect(path)
    try:
        return int(con.execute("SELECT count(*) FROM notes").fetchone()[0])
    finally:
        con.close()


def test_a_foreign_file_put_in_the_stores_place_stays_readable_after_a_sigkill(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    srv = launch(db, "--log-level", "error")
    try:
        with grpc.insecure_channel(srv.grpc) as ch:
            for i in range(20):  # a journal of some size, not yet copied into the file
                msgs = [
                    pb.ClientMessage(hello=wire.hello_to_pb(hello(job=f"j{i}"))),
                    pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 500))),
                    pb.ClientMessage(goodbye=pb.Goodbye()),
                ]
                list(pb_grpc.AdvisorStub(ch).Session(iter(msgs), timeout=10))
        assert Path(f"{db}-wal").stat().st_size > 0
        _foreign(db)
        assert _until(lambda: httpx.get(f"{srv.http}/readyz", timeout=10).status_code == 503)
        srv.proc.send_signal(signal.SIGKILL)
        assert srv.proc.wait(10) == -signal.SIGKILL
    finally:
        stop(srv.proc)
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    again = subprocess.run(
        [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0", "--db", str(db)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 2 and "is not a rematd store" in again.stderr, again.stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest, "rematd's start changed the file"
    assert _notes(db) == 100  # the application that owns it reads it whole


def test_a_journal_left_beside_a_foreign_file_is_refused_untouched(tmp_path: Path) -> None:
    """Killed before it saw the file replaced: the journal it left is named, and neither file is touched."""
    db = tmp_path / "r.db"
    store = Store(db)
    keep = sqlite3.connect(db)  # holds the journal open, as a killed service leaves it
    keep.execute("PRAGMA wal_autocheckpoint=0")
    core = AdvisorCore(store)
    for i in range(20):
        s, _ = core.open_session(hello(job=f"j{i}"))
        core.close_session(s, ended=True)
    journal = Path(f"{db}-wal")
    left = tmp_path / "left-wal"
    shutil.copy(journal, left)
    store.close()
    keep.close()
    _foreign(db)
    shutil.copy(left, journal)
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (db, journal)}
    with pytest.raises(StoreError, match=re.escape(f"{journal} beside it is a journal")):
        Store(db)
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (db, journal)} == before
    journal.unlink()
    Path(f"{db}-shm").unlink(missing_ok=True)
    assert _notes(db) == 100


def test_another_process_writing_the_store_leaves_this_ones_reads_whole(tmp_path: Path) -> None:
    """The file watch reads the header without closing a descriptor of the file (which would drop SQLite's
    locks): another process writing, then closing, took itself for the last one and removed the journal
    from under this process's connections, which read "malformed" from then on."""
    db = tmp_path / "r.db"
    store = Store(db)
    try:
        core = AdvisorCore(store)
        for h in (hello(job="long"), hello(job="wide", n=256)):
            s, _ = core.open_session(h)
            core.on_stats(s, stats(0, 500))
            core.close_session(s, ended=True)
        assert _until(lambda: store.watch is not None and store.pending() == 0)
        _after_rounds(store, 2, "looking at the file")  # the watch has looked at the file again
        writer = (
            "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "from bench.store_rows import more_plans, more_steps; "
            "more_steps(Path(sys.argv[2]), 'long', 20000); more_plans(Path(sys.argv[2]), 'wide', 256, 500)"
        )
        root = str(Path(__file__).resolve().parents[1])
        subprocess.run([sys.executable, "-c", writer, root, str(db)], check=True, timeout=60)
        assert len(store.plans("wide", after=0, limit=1000)) == 501
        assert len(store.stats("long", 30_000)) == 20_001
    finally:
        store.close()


_EVERY_DESCRIPTOR = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from rematd.server.core.advisor import AdvisorCore
from rematd.server.store.store import Store
from tests.test_service import hello, stats

store = Store(sys.argv[2])
core = AdvisorCore(store)
core.open_session(hello(job="before"))
taken = []
try:
    while True:
        taken.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    problem = store.check_file()
    session, _ = core.open_session(hello(job="during"))
    core.on_stats(session, stats(0, 500))
    store.flush()
    rows = len(store.stats("during", 10))
    # Several statements at once (the writer, the flush, reads on threads) find a connection each.
    held = [store.engine.connect() for _ in range(6)]
    at_once = sum(c.exec_driver_sql("SELECT count(*) FROM jobs").scalar() for c in held)
    for c in held:
        c.close()
finally:
    for fd in taken:
        os.close(fd)
store.close()
print(json.dumps({"taken": len(taken), "problem": problem, "rows": rows, "at_once": at_once}))
"""


def test_the_store_needs_no_new_descriptor_when_a_burst_took_them_all(tmp_path: Path) -> None:
    """A burst of connections can take every descriptor for a moment (the HTTP cap applies after accept):
    the store is not taken for lost then, and a hello and its step are written."""
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        ["prlimit", "--nofile=256:256", "--", sys.executable, "-c", _EVERY_DESCRIPTOR, root, str(tmp_path / "r.db")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["taken"] > 0
    assert said == {"taken": said["taken"], "problem": "", "rows": 1, "at_once": 12}
