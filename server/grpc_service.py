"""The gRPC adapter: proto messages in, core calls, proto messages out.

Besides the Advisor service, the server carries the standard health service
(SERVING, then NOT_SERVING from the start of a shutdown) and server reflection,
so generic tools (grpcurl, grpc_health_probe, Kubernetes gRPC probes) work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from rematd import wire
from rematd.records import InvalidMessage
from rematd.server.auth import METADATA_KEY, TokenAuth
from rematd.server.core import AdvisorCore, RankSession
from rematd.server.errors import JobNotFound, SessionError, ShuttingDown, Unauthenticated
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

log = logging.getLogger("rematd.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Advisor"].full_name


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpcOptions:
    """Transport settings of the gRPC server."""

    max_message_bytes: int = 1 << 20
    """Largest message a rank may send; a profile of 4096 blocks is well under it."""
    keepalive_seconds: float = 60.0
    """The server pings an idle connection this often, to find peers that vanished without a FIN."""
    keepalive_timeout_seconds: float = 20.0
    """A ping unanswered this long closes the connection."""
    min_client_ping_seconds: float = 10.0
    """Clients may ping this often without being told off (GOAWAY too_many_pings)."""
    reuse_port: bool = False
    """SO_REUSEPORT: several worker processes share the port (else a second bind of it fails)."""

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024:
            raise ValueError(f"max-message-bytes must be >= 1024, got {self.max_message_bytes}")
        for name in ("keepalive_seconds", "keepalive_timeout_seconds", "min_client_ping_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def channel_options(self) -> list[tuple[str, Any]]:
        # Streams live for days: no max connection age or idle limit; liveness comes from pings instead.
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_seconds * 1000)),
            # What closes a connection whose ping goes unanswered: keepalive_timeout_ms alone does not.
            ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", int(self.min_client_ping_seconds * 1000)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.so_reuseport", 1 if self.reuse_port else 0),
        ]


def status_of(err: BaseException) -> grpc.StatusCode:
    """The one place domain errors become gRPC status codes.

    Only a message the client got wrong (InvalidMessage, which names the field) is INVALID_ARGUMENT,
    which the client takes as final. Any other error, a plain ValueError from a bug included, is a
    fault of the service: INTERNAL, which the client retries with backoff.
    """
    if isinstance(err, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(err, JobNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(err, SessionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(err, ShuttingDown):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(err, InvalidMessage):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


_DOMAIN_ERRORS = (InvalidMessage, SessionError, JobNotFound, Unauthenticated, ShuttingDown)
RECONNECT = "server shutting down; reconnect"


class _OpenStream:
    """What shutdown needs to know of one open stream."""

    __slots__ = ("reading", "task", "told")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.reading = False
        """Waiting for the rank's next message (the only place a stream is interrupted)."""
        self.told = False
        """Interrupted by shutdown, not by the rank."""


class AdvisorServicer(pb_grpc.AdvisorServicer):
    """Maps domain errors to gRPC status codes; all logic lives in the core."""

    def __init__(self, core: AdvisorCore, auth: TokenAuth | None = None) -> None:
        self.core = core
        self.auth = auth or TokenAuth()
        self.draining = False
        self.closing = False
        self.flushed = asyncio.Event()
        """Set once what the open streams sent is in the record; they are told to reconnect after it."""
        self._open: set[_OpenStream] = set()

    def close_streams(self) -> None:
        """Tell every open stream to reconnect elsewhere (UNAVAILABLE), once ``flushed`` is set.

        A stream waiting for its rank's next message is interrupted there; one busy answering a
        message finishes it and stops before reading the next.
        """
        self.closing = True
        for stream in list(self._open):
            if stream.reading and stream.task is not None:
                stream.told = True
                stream.task.cancel()

    async def _tell_to_reconnect(
        self, context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage]
    ) -> NoReturn:
        await self.flushed.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, RECONNECT)
        raise AssertionError("unreachable")  # context.abort raises

    async def _abort(
        self, context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage], err: BaseException
    ) -> NoReturn:
        code = status_of(err)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            self.core.metrics.unauthenticated.labels("grpc").inc()
        await context.abort(code, str(err))
        raise AssertionError("unreachable")  # context.abort raises

    async def Session(
        self,
        request_iterator: AsyncIterator[pb.ClientMessage],
        context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage],
    ) -> AsyncIterator[pb.ServerMessage]:
        try:
            if self.draining:
                raise ShuttingDown("the service is shutting down; reconnect to another replica or later")
            header = next((v for k, v in (context.invocation_metadata() or ()) if k == METADATA_KEY), None)
            self.auth.check(header if isinstance(header, str) else None)
        except _DOMAIN_ERRORS as err:
            await self._abort(context, err)
        core = self.core
        durations = core.metrics.message_duration
        session: RankSession | None = None
        ended = False
        messages = aiter(request_iterator)
        stream = _OpenStream(asyncio.current_task())
        self._open.add(stream)
        try:
            while True:
                if self.closing:
                    await self._tell_to_reconnect(context)
                stream.reading = True
                try:
                    msg = await anext(messages)
                except StopAsyncIteration:
                    return
                except DecodeError as err:
                    core.metrics.invalid_messages.inc()
                    await self._abort(context, InvalidMessage("message", f"not a rematd.v1.ClientMessage ({err})"))
                except asyncio.CancelledError:
                    if not stream.told:
                        raise
                    await self._tell_to_reconnect(context)
                finally:
                    stream.reading = False
                started = time.perf_counter()
                kind = msg.WhichOneof("kind")
                out: Sequence[pb.ServerMessage] = ()
                try:
                    if kind == "hello":
                        if session is not None:
                            raise InvalidMessage("hello", "sent twice on one stream")
                        session, plan = core.open_session(wire.hello_from_pb(msg.hello))
                        out = (pb.ServerMessage(plan=wire.plan_to_pb(plan)),)
                    elif kind is None:
                        core.metrics.invalid_messages.inc()
                        raise InvalidMessage("kind", "empty message: set one of hello, stats, oom, goodbye")
                    elif session is None:
                        raise SessionError(f"send hello before {kind}")
                    elif kind == "stats":
                        stats = wire.stats_from_pb(msg.stats)
                        new = core.on_stats(session, stats)
                        ack = pb.ServerMessage(
                            ack=pb.StepAck(
                                step=stats.step,
                                plan_version=session.sent.version,
                                oom_risk=session.planner.oom_risk,
                                report_interval_seconds=core.report_interval(session),
                            )
                        )
                        out = (pb.ServerMessage(plan=wire.plan_to_pb(new)), ack) if new is not None else (ack,)
                    elif kind == "oom":
                        new = core.on_oom(session, wire.oom_from_pb(msg.oom))
                        if new is not None:
                            out = (pb.ServerMessage(plan=wire.plan_to_pb(new)),)
                    elif kind == "goodbye":
                        ended = True
                except _DOMAIN_ERRORS as err:
                    await self._abort(context, err)
                except Exception as err:
                    # A fault of the service (its database, a bug) ends this stream only, and says so:
                    # INTERNAL, which the client retries, so that a bug here does not stop a rank for good.
                    log.exception("handling a %s message failed", kind)
                    core.metrics.service_faults.labels(str(kind)).inc()
                    await context.abort(status_of(err), f"the service failed handling {kind}; see its log")
                if kind is not None:
                    durations.labels(kind).observe(time.perf_counter() - started)
                for m in out:
                    yield m
                if ended:
                    return
        finally:
            self._open.discard(stream)
            if session is not None:
                try:
                    core.close_session(session, ended=ended)
                except Exception:
                    log.exception("recording the end of a stream failed")


class Health:
    """The standard health service for the Advisor service and the server as a whole ('')."""

    def __init__(self) -> None:
        self.servicer = HealthServicer()

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, status)


def build_server(
    core: AdvisorCore, *, auth: TokenAuth, options: GrpcOptions
) -> tuple[grpc.aio.Server, AdvisorServicer, Health]:
    """The gRPC server with the Advisor, health and reflection services (not yet bound or started)."""
    server = grpc.aio.server(options=options.channel_options())
    servicer = AdvisorServicer(core, auth)
    pb_grpc.add_AdvisorServicer_to_server(servicer, server)
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return server, servicer, health
