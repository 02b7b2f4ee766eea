"""A slow database holds up only the stream whose write it is: one job's hello, plan and OOM writes
are each delayed by a second in the database driver, the slow job's answers wait for their own
writes, and another job's stream keeps getting its acks at once, on a real gRPC server over loopback
and a real SQLite file."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
from sqlalchemy import event

from rematd import wire
from rematd.planner import Shape
from rematd.planner.messages import OomReport
from rematd.server import ServeConfig, ServiceThread
from rematd.server.store.store import Store
from rematd.v1 import advisor_pb2 as pb

from .test_service import hello, stats
from .test_service_lifecycle import OpenStream, wait_for

DELAY = 1.0
PROMPT = 0.5


class SlowDatabase:
    """Sleeps in the driver, once per armed statement, on a statement whose parameters name ``job``."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.armed: str | None = None
        self.stalling = threading.Event()
        self.stalled = threading.Event()
        self.seen: list[str] = []

    def arm(self, statement: str) -> None:
        self.stalling.clear()
        self.stalled.clear()
        self.armed = statement

    def __call__(self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if self.job not in repr(parameters):
            return
        self.seen.append(statement.split("(")[0].strip())
        if self.armed is not None and statement.lstrip().startswith(self.armed):
            self.armed = None
            self.stalling.set()
            time.sleep(DELAY)  # as a database on a slow disk, or across a congested network, takes its time
            self.stalled.set()


def _steady_acks(stream: OpenStream, first: int, slow: SlowDatabase) -> None:
    """Three steps of the other job while the slow write runs; each one's time to its ack."""
    assert slow.stalling.wait(10), "the slow job's write reached the database"
    took = []
    for step in range(first, first + 3):
        started = time.monotonic()
        stream.step(step)
        took.append(time.monotonic() - started)
    assert max(took) < PROMPT, f"acks took {took} s while another job's write took {DELAY} s"
    assert not slow.stalled.is_set(), "the steps ran while the slow write was still under way"
    assert slow.stalled.wait(10), "the slow write ended"


def test_one_jobs_slow_writes_delay_no_other_streams_acks(tmp_path: Path) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    bound = svc.start()
    store = svc.service.core.store
    slow = SlowDatabase("stalled")
    event.listen(store.engine, "before_cursor_execute", slow)
    try:
        with grpc.insecure_channel(bound.grpc) as ch:
            steady = OpenStream(ch, hello(job="steady"))
            steady.step(0)

            # The slow job's hello: recorded before its rank counts as connected, so its stream waits.
            slow.arm("INSERT INTO jobs")
            opened: list[OpenStream] = []
            opener = threading.Thread(target=lambda: opened.append(OpenStream(ch, hello(job="stalled"))))
            opener.start()
            _steady_acks(steady, 1, slow)
            opener.join(10)
            assert opened and opened[0].plan.version == 1
            stalled = opened[0]

            # A step that tightens its plan: the plan goes out once it is in the store, so this rank's answer
            # waits for its own write (a crash must not lose what the rank runs); the other job's do not.
            slow.arm("INSERT INTO plans")
            started = time.monotonic()
            stalled.outbox.put(pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 9500, seq=128))))
            _steady_acks(steady, 4, slow)
            kinds = []
            while not kinds or kinds[-1] != "ack":
                kinds.append(next(stalled.call).WhichOneof("kind"))
            own_answer = time.monotonic() - started
            assert kinds == ["plan", "ack"], kinds
            assert own_answer >= DELAY * 0.9, f"the plan went out {own_answer:.2f} s in, before its write ended"

            # An OOM: its event is written behind the stream's back too.
            slow.arm("INSERT INTO oom_events")
            oom = OomReport(step=1, shape=Shape(batch=1, seq_len=128, tokens=128), plan_version=2, message="CUDA OOM")
            stalled.outbox.put(pb.ClientMessage(oom=wire.oom_to_pb(oom)))
            _steady_acks(steady, 7, slow)

            stalled.outbox.put(pb.ClientMessage(goodbye=pb.Goodbye()))
            stalled.outbox.put(None)
            steady.outbox.put(pb.ClientMessage(goodbye=pb.Goodbye()))
            steady.outbox.put(None)
            for stream in (stalled, steady):
                for _ in stream.call:  # to the stream's end: what the service still had to say
                    pass
        # Nothing was lost, and the slow job's plans landed in version order.
        assert wait_for(lambda: {r["state"] for r in store.ranks("stalled")} == {"ended"}, timeout=10)
        versions = [p["version"] for p in store.plans("stalled")]
        assert len(versions) >= 2 and versions == sorted(versions) and versions[0] == 1, versions
        assert [o["message"] for o in store.ooms("stalled")] == ["CUDA OOM"]
        assert sorted(r["step"] for r in store.stats("steady", 100)) == list(range(10))
        assert {"INSERT INTO jobs", "INSERT INTO plans", "INSERT INTO oom_events"} <= set(slow.seen)
    finally:
        svc.stop()
        event.remove(store.engine, "before_cursor_execute", slow)


def test_a_write_still_under_way_at_shutdown_lands_before_the_record_closes(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(db)))
    bound = svc.start()
    store = svc.service.core.store
    slow = SlowDatabase("leaving")
    event.listen(store.engine, "before_cursor_execute", slow)
    try:
        with grpc.insecure_channel(bound.grpc) as ch:
            rank = OpenStream(ch, hello(job="leaving"))
            slow.arm("INSERT INTO plans")
            rank.step(0, peak=9500)  # a tighter plan, written behind the stream's back
            assert slow.stalling.wait(10)
            svc.begin_stop()  # while the plan's write is under way, the stream still open
            svc.stop()
    finally:
        svc.stop()
        event.remove(store.engine, "before_cursor_execute", slow)
    reopened = Store(db)
    try:
        assert [p["version"] for p in reopened.plans("leaving")] == [1, 2]
        assert [r["step"] for r in reopened.stats("leaving", 10)] == [0]
    finally:
        reopened.close()


def test_rows_another_thread_is_writing_keep_the_buffer_busy(tmp_path: Path) -> None:
    """A flush that finds the flusher thread writing waits for it (and fails with it) rather than finding the
    buffer empty: at shutdown, rows a failing write will keep must not be taken for written."""
    store = Store(tmp_path / "busy.db")
    try:
        store.open_rank(job="busy", rank=0, now=0.0, world_size=1, num_blocks=1, budget_bytes=1, fingerprint="")
        row = {"step": 1, "time": 1.0, "peak_bytes": 1, "budget_bytes": 1, "predicted_peak_bytes": 1,
               "plan_version": 1, "seq_len": 1, "batch": 1, "step_seconds": 0.1, "oom_risk": None}  # fmt: skip
        store.buffer.add(job="busy", rank=0, row=row)  # type: ignore[arg-type]
        writing, release = threading.Event(), threading.Event()

        def slow(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
            if statement.startswith("INSERT INTO stats"):
                writing.set()
                release.wait(10)

        event.listen(store.engine, "before_cursor_execute", slow)
        flusher = threading.Thread(target=store.buffer.flush)
        flusher.start()
        assert writing.wait(10)
        assert store.pending() == 0, "the rows are out of the buffer, being written"
        assert not store.buffer.idle(), "rows being written keep the buffer busy"
        release.set()
        flusher.join(10)
        assert store.buffer.idle() and store.count_stats("busy") == 1
    finally:
        store.close()
