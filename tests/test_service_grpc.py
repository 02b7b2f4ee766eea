"""The gRPC side of the service: health, reflection, limits, graceful shutdown, and fuzzing over a real channel."""

from __future__ import annotations

import asyncio
import math
import socket
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
from rematd.server.config import GrpcOptions
from rematd.server.core.advisor import AdvisorCore
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store
from rematd.server.transport.auth import TokenAuth
from rematd.server.transport.grpc_service import build_server
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_service import hello, session, stats

ADVISOR = "rematd.v1.Advisor"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceThread]:
    db = tmp_path_factory.mktemp("grpc") / "r.db"
    svc = ServiceThread(
        ServeConfig(grpc_port=0, http_port=0, db=str(db), grpc=GrpcOptions(max_message_bytes=64 * 1024))
    )
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
    msg = wire.hello_to_pb(hello(n=4097))
    for b in msg.blocks:
        # Small enough blocks that the message stays under the size limit and reaches validation.
        b.name, b.saved_bytes, b.input_bytes, b.forward_seconds = "", 1, 1, 0.0
    assert msg.ByteSize() < 64 * 1024
    _, err = session(live.service.bound.grpc, [pb.ClientMessage(hello=msg)])
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert (err.details() or "").startswith("hello.blocks:") and "4097" in (err.details() or "")


def test_reflection_describes_the_session_method(channel: grpc.Channel) -> None:
    from google.protobuf import descriptor_pb2

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=ADVISOR)
    reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=5)))
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b) for b in reply.file_descriptor_response.file_descriptor_proto
    ]
    methods = {
        m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
        for f in files
        for svc in f.service
        if f"{f.package}.{svc.name}" == ADVISOR
        for m in svc.method
    }
    assert methods == {"Session": (".rematd.v1.ClientMessage", ".rematd.v1.ServerMessage", True, True)}


def _frames(sock: socket.socket) -> Iterator[tuple[int, int]]:
    """(type, flags) of each HTTP/2 frame the server sends, until it closes the connection."""
    buf = b""
    while True:
        while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
            try:
                data = sock.recv(65536)
            except TimeoutError:
                return
            if not data:
                return
            buf += data
        length, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
        buf = buf[9 + length :]
        yield kind, flags


def test_a_peer_that_stops_answering_pings_is_dropped(tmp_path: Path) -> None:
    """The keepalive options at work: a rank whose host vanished (no FIN, no answers) loses its stream."""
    options = GrpcOptions(keepalive_seconds=0.2, keepalive_timeout_seconds=0.3)
    loop = asyncio.new_event_loop()
    started, stop = threading.Event(), asyncio.Event()
    port = 0

    async def serve() -> None:
        nonlocal port
        core = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
        server, _, _ = build_server(core, auth=TokenAuth(), options=options)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        started.set()
        await stop.wait()
        await server.stop(0)
        core.store.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    settings, ping, goaway, headers = 4, 6, 7, 1
    # A client that opens a Session stream and then goes silent, as a host that vanished would.
    block = b"".join(
        bytes([0, len(k)]) + k + bytes([len(v)]) + v
        for k, v in [(b":method", b"POST"), (b":scheme", b"http"), (b":path", f"/{ADVISOR}/Session".encode()),
                     (b":authority", b"rank"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    )  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, settings, 0, 0, 0, 0, 0]))
        sock.sendall(len(block).to_bytes(3, "big") + bytes([headers, 4, 0, 0, 0, 1]) + block)
        t0 = time.monotonic()
        seen: list[tuple[float, int]] = []
        for kind, flags in _frames(sock):
            seen.append((time.monotonic() - t0, kind))
            if kind == settings and not flags & 1:
                sock.sendall(bytes([0, 0, 0, settings, 1, 0, 0, 0, 0]))  # settings are acknowledged, pings never
        closed = time.monotonic() - t0
    loop.call_soon_threadsafe(stop.set)
    thread.join(15)
    loop.close()
    pings = [t for t, kind in seen if kind == ping]
    assert pings and pings[0] < 1.5, f"the server pings an idle connection: {seen}"
    assert goaway in [kind for _, kind in seen] and closed < pings[0] + 2.0, f"dropped {closed:.1f} s in: {seen}"


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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
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
