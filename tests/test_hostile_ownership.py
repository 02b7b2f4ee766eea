"""Who may open and resume a (job, rank), against a real service on loopback: a stranger cannot poison a rank
whose trainer is away, a refused trainer is told who holds its rank (and trains on), and a job an operator
issued a token for opens only with it."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from rematd import client, wire
from rematd.client.service.credential import JOB_TOKEN_ENV
from rematd.planner import Shape
from rematd.planner.messages import Hello, OomReport
from rematd.server import ServeConfig, ServiceThread
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .helpers import tiny_model, train_step
from .test_service import hello, session, stats

TRAINER = "trainer-credential-0123456789"


def _target(svc: ServiceThread) -> str:
    assert svc.service.bound is not None
    return svc.service.bound.grpc


class _Held:
    """A stream kept open until ``release``: a process that holds its rank."""

    def __init__(self, target: str, h: Hello) -> None:
        self._out: queue.Queue[pb.ClientMessage | None] = queue.Queue()
        self._out.put(pb.ClientMessage(hello=wire.hello_to_pb(h)))
        self._out.put(pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 3000))))
        self.acks: queue.Queue[pb.ServerMessage] = queue.Queue()
        self._channel = grpc.insecure_channel(target)
        self._call = pb_grpc.AdvisorStub(self._channel).Session(iter(self._out.get, None))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for msg in self._call:
                self.acks.put(msg)
        except grpc.RpcError:
            pass

    def secret(self) -> str:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            msg = self.acks.get(timeout=10)
            if msg.WhichOneof("kind") == "ack" and msg.ack.session_secret:
                return msg.ack.session_secret
        raise AssertionError("no session secret")

    def lose(self) -> None:
        """The stream goes without a goodbye (a crash, a network cut)."""
        self._call.cancel()
        self._channel.close()


def _connected(svc: ServiceThread, job: str, rank: int, want: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = svc.service.core.sessions.by_key.get((job, rank))
        if s is not None and s.streams == want:
            return
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} of {job} never had {want} stream(s)")


def test_a_stranger_cannot_resume_a_lost_rank_nor_teach_it_fake_ooms(service_thread: ServiceThread) -> None:
    target = _target(service_thread)
    mine = dataclasses.replace(hello(job="poison"), job_secret=TRAINER, host="trainer-host", pid=1234)
    held = _Held(target, mine)
    session_secret = held.secret()
    held.lose()
    _connected(service_thread, "poison", 0, 0)
    # A hello for the same (job, rank), with no credential or another one, then OOMs: refused at the hello.
    for credential in ("", "stranger-credential-0123456789"):
        stranger = dataclasses.replace(hello(job="poison"), job_secret=credential, plan_version=1)
        oom = wire.oom_to_pb(OomReport(step=1, shape=Shape(batch=1, seq_len=64, tokens=64), plan_version=1))
        _, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(stranger)), pb.ClientMessage(oom=oom)])
        assert err is not None and err.code() == grpc.StatusCode.ABORTED
        assert "is held by process 1234 on trainer-host" in (err.details() or "")
    rank = service_thread.service.core.sessions.by_key.get(("poison", 0))
    assert rank is not None and rank.hello.pid == 1234  # still the trainer's session
    # The trainer comes back with its credential and session secret: its session resumes, no OOM on record.
    back = dataclasses.replace(mine, session_secret=session_secret, plan_version=rank.sent.version if rank else 1)
    got, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(back)), pb.ClientMessage(goodbye=pb.Goodbye())])
    assert err is None and got and got[0].WhichOneof("kind") == "plan"
    assert service_thread.service.core.store.ooms("poison") == []


def test_a_rank_held_by_another_process_is_named_to_the_refused_one(service_thread: ServiceThread) -> None:
    target = _target(service_thread)
    stray = dataclasses.replace(hello(job="squat"), job_secret="stray-credential-0123456789", host="stray", pid=4242)
    held = _Held(target, stray)
    held.secret()
    real = dataclasses.replace(hello(job="squat"), job_secret=TRAINER, host="gpu-7", pid=99)
    _, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(real))])
    assert err is not None and err.code() == grpc.StatusCode.ABORTED
    detail = err.details() or ""
    assert "is held by process 4242 on stray (model abc) since 20" in detail, detail
    held.lose()
    # Lost without a goodbye: still the stray's until it expires, whoever asks.
    _connected(service_thread, "squat", 0, 0)
    _, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(real))])
    assert err is not None and err.code() == grpc.StatusCode.ABORTED


def test_a_refused_trainer_says_so_once_and_trains_on(
    service_thread: ServiceThread, caplog: pytest.LogCaptureFixture
) -> None:
    target = _target(service_thread)
    stray = dataclasses.replace(hello(job="held-job"), job_secret="stray-credential-0123456789", host="stray", pid=7)
    held = _Held(target, stray)
    held.secret()
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.DEBUG, logger="rematd.client"):
        h = client.attach(model, server=target, job="held-job", optimizer=opt, fallback_after_s=None)
        try:
            deadline = time.monotonic() + 20
            steps = 0
            while time.monotonic() < deadline and sum("is held by" in r.getMessage() for r in caplog.records) < 2:
                train_step(model, opt, 32, seed=steps)
                steps += 1
                time.sleep(0.05)
        finally:
            h.close()
    told = [r for r in caplog.records if "is held by" in r.getMessage()]
    assert len(told) >= 2, "the client did not retry"
    assert [r.levelno for r in told].count(logging.WARNING) == 1
    assert "process 7 on stray" in told[0].getMessage()
    assert steps > 0
    held.lose()


def test_a_job_with_an_operator_token_opens_only_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = tmp_path / "job-tokens"
    tokens.write_text("# issued by the platform team\nteam-a-* team-a-token-0123456789\n")
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db"), job_tokens_file=str(tokens)))
    svc.start()
    try:
        target = _target(svc)
        bye = pb.ClientMessage(goodbye=pb.Goodbye())
        _, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="team-a-llm"))), bye])
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "job token" in (err.details() or "")
        ok = dataclasses.replace(hello(job="team-a-llm"), job_secret="team-a-token-0123456789")
        _, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(ok)), bye])
        assert err is None
        # Jobs it does not name open as before.
        _, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="team-b-llm"))), bye])
        assert err is None
        # The client presents the token its environment gives.
        monkeypatch.setenv(JOB_TOKEN_ENV, "team-a-token-0123456789")
        from rematd.client.service.credential import job_credential

        assert job_credential() == "team-a-token-0123456789"
    finally:
        svc.stop()
    with pytest.raises(ValueError, match="line 1"):
        bad = tmp_path / "bad-tokens"
        bad.write_text("team-a short\n")
        ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r2.db"), job_tokens_file=str(bad))
