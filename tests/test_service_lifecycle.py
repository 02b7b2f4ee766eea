"""A rank's session from hello to its end: refused hellos, restarts, crashes, shutdown; and what
the event loop and the HTTP threads share."""

from __future__ import annotations

import dataclasses
import queue
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from rematd import wire
from rematd.planner import Plan
from rematd.planner.messages import Hello, StepStats
from rematd.server import ServeConfig, ServiceThread
from rematd.server.config import CoreConfig, StoreConfig
from rematd.server.core.advisor import AdvisorCore, RankSession
from rematd.server.core.errors import SessionTaken
from rematd.server.metrics.registry import Metrics
from rematd.server.store.database import database_url
from rematd.server.store.store import Store
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_service import _fields, hello, session, stats


def scrape(http: str) -> dict[str, float]:
    """The service's /metrics, as series -> value."""
    out = {}
    for line in httpx.get(f"http://{http}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_for(check: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


class OpenStream:
    """A rank's stream kept open: send messages one at a time, read the replies."""

    def __init__(self, channel: grpc.Channel, h: Hello) -> None:
        self.outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
        self.outbox.put(pb.ClientMessage(hello=wire.hello_to_pb(h)))
        self.call = pb_grpc.AdvisorStub(channel).Session(iter(self.outbox.get, None), timeout=30)
        self.plan = next(self.call).plan

    def step(self, step: int, peak: int = 500) -> None:
        self.outbox.put(pb.ClientMessage(stats=wire.stats_to_pb(stats(step, peak))))
        while next(self.call).WhichOneof("kind") != "ack":
            pass


@pytest.fixture
def core(tmp_path: Path) -> Iterator[AdvisorCore]:
    c = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    yield c
    c.store.close()


def test_a_hello_the_record_refuses_leaves_no_connected_rank(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(db)))
    bound = svc.start()
    try:
        # The database itself refuses this job's rank (as a full disk or a lost connection would).
        with sqlite3.connect(db) as conn:
            conn.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON ranks WHEN NEW.job = 'doomed' "
                "BEGIN SELECT RAISE(ABORT, 'refused by the database'); END"
            )
        _, err = session(bound.grpc, [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="doomed")))])
        series = scrape(bound.http)
        assert series["rematd_active_streams"] == 0.0
        assert not any('job="doomed"' in name for name in series), "no gauges for a rank that never connected"
        assert err is not None and err.code() == grpc.StatusCode.INTERNAL, err
        # The job and its rank are written in one transaction, or not at all.
        assert httpx.get(f"http://{bound.http}/api/v1/jobs/doomed", timeout=10).status_code == 404
        # Another job is served as before.
        got, err = session(bound.grpc, [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="fine")))])
        assert err is None and got[0].plan.version == 1
    finally:
        svc.stop()


def test_a_rank_that_restarts_before_its_old_stream_is_found_dead_gets_in_once_it_is(core: AdvisorCore) -> None:
    old, _ = core.open_session(hello(job="j", rank=0))
    # The process restarted and says hello afresh (without the old stream's secret) while the old stream
    # still looks open: refused for now (ABORTED, which clients retry), since it could be anyone.
    with pytest.raises(SessionTaken):
        core.open_session(hello(job="j", rank=0))
    core.close_session(old, ended=False)  # keepalive finally notices the old stream is gone
    new, _ = core.open_session(hello(job="j", rank=0))
    core.on_stats(new, stats(0, 500))
    job = core.get_job("j")
    assert job["state"] == "running" and job["ranks"][0]["state"] == "connected"
    assert new.streams == 1 and core.metrics.registry.get_sample_value("rematd_active_streams") == 1.0
    samples = core.rank_samples()
    assert [(s.rank, s.connected) for s in samples] == [(0, True)]
    # A reconnect that presents the secret joins at once: the old stream's end must not end the job.
    older, _ = core.open_session(hello(job="k", rank=0))
    newer, _ = core.open_session(dataclasses.replace(hello(job="k", rank=0), session_secret=older.secret))
    core.close_session(older, ended=False)
    assert core.get_job("k")["state"] == "running" and any(s.job == "k" for s in core.rank_samples())
    core.close_session(newer, ended=True)
    assert core.get_job("k")["state"] == "ended"


def test_ranks_lost_longer_than_the_expiry_are_forgotten_with_their_jobs_series(tmp_path: Path) -> None:
    core = AdvisorCore(Store(tmp_path / "r.db"), Metrics(), CoreConfig(session_expiry_seconds=60))
    h0, h1 = hello(job="crashed", rank=0), hello(job="crashed", rank=1)
    r0, _ = core.open_session(h0)
    r1, _ = core.open_session(h1)
    core.on_stats(r0, stats(0, 500))
    core.close_session(r0, ended=True)  # rank 0 finished cleanly
    core.close_session(r1, ended=False)  # rank 1 crashed
    live, _ = core.open_session(hello(job="alive"))
    now = time.monotonic()
    assert core.expire_sessions(now + 30) == 0, "not yet"
    assert {s.job for s in core.rank_samples()} == {"crashed", "alive"}
    assert core.expire_sessions(now + 61) == 1
    assert {s.job for s in core.rank_samples()} == {"alive"}, "a connected rank never expires"
    assert core.metrics.registry.get_sample_value("rematd_steps_total", {"job": "crashed"}) is None
    assert core.get_job("crashed")["state"] == "disconnected", "the store keeps the job as it was left"
    # A rank that comes back after its expiry starts afresh, continuing its plan history.
    back, plan = core.open_session(Hello(**{**_fields(h1), "plan_version": 1}))
    assert plan.version == 2 and back is not r1
    core.close_session(live, ended=True)
    core.close_session(back, ended=True)
    core.store.close()


def test_a_crashed_rank_expires_on_a_live_server(tmp_path: Path) -> None:
    cfg = ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db"), core=CoreConfig(session_expiry_seconds=0.4))
    svc = ServiceThread(cfg)
    bound = svc.start()
    try:
        with grpc.insecure_channel(bound.grpc) as ch:
            rank = OpenStream(ch, hello(job="gone"))
            rank.step(0)
            assert scrape(bound.http)['rematd_job_connected_ranks{job="gone"}'] == 1.0
            rank.call.cancel()  # the process died: no goodbye
        assert wait_for(lambda: not any('job="gone"' in name for name in scrape(bound.http)))
    finally:
        svc.stop()


def test_shutdown_tells_open_streams_to_reconnect_before_the_grace_ends(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(db), grace_seconds=5.0))
    bound = svc.start()
    try:
        with grpc.insecure_channel(bound.grpc) as ch:
            rank = OpenStream(ch, hello(job="moving"))
            rank.step(0, peak=1234)
            started = time.monotonic()
            svc.begin_stop()
            with pytest.raises(grpc.RpcError) as caught:
                next(rank.call)
            waited = time.monotonic() - started
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down; reconnect" in (caught.value.details() or "")
            assert waited < 2.5, f"told after {waited:.1f} s, with a grace of 5 s"
            # What the rank sent is in the store before it is told to go elsewhere.
            with sqlite3.connect(db) as conn:
                assert conn.execute("SELECT peak_bytes FROM stats WHERE job='moving'").fetchall() == [(1234,)]
    finally:
        svc.stop()


def test_http_reads_copy_live_sessions_under_the_lock(core: AdvisorCore) -> None:
    s, _ = core.open_session(hello(job="busy"))
    got: list[dict[str, object]] = []
    with core.sessions.lock:  # as the event loop holds it while adding a rank
        reader = threading.Thread(target=lambda: got.extend([*core.list_jobs(), core.get_job("busy")]))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive(), "a read went through the live sessions while they were being changed"
    reader.join(10)
    assert [j["job"] for j in got] == ["busy", "busy"] and got[1]["ranks"][0]["plan_version"] == 1  # type: ignore[index]
    core.close_session(s, ended=True)


def test_a_hello_does_not_wait_for_other_jobs_buffered_statistics(tmp_path: Path) -> None:
    store = Store(StoreConfig(url=database_url(tmp_path / "r.db"), flush_seconds=3600))
    core = AdvisorCore(store, Metrics())
    busy, _ = core.open_session(hello(job="busy"))
    core.on_stats(busy, stats(0, 500))
    assert store.pending() == 1
    # A new job of a known model reads the warm-start table; a returning rank reads its plan history.
    core.open_session(hello(job="newcomer"))
    core.open_session(dataclasses.replace(hello(job="returning", rank=1), plan_version=3))
    assert store.pending() == 1, "a hello wrote another job's buffered statistics"
    # Reads of what the buffer holds still see it.
    assert [r["peak_bytes"] for r in core.job_stats("busy")] == [500]
    assert store.pending() == 0
    store.close()


def test_readiness_turns_503_as_the_service_starts_draining(tmp_path: Path) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db"), drain_seconds=3.0))
    bound = svc.start()
    try:
        ready = httpx.get(f"http://{bound.http}/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
        svc.begin_stop()
        # Within the drain: the store still takes writes, HTTP still answers, and balancers are told to go.
        got: list[httpx.Response] = []
        assert wait_for(
            lambda: got.append(httpx.get(f"http://{bound.http}/readyz", timeout=10)) or got[-1].status_code == 503,
            timeout=2.5,
        ), [r.status_code for r in got]
        assert "draining" in got[-1].json()["detail"]
        assert httpx.get(f"http://{bound.http}/healthz", timeout=10).status_code == 200, "still alive while draining"
    finally:
        svc.stop()


def test_a_slow_record_at_one_streams_end_does_not_hold_up_another_streams_acks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    bound = svc.start()
    store = svc.service.core.store
    real = store.set_rank_state
    writing = threading.Event()
    delay = 0.5

    def slow(*, job: str, rank: int | None = None, state: str) -> None:
        if job == "leaving":
            writing.set()
            time.sleep(delay)  # as a store on a slow disk takes its time
        real(job=job, rank=rank, state=state)

    monkeypatch.setattr(store, "set_rank_state", slow)
    try:
        with grpc.insecure_channel(bound.grpc) as ch:
            leaving = OpenStream(ch, hello(job="leaving"))
            busy = OpenStream(ch, hello(job="busy"))
            busy.step(0)
            leaving.outbox.put(pb.ClientMessage(goodbye=pb.Goodbye()))
            leaving.outbox.put(None)
            assert writing.wait(10), "the leaving rank's end is being written"
            latencies = []
            for step in range(1, 4):
                started = time.monotonic()
                busy.step(step)
                latencies.append(time.monotonic() - started)
            assert max(latencies) < delay / 2, f"acks took {latencies} while another stream's end was written"
            assert wait_for(lambda: {r["state"] for r in store.ranks("leaving")} == {"ended"}, timeout=5)
            busy.outbox.put(None)
    finally:
        svc.stop()


def test_operator_changes_and_a_resume_wait_for_the_ranks_planning(core: AdvisorCore) -> None:
    s, _ = core.open_session(hello(job="tuned"))
    core.on_stats(s, stats(0, 500))
    done: list[str] = []
    with s.planning:  # as a stats thread of a large profile holds it while it plans
        tune = threading.Thread(target=lambda: done.append(str(core.tune("tuned", {"margin_ratio": 0.3}))))
        tune.start()
        tune.join(0.3)
        assert tune.is_alive(), "the margin changed under a planner at work"
        assert core.sessions.lock.acquire(timeout=2), "the core's lock is held while waiting for the planner"
        core.sessions.lock.release()
    tune.join(10)
    assert done and s.planner.controller.config.margin_ratio == 0.3
    # The rank comes back with versions of its own (it planned while cut off): renumbered under the same lock.
    back = dataclasses.replace(hello(job="tuned"), plan_version=s.sent.version + 5, session_secret=s.secret)
    resumed: list[object] = []
    with s.planning:
        opener = threading.Thread(target=lambda: resumed.append(core.open_session(back)))
        opener.start()
        opener.join(0.3)
        assert opener.is_alive(), "the planner was renumbered while at work"
    opener.join(10)
    assert resumed and s.sent.version > back.plan_version
    core.close_session(s, ended=True)
    core.close_session(s, ended=True)


def test_a_cancelled_stream_closes_its_session_only_after_its_planning_thread_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rematd.server.transport import grpc_stream

    monkeypatch.setattr(grpc_stream, "OFF_LOOP_BLOCKS", 1)  # every step planned on a worker thread
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    bound = svc.start()
    core = svc.service.core
    real_stats, real_close = core.on_stats, core.close_session
    planning = threading.Event()
    order: list[str] = []

    def slow_stats(session: RankSession, st: StepStats) -> Plan | None:
        if order == []:
            planning.set()
            time.sleep(0.5)  # as a 4,096-block step takes its time
            order.append("planned")
        return real_stats(session, st)

    def close(session: RankSession, *, ended: bool) -> None:
        order.append("closed")
        real_close(session, ended=ended)

    monkeypatch.setattr(core, "on_stats", slow_stats)
    monkeypatch.setattr(core, "close_session", close)
    try:
        with grpc.insecure_channel(bound.grpc) as ch:
            rank = OpenStream(ch, hello(job="cancelled"))
            rank.outbox.put(pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 500))))
            assert planning.wait(10)
            rank.call.cancel()
            assert wait_for(lambda: "closed" in order, timeout=5)
            assert order == ["planned", "closed"], "the session was closed while its step was being planned"
            assert wait_for(lambda: {r["state"] for r in core.store.ranks("cancelled")} == {"disconnected"})
            rank.outbox.put(None)
    finally:
        svc.stop()


def test_a_rank_no_longer_live_shows_its_own_last_plan_not_another_ranks(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.db")
    core = AdvisorCore(store, Metrics())
    _, roomy_plan = core.open_session(hello(job="mixed", rank=0, budget=100_000))
    _, tight_plan = core.open_session(hello(job="mixed", rank=1, budget=2_500))
    assert roomy_plan.blocks != tight_plan.blocks, "the two ranks plan differently"
    store.close()
    # A restarted service: neither rank is live; the job's newest plan is rank 1's.
    store = Store(tmp_path / "r.db")
    try:
        core = AdvisorCore(store, Metrics())
        assert store.plans("mixed")[-1]["rank"] == 1
        for view in (core.get_job("mixed"), core.list_jobs()[0]):
            ranks = {r["rank"]: r for r in view["ranks"]}
            assert ranks[0]["checkpointed_blocks"] == list(roomy_plan.blocks), view
            assert ranks[1]["checkpointed_blocks"] == list(tight_plan.blocks), view
    finally:
        store.close()
