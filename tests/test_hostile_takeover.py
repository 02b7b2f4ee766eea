"""A live rank stays its trainer's: the session secret alone does not take it over, and an operator's end is
final for the stream it reached even when the job is opened again at once."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from rematd import wire
from rematd.server import ServeConfig, ServiceThread
from rematd.server.app import Bound
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_hostile_sessions import Stream, _stats
from .test_service import hello

TRAINER = "trainer-credential-0123456789"
NEWCOMER = "newcomer-credential-0123456789"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ServiceThread, Bound]]:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db")))
    bound = svc.start()
    yield svc, bound
    svc.stop()


def _hello(job: str, credential: str, **changes: object) -> pb.ClientMessage:
    h = dataclasses.replace(hello(job=job), job_secret=credential, host="gpu-1", pid=4242)
    return pb.ClientMessage(hello=wire.hello_to_pb(dataclasses.replace(h, **changes)))  # type: ignore[arg-type]


def _oom(step: int) -> pb.ClientMessage:
    return pb.ClientMessage(oom=pb.OomEvent(step=step, shape=pb.Shape(batch=1, seq_len=64, tokens=64), plan_version=1))


def test_the_session_secret_alone_does_not_take_over_a_live_rank(served: tuple[ServiceThread, Bound]) -> None:
    svc, bound = served
    trainer = Stream(bound.grpc)
    try:
        plan = trainer.send(_hello("secret-only", TRAINER))
        secret = trainer.send(_stats(100)).ack.session_secret
        assert secret
        version = plan.plan.version
        # The secret leaked (a log, a core dump), the credential did not: no credential, or another one.
        for credential in ("", "stranger-credential-0123456789"):
            taking = _hello("secret-only", credential, plan_version=version, session_secret=secret)
            with grpc.insecure_channel(bound.grpc) as ch, pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.AdvisorStub(ch).Session(iter([taking, _oom(6), _stats(6)]), timeout=10))
            assert err.value.code() == grpc.StatusCode.ABORTED, err.value
            assert "job credential" in (err.value.details() or "")
        # The trainer's stream goes on, its steps in order, and no OOM was recorded for it.
        assert trainer.send(_stats(101)).ack.step == 101
        assert svc.service.core.store.ooms("secret-only") == []
        # Its own process, reconnecting with both, still joins its session.
        again = Stream(bound.grpc)
        try:
            resumed = again.send(_hello("secret-only", TRAINER, plan_version=version, session_secret=secret))
            assert resumed.plan.version == version
            assert again.send(_stats(102)).ack.step == 102
        finally:
            again.close()
    finally:
        trainer.close()


def test_an_ended_jobs_stream_stays_ended_when_the_job_is_opened_again(served: tuple[ServiceThread, Bound]) -> None:
    svc, bound = served
    old = Stream(bound.grpc)
    try:
        old.send(_hello("reopened", TRAINER))
        for step in range(5):
            assert old.send(_stats(step)).ack.step == step
        ended = httpx.post(f"http://{bound.http}/api/v1/jobs/reopened/end", timeout=10)
        assert ended.status_code == 200, ended.text
        # Another process opens the job again before the old stream sends its next report.
        new = Stream(bound.grpc)
        try:
            assert new.send(_hello("reopened", NEWCOMER)).WhichOneof("kind") == "plan"
            with pytest.raises(grpc.RpcError) as err:
                old.send(_stats(5))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "ended by an operator" in (err.value.details() or "")
            # The newcomer holds the rank; only its steps are recorded after the end.
            for step in range(3):
                assert new.send(_stats(step, 600)).ack.step == step
            held = svc.service.core.sessions.by_key[("reopened", 0)]
            assert held.hello.job_secret == NEWCOMER and held.streams == 1
            rows = svc.service.core.store.stats("reopened", limit=100)
            assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 0, 1, 2]
            assert [r["peak_bytes"] for r in rows[5:]] == [600, 600, 600]
        finally:
            new.close()
    finally:
        old.close()
