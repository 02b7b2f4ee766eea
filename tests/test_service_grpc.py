"""The gRPC side of the service: health, reflection, limits, graceful shutdown, and fuzzing over a real channel."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rematd import wire
from rematd.server import ServeConfig, ServiceThread
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_service import hello, session, stats

ADVISOR = "rematd.v1.Advisor"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceThread]:
    db = tmp_path_factory.mktemp("grpc") / "r.db"
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(db), max_message_bytes=64 * 1024))
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def channel(live: ServiceThread) -> Iterator[grpc.Channel]:
    assert live.service.bound is not None
    with grpc.insecure_channel(live.service.bound.grpc) as ch:
        yield ch


def health_of(ch: grpc.Channel, service: str = "") -> int:
    resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(resp.status)


def test_health_serves_the_server_and_the_advisor(channel: grpc.Channel) -> None:
    assert health_of(channel) == health_pb2.HealthCheckResponse.SERVING
    assert health_of(channel, ADVISOR) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health_of(channel, "no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_advisor_to_a_generic_client(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(
        stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    )
    names = {s.name for s in replies[0].list_services_response.service}
    assert ADVISOR in names and "grpc.health.v1.Health" in names
    # A generic client can fetch the schema of the service by name.
    replies = list(
        stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=ADVISOR)]))
    )
    protos = replies[0].file_descriptor_response.file_descriptor_proto
    assert protos and any(b"Session" in p for p in protos)


def test_oversized_message_is_refused_and_the_server_lives(channel: grpc.Channel) -> None:
    big = wire.hello_to_pb(hello(n=4))
    big.client_version = "x" * (80 * 1024)
    call = pb_grpc.AdvisorStub(channel).Session(iter([pb.ClientMessage(hello=big)]), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert health_of(channel) == health_pb2.HealthCheckResponse.SERVING


def test_too_many_blocks_names_the_field(live: ServiceThread) -> None:
    assert live.service.bound is not None
    _, err = session(live.service.bound.grpc, [pb.ClientMessage(hello=wire.hello_to_pb(hello(n=4097)))])
    assert err is not None and err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_shutdown_says_not_serving_before_streams_go(tmp_path: Path) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db"), drain_seconds=1.5))
    bound = svc.start()
    with grpc.insecure_channel(bound.grpc) as ch:
        # A long-lived stream is open while the service begins to stop.
        sent = threading.Event()

        def messages() -> Iterator[pb.ClientMessage]:
            yield pb.ClientMessage(hello=wire.hello_to_pb(hello(job="draining")))
            sent.wait(10)
            yield pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 100)))

        call = pb_grpc.AdvisorStub(ch).Session(messages(), timeout=20)
        first = next(call)
        assert first.WhichOneof("kind") == "plan"
        svc.begin_stop()
        deadline = time.monotonic() + 5
        status = None
        while time.monotonic() < deadline:
            status = health_of(ch)
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        # New sessions are turned away while draining; the open one still gets answers.
        _, err = session(bound.grpc, [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="late")))])
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
        sent.set()
        assert next(call).WhichOneof("kind") in ("ack", "plan")
    svc.stop()


# -- fuzzing over a real channel ------------------------------------------------------------------

_u64 = st.one_of(st.integers(0, 10), st.integers(0, 2**64 - 1))
_u32 = st.one_of(st.integers(0, 10), st.integers(0, 2**32 - 1))
_float = st.floats(allow_nan=True, allow_infinity=True)
_text = st.text(max_size=40)


@st.composite
def hellos(draw: st.DrawFn) -> pb.Hello:
    msg = wire.hello_to_pb(hello(job="fuzz", n=draw(st.integers(1, 6))))
    msg.job_id = draw(st.one_of(st.just("fuzz"), _text))
    msg.rank = draw(_u32)
    msg.world_size = draw(_u32)
    msg.budget_bytes = draw(_u64)
    msg.static_bytes = draw(_u64)
    msg.margin_ratio = draw(_float)
    msg.memory_source = draw(st.integers(0, 5))
    msg.plan_version = draw(_u64)
    for b in msg.blocks:
        b.index = draw(st.one_of(st.just(b.index), _u32))
        b.saved_bytes = draw(_u64)
        b.forward_seconds = draw(_float)
    msg.profile_shape.tokens = draw(_u64)
    return msg


@st.composite
def step_stats(draw: st.DrawFn) -> pb.StepStats:
    msg = wire.stats_to_pb(stats(0, 10))
    msg.step = draw(_u64)
    msg.saved_peak_bytes = draw(_u64)
    msg.peak_allocated_bytes = draw(_u64)
    msg.budget_bytes = draw(_u64)
    msg.static_bytes = draw(_u64)
    msg.step_seconds = draw(_float)
    msg.plan_version = draw(_u64)
    msg.shape.tokens = draw(_u64)
    msg.shape.seq_len = draw(_u32)
    return msg


client_messages = st.one_of(
    hellos().map(lambda h: pb.ClientMessage(hello=h)),
    step_stats().map(lambda s: pb.ClientMessage(stats=s)),
    st.builds(lambda step, msg: pb.ClientMessage(oom=pb.OomEvent(step=step, message=msg)), _u64, _text),
    st.just(pb.ClientMessage(goodbye=pb.Goodbye(reason="fuzz"))),
    st.just(pb.ClientMessage()),
)
_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    first=st.one_of(hellos(), st.just(wire.hello_to_pb(hello(job="fuzz")))),
    rest=st.lists(client_messages, max_size=6),
)
def test_random_message_sequences_get_a_named_refusal_or_answers(
    channel: grpc.Channel, first: pb.Hello, rest: list[pb.ClientMessage]
) -> None:
    call = pb_grpc.AdvisorStub(channel).Session(iter([pb.ClientMessage(hello=first), *rest]), timeout=10)
    try:
        for reply in call:
            assert reply.WhichOneof("kind") in ("plan", "ack")
            if reply.WhichOneof("kind") == "plan":
                assert all(math.isfinite(x) for x in (reply.plan.predicted_overhead_ratio,))
    except grpc.RpcError as err:
        assert err.code() in _REFUSALS, (err.code(), err.details())
        detail = err.details() or ""
        if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert ":" in detail, f"the refusal names no field: {detail!r}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=200))
def test_undecodable_bytes_do_not_hurt_the_server(channel: grpc.Channel, payload: bytes) -> None:
    raw = channel.stream_stream(
        f"/{ADVISOR}/Session", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    try:
        list(raw(iter([payload]), timeout=10))
    except grpc.RpcError as err:
        # Bytes that do not parse, and messages that do but make no sense, both get a named refusal.
        assert err.code() in _REFUSALS, (err.code(), err.details())


def test_server_lives_after_the_fuzzing(channel: grpc.Channel, live: ServiceThread) -> None:
    assert health_of(channel) == health_pb2.HealthCheckResponse.SERVING
    assert live.service.bound is not None
    got, err = session(live.service.bound.grpc, [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="after-fuzz")))])
    assert err is None and got[0].plan.version >= 1
