"""A fault of the service is INTERNAL, logged and counted, and the client reconnects; only a bad message is final."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from sqlalchemy import exc as sa_exc

from rematd import client, wire
from rematd.planner.messages import InvalidMessage, StepStats
from rematd.server import ServeConfig, ServiceThread
from rematd.server.core.advisor import RankSession
from rematd.server.core.errors import JobNotFound, SessionError, ShuttingDown, Unauthenticated
from rematd.server.transport.grpc_status import status_of
from rematd.v1 import advisor_pb2 as pb

from .helpers import tiny_model, train_step
from .test_service import hello, session, stats


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_only_a_bad_message_is_invalid_argument() -> None:
    assert status_of(InvalidMessage("stats.step", "goes backwards")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(ValueError("a bug: math domain error")) == grpc.StatusCode.INTERNAL
    assert status_of(KeyError("missing")) == grpc.StatusCode.INTERNAL
    assert status_of(RuntimeError("database is locked")) == grpc.StatusCode.INTERNAL
    assert status_of(JobNotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert status_of(SessionError("ended")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_of(Unauthenticated("token")) == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(ShuttingDown("draining")) == grpc.StatusCode.UNAVAILABLE


def test_a_fault_of_the_service_is_internal_logged_counted_and_the_client_reconnects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    bound = svc.start()
    core = svc.service.core
    real = core.on_stats
    faults: list[int] = []

    def faulty(session: RankSession, stats: StepStats) -> object:
        if stats.step == 3 and not faults:
            faults.append(stats.step)
            # A plain ValueError from a bug: once taken for a bad message, it stopped the rank for good.
            raise ValueError("math domain error (a bug in the service)")
        return real(session, stats)

    monkeypatch.setattr(core, "on_stats", faulty)
    caplog.set_level(logging.WARNING)
    model = tiny_model(n_layer=2, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, server=bound.grpc, job="faulty", optimizer=opt)
    try:
        for step in range(10):
            train_step(model, opt, 16, seed=step)
            h.flush(1.0)  # the faulted step is never answered: do not wait long for it
        assert faults == [3]
        assert wait_for(lambda: any(r["step"] >= 9 for r in core.store.stats("faulty", 100))), (
            "the rank reconnected and its later steps reached the store"
        )
        assert h.stream is not None and h.stream.connected and "INTERNAL" in (h.stream.last_error or "")
    finally:
        h.close()
    metrics = httpx.get(f"http://{bound.http}/metrics", timeout=10).text
    assert 'rematd_service_faults_total{kind="stats"} 1.0' in metrics
    logged = [r for r in caplog.records if r.name == "rematd.server" and "handling a stats message failed" in r.message]
    assert len(logged) == 1 and logged[0].exc_info is not None, "logged with its traceback"
    assert "math domain error" in str(logged[0].exc_info[1])
    assert any(r.name == "rematd.client" and "INTERNAL" in r.getMessage() for r in caplog.records)
    svc.stop()


def _metric(http: str, name: str) -> str:
    return httpx.get(f"http://{http}/metrics", timeout=10).text.split(name, 1)[1].split("\n", 1)[0]


def test_a_fault_in_a_hello_is_internal_logged_with_its_traceback_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    bound = svc.start()
    try:
        core = svc.service.core

        def broken(hello: object) -> object:
            raise KeyError("a bug while opening a session")

        monkeypatch.setattr(core, "open_session", broken)
        caplog.set_level(logging.WARNING)
        got, err = session(bound.grpc, [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="hello-fault")))])
        assert not got and err is not None and err.code() == grpc.StatusCode.INTERNAL
        assert _metric(bound.http, 'rematd_service_faults_total{kind="hello"}').strip() == "1.0"
        logged = [r for r in caplog.records if "handling a hello message failed" in r.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info is not None
        assert "a bug while opening a session" in str(logged[0].exc_info[1])
    finally:
        svc.stop()


def test_while_the_record_fails_a_bug_still_gets_its_traceback_and_a_database_error_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    bound = svc.start()
    try:
        core = svc.service.core
        raised: list[Exception] = [
            ValueError("a bug, not the disk"),
            sa_exc.OperationalError("INSERT", {}, sqlite3.OperationalError("disk I/O error")),
        ]

        def failing(session: RankSession, stats: StepStats) -> object:
            raise raised.pop(0)

        monkeypatch.setattr(core, "on_stats", failing)
        # As the store's own write failure leaves it: failing, with the reason.
        monkeypatch.setattr(core.store, "failing_since", time.monotonic())
        monkeypatch.setattr(core.store, "last_failure", "disk I/O error")
        caplog.set_level(logging.WARNING)
        first = [
            pb.ClientMessage(hello=wire.hello_to_pb(hello(job="failing-record"))),
            pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 500))),
        ]
        for _ in range(2):
            _, err = session(bound.grpc, first)
            assert err is not None and err.code() == grpc.StatusCode.INTERNAL
        logged = [r for r in caplog.records if "handling a stats message failed" in r.getMessage()]
        assert len(logged) == 2
        assert logged[0].exc_info is not None and "a bug, not the disk" in str(logged[0].exc_info[1])
        assert logged[1].exc_info is None and "the store cannot be written (disk I/O error)" in logged[1].getMessage()
        assert _metric(bound.http, 'rematd_service_faults_total{kind="stats"}').strip() == "2.0"
    finally:
        monkeypatch.undo()
        svc.stop()
