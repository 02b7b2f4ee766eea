"""A fault of the service is INTERNAL, logged and counted, and the client reconnects; only a bad message is final."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from rematd import client
from rematd.records import InvalidMessage, StepStats
from rematd.server import ServeConfig, ServiceThread
from rematd.server.core import RankSession
from rematd.server.errors import JobNotFound, SessionError, ShuttingDown, Unauthenticated
from rematd.server.grpc_service import status_of

from .helpers import tiny_model, train_step


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
            "the rank reconnected and its later steps reached the record"
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
