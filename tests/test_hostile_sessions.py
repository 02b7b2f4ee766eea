"""Sessions belong to their stream: a live rank cannot be joined or driven by another connection, a rank that
really reconnects proves itself with the secret of its first ack, and an operator's end reaches the client."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from rematd import client, wire
from rematd.client import introspect
from rematd.client.service.stream import StreamBackend
from rematd.server import ServeConfig, ServiceThread
from rematd.server.app import Bound
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .helpers import tiny_model, train_step
from .test_service import hello, stats


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Bound]:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    bound = svc.start()
    yield bound
    svc.stop()


class Stream:
    """One bidirectional stream driven message by message."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
        self.call = pb_grpc.AdvisorStub(self.channel).Session(iter(self.outbox.get, None), timeout=30)

    def send(self, msg: pb.ClientMessage) -> pb.ServerMessage:
        self.outbox.put(msg)
        return next(self.call)

    def close(self) -> None:
        self.outbox.put(None)
        self.call.cancel()
        self.channel.close()


def _hello(**changes: object) -> pb.ClientMessage:
    return pb.ClientMessage(hello=wire.hello_to_pb(dataclasses.replace(hello(job="victim"), **changes)))  # type: ignore[arg-type]


def _stats(step: int, peak: int = 500) -> pb.ClientMessage:
    return pb.ClientMessage(stats=wire.stats_to_pb(stats(step, peak)))


def _refused(target: str, msg: pb.ClientMessage) -> grpc.RpcError:
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.AdvisorStub(ch).Session(iter([msg, _stats(10**6, 9999)]), timeout=10))
    return err.value


def test_a_live_rank_cannot_be_joined_without_its_secret(service: Bound) -> None:
    victim = Stream(service.grpc)
    try:
        plan = victim.send(_hello())
        assert plan.WhichOneof("kind") == "plan"
        first = victim.send(_stats(0))
        secret = first.ack.session_secret
        assert len(secret) >= 24, "the first ack issues the secret"
        assert victim.send(_stats(1)).ack.session_secret == "", "and only the first"
        version = plan.plan.version
        # Everything REST shows (job, rank, fingerprint, plan version) is not enough.
        err = _refused(service.grpc, _hello(session_secret="s" * 100_000))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_secret" in (err.details() or "")
        for attempt in (
            _hello(),
            _hello(plan_version=version),
            _hello(plan_version=version, session_secret="not-the-secret"),
        ):
            err = _refused(service.grpc, attempt)
            assert err.code() == grpc.StatusCode.ABORTED, err
            assert "session secret" in (err.details() or "") and secret not in (err.details() or "")
        # The victim's stream goes on as if nothing happened (the attacker's jumped step never landed).
        assert victim.send(_stats(2)).ack.step == 2
        job = httpx.get(f"http://{service.http}/api/v1/jobs/victim").json()
        assert job["ranks"][0]["connected"] and job["oom_events"] == 0
        # The rank itself, reconnecting with its secret while the old stream still looks open, joins.
        again = Stream(service.grpc)
        try:
            resumed = again.send(_hello(plan_version=version, session_secret=secret))
            assert resumed.plan.version == version
            assert again.send(_stats(3)).ack.step == 3
        finally:
            again.close()
    finally:
        victim.close()


def test_a_rank_gone_for_good_can_be_replaced(service: Bound) -> None:
    """A rank whose stream has ended is not held hostage: a fresh process may start over."""
    first = Stream(service.grpc)
    first.send(_hello())
    first.send(_stats(0))
    first.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        job = httpx.get(f"http://{service.http}/api/v1/jobs/victim").json()
        if not job["ranks"][0]["connected"]:
            break
        time.sleep(0.05)
    fresh = Stream(service.grpc)
    try:
        assert fresh.send(_hello()).WhichOneof("kind") == "plan"
    finally:
        fresh.close()


def test_the_client_keeps_the_secret_and_presents_it(service: Bound) -> None:
    model = tiny_model(n_layer=2, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, server=service.grpc, job="keeper", optimizer=opt)
    try:
        for i in range(3):
            train_step(model, opt, 16, seed=i)
        assert h.flush(10.0)
        stream = h.stream
        assert isinstance(stream, StreamBackend)
        secret = introspect.hello(h).session_secret
        assert len(secret) >= 24
        assert secret not in repr(introspect.hello(h)), "the secret stays out of logs and reprs"
    finally:
        h.close()


def test_an_operators_end_reaches_the_client_as_a_warning(service: Bound, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model(n_layer=2, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    caplog.set_level(logging.WARNING, logger="rematd.client")
    h = client.attach(model, server=service.grpc, job="ended-job", optimizer=opt)
    try:
        train_step(model, opt, 16)
        assert h.flush(10.0)
        r = httpx.post(f"http://{service.http}/api/v1/jobs/ended-job/end")
        assert r.status_code == 200, r.text
        stopped = threading.Event()
        deadline = time.monotonic() + 15
        step = 1
        while time.monotonic() < deadline and not stopped.is_set():
            train_step(model, opt, 16, seed=step)  # training goes on regardless
            step += 1
            if any("an operator ended this job" in m for m in caplog.messages):
                stopped.set()
            time.sleep(0.05)
        warnings = [r for r in caplog.records if "an operator ended this job" in r.getMessage()]
        assert warnings and warnings[0].levelno == logging.WARNING
        assert "ended-job" in warnings[0].getMessage()
    finally:
        h.close()
