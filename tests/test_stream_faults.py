"""The stream thread under faults: a failing fallback planner, a stream the service ends, an OOM while away."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.client.service.stream import FALLBACK_MAX_FAILURES, StreamBackend
from rematd.planner import PlannerSession
from rematd.v1 import advisor_pb2 as pb

from .helpers import tiny_model, train_step
from .stream_helpers import Recorder, free_port, run_steps, serve_recorder


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def stream_of(h: client.Handle) -> StreamBackend:
    assert h.stream is not None
    return h.stream


def test_an_oom_reported_while_away_reaches_the_fallback_planner_with_its_shape() -> None:
    model = tiny_model(n_layer=4, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, server=f"127.0.0.1:{free_port()}", job="oom-away", fallback_after_s=0.2, optimizer=opt)
    train_step(model, opt, 16)  # the profile, at length 16
    stream = stream_of(h)
    assert wait_for(lambda: stream.planning_locally)
    train_step(model, opt, 64, seed=1)
    assert h.flush(5.0)
    h.report_oom("the step at length 64 ran out of memory")

    def answer() -> str:
        pending = introspect.pending_plan(h)  # the planner's answer, waiting for the next step
        return pending.reason if pending is not None and "out-of-memory" in pending.reason else ""

    assert wait_for(lambda: bool(answer())), "the fallback planner answered the OOM with a tighter plan"
    assert "length 64" in answer(), answer()
    h.close()


@pytest.mark.allow_client_errors(reason="the test makes the in-process planner fail, which the client logs")
def test_a_failing_fallback_planner_is_logged_counted_and_given_up_and_the_stream_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken(self: PlannerSession, obs: object) -> None:
        calls.append(obs)
        raise RuntimeError("planner bug")

    monkeypatch.setattr(PlannerSession, "observe", broken)
    port = free_port()
    model = tiny_model(n_layer=2, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.ERROR, logger="rematd.client"):
        h = client.attach(model, server=f"127.0.0.1:{port}", job="broken", fallback_after_s=0.2, optimizer=opt)
        run_steps(model, opt, 2 * FALLBACK_MAX_FAILURES)
        stream = stream_of(h)
        assert wait_for(lambda: len(calls) >= FALLBACK_MAX_FAILURES and not stream.planning_locally)
        run_steps(model, opt, 2)
        # Two more attempts to reach the service: the pause between them, the reports of those two steps
        # waiting, is where a planner not given up would be asked again.
        tries = stream.reconnects
        assert wait_for(lambda: stream.reconnects >= tries + 2), f"{stream.reconnects - tries} reconnects, not 2"
    assert len(calls) == FALLBACK_MAX_FAILURES, "a planner that keeps failing is given up"
    assert stream.errors == FALLBACK_MAX_FAILURES
    thread = introspect.stream_thread(stream)
    assert thread is not None and thread.is_alive()
    failures = [r for r in caplog.records if "in-process planner failed (" in r.getMessage()]
    assert len(failures) == 1, "repeated failures are logged once, not once each"
    assert any("plan in force stays" in r.getMessage() for r in caplog.records)
    assert h.step_count == 2 * FALLBACK_MAX_FAILURES + 2
    local = h.plan.version  # the in-process planner's first plan, made before it failed
    monkeypatch.undo()
    rec = Recorder()
    server, _ = serve_recorder(rec, port=port)
    try:
        assert wait_for(lambda: stream.connected), "the stream thread still reconnects"
        run_steps(model, opt, 1)
        assert h.flush(5.0)
        run_steps(model, opt, 1)
        assert h.plan.version > local, "the service's plans apply again"
        h.close()
    finally:
        server.stop(None)


class EndsFirstStream(Recorder):
    """Answers the first stream's hello, then ends that stream normally (status OK)."""

    def Session(
        self, request_iterator: Iterator[pb.ClientMessage], context: grpc.ServicerContext
    ) -> Iterator[pb.ServerMessage]:  # type: ignore[override]
        first = not self.hellos
        replies = super().Session(request_iterator, context)
        if first:
            yield next(replies)
            return
        yield from replies


def test_a_stream_the_service_ends_is_reconnected() -> None:
    rec = EndsFirstStream()
    server, port = serve_recorder(rec)
    try:
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="ended", optimizer=opt, fallback_after_s=None)
        run_steps(model, opt, 2)
        stream = stream_of(h)
        assert wait_for(lambda: len(rec.hellos) >= 2), "the client came back after the service ended its stream"
        thread = introspect.stream_thread(stream)
        assert stream.reconnects >= 1 and thread is not None and thread.is_alive()
        run_steps(model, opt, 2)
        assert h.flush(10.0), "and the service answers it"
        h.close()
    finally:
        server.stop(None)


class EndsEveryStream(Recorder):
    """Answers each hello, then ends the stream normally; notes when each stream came."""

    def __init__(self) -> None:
        super().__init__()
        self.came: list[float] = []

    def Session(
        self, request_iterator: Iterator[pb.ClientMessage], context: grpc.ServicerContext
    ) -> Iterator[pb.ServerMessage]:  # type: ignore[override]
        self.came.append(time.monotonic())
        yield next(super().Session(request_iterator, context))


def test_a_service_that_keeps_ending_streams_is_reconnected_with_backoff() -> None:
    rec = EndsEveryStream()
    server, port = serve_recorder(rec)
    try:
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="flapping", optimizer=opt, fallback_after_s=None)
        run_steps(model, opt, 1)
        # Pauses of 0.2 s doubling, each 50-100% of that: the k-th at least 0.1 * 2**k s, rather than a
        # reconnection every 0.1-0.2 s. Four streams come within 0.2 + 0.4 + 0.8 s of pauses.
        assert wait_for(lambda: len(rec.came) >= 4), f"{len(rec.came)} streams came, not 4"
        gaps = [later - earlier for earlier, later in itertools.pairwise(rec.came[:4])]
        assert all(gap >= 0.1 * 2**k for k, gap in enumerate(gaps)), gaps
        h.close()
    finally:
        server.stop(None)
