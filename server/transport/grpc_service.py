"""The gRPC adapter: proto messages in, core calls, proto messages out.

Besides the Advisor service, the server carries the standard health service
(SERVING, then NOT_SERVING from the start of a shutdown) and server reflection,
so generic tools (grpcurl, grpc_health_probe, Kubernetes gRPC probes) work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from rematd import wire
from rematd.messages import InvalidMessage, OomReport
from rematd.planner import Plan
from rematd.server.config import GrpcOptions
from rematd.server.core.advisor import AdvisorCore, RankSession
from rematd.server.core.errors import (
    JobNotFound,
    SessionError,
    SessionTaken,
    ShuttingDown,
    StoreStalled,
    Unauthenticated,
)
from rematd.server.runtime.gc_schedule import Collections
from rematd.server.transport.auth import METADATA_KEY, TokenAuth
from rematd.server.transport.http_guard import bounded
from rematd.server.transport.message_limits import precheck_hello, precheck_stats
from rematd.server.transport.open_calls import MAX_OPEN_CALLS, OpenCalls, open_call_limit
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

log = logging.getLogger("rematd.server")

_R = TypeVar("_R")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Advisor"].full_name


def status_of(err: BaseException) -> grpc.StatusCode:
    """The one place domain errors become gRPC status codes.

    Only a message the client got wrong (InvalidMessage, which names the field) is INVALID_ARGUMENT,
    which the client takes as final. Every other error, a plain ValueError from a bug included, is a
    fault of the service: INTERNAL, which the client retries with backoff.
    """
    if isinstance(err, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(err, JobNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(err, SessionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(err, SessionTaken):
        # Retried by clients: once the other stream has ended, the rank may start a session of its own.
        return grpc.StatusCode.ABORTED
    if isinstance(err, (ShuttingDown, StoreStalled)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(err, InvalidMessage):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


_DOMAIN_ERRORS = (
    InvalidMessage,
    SessionError,
    SessionTaken,
    JobNotFound,
    Unauthenticated,
    ShuttingDown,
    StoreStalled,
)
RECONNECT = "server shutting down; reconnect"


# Steps of profiles this large are planned on a worker thread: planning grows with the blocks, and
# a 4,096-block step can take a quarter of a second; smaller ones cost less than the thread hop.
OFF_LOOP_BLOCKS = 512
HELLOS_AT_ONCE = 2
"""Hellos converted and planned at the same time (the others wait their turn on their worker threads)."""


async def _to_the_end(fn: Callable[..., _R], *args: object) -> _R:
    """``fn`` on a worker thread, waited for to its end even when the stream is cancelled meanwhile:
    the stream's session is closed after it, never while its planning thread may still set what the
    rank was sent or write a plan."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await work
        raise


class _OpenStream:
    """What shutdown needs to know of one open stream."""

    __slots__ = ("reading", "task", "told")

    def __init__(self, task: asyncio.Task[object] | None) -> None:
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
        """Set once what the open streams sent is in the store; they are told to reconnect after it."""
        self._open: set[_OpenStream] = set()
        self._collections = Collections()
        # A hello's records take some 16 times its bytes while it is converted and planned: a few at once, so
        # that a flood of large ones (rejected at the end) peaks at a few of them and leaves fewer pages behind.
        self._converting = threading.BoundedSemaphore(HELLOS_AT_ONCE)

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

    async def _told_to_reconnect(self) -> tuple[grpc.StatusCode, str]:
        await self.flushed.wait()
        return grpc.StatusCode.UNAVAILABLE, RECONNECT

    def _failure(self, err: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status a domain error ends a stream with; its details bounded (they travel in a header)."""
        code = status_of(err)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            self.core.metrics.unauthenticated.labels("grpc").inc()
        return code, bounded(str(err))

    @staticmethod
    def _end(
        context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage], failure: tuple[grpc.StatusCode, str]
    ) -> None:
        """End the stream with ``failure`` once the handler returns.

        Not ``context.abort``: its exception is kept by the call's state, which its traceback's frames
        keep in turn, a cycle that holds the call (and the message it received) until the collector
        runs, and the collector runs seldom in this service.
        """
        context.set_code(failure[0])
        context.set_details(failure[1])

    def _fault(self, kind: str, err: Exception) -> tuple[grpc.StatusCode, str]:
        """The one place a fault of the service (its database, a bug) becomes INTERNAL: logged, counted,
        and said so to the client, which retries, so that a bug does not stop a rank for good.

        A failing store (counted and alerted on by itself) gets one line per fault; anything else,
        while the store fails too, is still a bug and gets its traceback.
        """
        failure = self.core.store_failure(err)
        if failure:
            log.error("handling a %s message failed: the store cannot be written (%s)", kind, failure)
        else:
            log.error("handling a %s message failed", kind, exc_info=err)
        self.core.metrics.service_faults.labels(kind).inc()
        return grpc.StatusCode.INTERNAL, f"the service failed handling {kind}; see its log"

    def _hello_blocking(self, hello: pb.Hello) -> tuple[RankSession, Plan] | tuple[grpc.StatusCode, str]:
        """Open a session, or say why not as plain data: an exception carried back to the loop would
        keep the message alive through its traceback, in a cycle only the collector breaks."""
        try:
            try:
                precheck_hello(hello)
            except InvalidMessage:
                self.core.metrics.invalid_messages.inc()
                raise
            with self._converting:
                return self.core.open_session(wire.hello_from_pb(hello))
        except _DOMAIN_ERRORS as err:
            return self._failure(err)
        except Exception as err:
            return self._fault("hello", err)

    async def _hello(self, hello: pb.Hello) -> tuple[RankSession, Plan] | tuple[grpc.StatusCode, str]:
        """A rank's hello, converted and planned off the event loop: its work grows with the profile,
        and every other stream (and /healthz) waits while the loop is held."""
        work = asyncio.ensure_future(asyncio.to_thread(self._hello_blocking, hello))
        del hello
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The stream went while its hello was planned: a session opened meanwhile must still close.
            opened = await work
            if isinstance(opened[0], RankSession):
                await self._close(opened[0], ended=False)
            raise

    def _close_blocking(self, session: RankSession, ended: bool) -> None:
        try:
            self.core.close_session(session, ended=ended)
        except Exception as err:
            failure = self.core.store_failure(err)
            if failure:  # counted and alerted on
                log.error("recording the end of a stream failed: %s", failure)
            else:
                log.exception("recording the end of a stream failed")

    async def _close(self, session: RankSession, *, ended: bool) -> None:
        """Close a rank's session off the event loop (it writes the store), to the end even when the
        stream's task is cancelled meanwhile: a session left open would refuse the rank's reconnect."""
        await asyncio.shield(asyncio.ensure_future(asyncio.to_thread(self._close_blocking, session, ended)))

    def _admitted(
        self, context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage]
    ) -> tuple[grpc.StatusCode, str] | None:
        """Why a new stream is refused (shutting down, no or a wrong token); None when it is taken."""
        try:
            if self.draining:
                raise ShuttingDown("the service is shutting down; reconnect to another replica or later")
            header = next((v for k, v in (context.invocation_metadata() or ()) if k == METADATA_KEY), None)
            self.auth.check(header if isinstance(header, str) else None)
        except _DOMAIN_ERRORS as err:
            return self._failure(err)
        return None

    async def Session(
        self,
        request_iterator: AsyncIterator[pb.ClientMessage],
        context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage],
    ) -> AsyncIterator[pb.ServerMessage]:
        refused = self._admitted(context)
        if refused is not None:
            self._end(context, refused)
            return
        stream = _Stream(self, context)
        self._open.add(stream.open)
        messages = aiter(request_iterator)
        try:
            while (msg := await stream.next_message(messages)) is not None:
                out, failure = await stream.answer(msg)
                if failure is not None:
                    self._end(context, failure)
                    return
                for m in out:
                    yield m
                if stream.ended:
                    return
        finally:
            self._open.discard(stream.open)
            self._collections.request(stream.received)
            if stream.session is not None:
                await self._close(stream.session, ended=stream.ended)


_Answer = tuple[Sequence[pb.ServerMessage], tuple[grpc.StatusCode, str] | None]
"""What a message is answered with, and the status that ends the stream instead, if any."""


class _Stream:
    """One rank's stream: awaiting its hello (no ``session`` yet), then open until the rank says goodbye
    (``ended``), a message fails, or the service shuts down and tells it to reconnect."""

    def __init__(
        self, servicer: AdvisorServicer, context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage]
    ) -> None:
        self.servicer = servicer
        self.core = servicer.core
        self.context = context
        self.open = _OpenStream(asyncio.current_task())
        self.session: RankSession | None = None
        self.ended = False
        self.secret_sent = False
        self.received = 0
        """Bytes received, for the collector's schedule."""

    async def next_message(self, messages: AsyncIterator[pb.ClientMessage]) -> pb.ClientMessage | None:
        """The rank's next message; None once the stream is over (its status set where it failed)."""
        servicer = self.servicer
        if servicer.closing:
            servicer._end(self.context, await servicer._told_to_reconnect())
            return None
        self.open.reading = True
        try:
            msg = await anext(messages)
        except StopAsyncIteration:
            return None
        except DecodeError as err:
            self.core.metrics.invalid_messages.inc()
            bad = InvalidMessage("message", f"not a rematd.v1.ClientMessage ({err})")
            servicer._end(self.context, servicer._failure(bad))
            return None
        except asyncio.CancelledError:
            if not self.open.told:
                raise
            servicer._end(self.context, await servicer._told_to_reconnect())
            return None
        finally:
            self.open.reading = False
        self.received += msg.ByteSize()
        return msg

    async def answer(self, msg: pb.ClientMessage) -> _Answer:
        """Handle one message; a domain error is the client's (its status), anything else the service's."""
        started = time.perf_counter()
        kind = msg.WhichOneof("kind")
        try:
            answer = await self._dispatch(kind, msg)
        except _DOMAIN_ERRORS as err:
            answer = (), self.servicer._failure(err)
        except Exception as err:
            # Ends this stream only: the rank reconnects.
            answer = (), self.servicer._fault(str(kind), err)
        if kind is not None:
            self.core.metrics.message_duration.labels(kind).observe(time.perf_counter() - started)
        return answer

    async def _dispatch(self, kind: str | None, msg: pb.ClientMessage) -> _Answer:
        if kind == "hello":
            return await self._on_hello(msg.hello)
        if kind is None:
            self.core.metrics.invalid_messages.inc()
            raise InvalidMessage("kind", "empty message: set one of hello, stats, oom, goodbye")
        if self.session is None:
            raise SessionError(f"send hello before {kind}")
        if kind == "stats":
            return await self._on_stats(self.session, msg.stats), None
        if kind == "oom":
            return await self._on_oom(self.session, msg.oom), None
        self.ended = True  # goodbye
        return (), None

    async def _on_hello(self, hello: pb.Hello) -> _Answer:
        if self.session is not None:
            raise InvalidMessage("hello", "sent twice on one stream")
        opened = await self.servicer._hello(hello)
        if isinstance(opened[0], RankSession) and isinstance(opened[1], Plan):
            self.session = opened[0]
            self.servicer._collections.opened()
            return (pb.ServerMessage(plan=wire.plan_to_pb(opened[1])),), None
        if isinstance(opened[0], grpc.StatusCode) and isinstance(opened[1], str):
            return (), (opened[0], opened[1])
        return (), None

    async def _on_stats(self, session: RankSession, msg: pb.StepStats) -> Sequence[pb.ServerMessage]:
        core = self.core
        try:
            precheck_stats(msg)
        except InvalidMessage:
            core.metrics.invalid_messages.inc()
            raise
        stats = wire.stats_from_pb(msg)
        if len(session.hello.blocks) >= OFF_LOOP_BLOCKS:
            new = await _to_the_end(core.on_stats, session, stats)
        else:
            new = core.on_stats(session, stats)
        if new is not None:
            # A plan goes out once it is in the store: a crash right after must not lose what the rank runs.
            await _to_the_end(core.durable, session)
        ack = pb.ServerMessage(
            ack=pb.StepAck(
                step=stats.step,
                plan_version=session.sent.version,
                oom_risk=session.planner.oom_risk,
                report_interval_seconds=core.report_interval(session),
                session_secret="" if self.secret_sent else session.secret,
            )
        )
        self.secret_sent = True
        return (pb.ServerMessage(plan=wire.plan_to_pb(new)), ack) if new is not None else (ack,)

    async def _on_oom(self, session: RankSession, msg: pb.OomEvent) -> Sequence[pb.ServerMessage]:
        if not session.ooms.take():
            self.core.metrics.oom_dropped.inc()  # over the rank's rate: neither planned nor written
            return ()
        new = await _to_the_end(self._oom_blocking, session, wire.oom_from_pb(msg))
        return (pb.ServerMessage(plan=wire.plan_to_pb(new)),) if new is not None else ()

    def _oom_blocking(self, session: RankSession, oom: OomReport) -> Plan | None:
        """An OOM planned, and answered once it (and the plan it brought) is in the store."""
        new = self.core.on_oom(session, oom)
        self.core.durable(session)
        return new


class Health:
    """The standard health service for the Advisor service and the server as a whole ('')."""

    def __init__(self) -> None:
        self.servicer = HealthServicer()

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, status)


def build_server(
    core: AdvisorCore, *, auth: TokenAuth, options: GrpcOptions, max_connections: int = 0
) -> tuple[grpc.aio.Server, AdvisorServicer, Health]:
    """The gRPC server with the Advisor, health and reflection services (not yet bound or started)."""
    # Health and reflection need no token: their long calls are bounded in number and in time.
    most = open_call_limit(max_connections) if max_connections else MAX_OPEN_CALLS
    limit = OpenCalls(most=most, seconds=options.idle_connection_seconds)
    server = grpc.aio.server(options=options.channel_options(max_connections), interceptors=[limit])
    servicer = AdvisorServicer(core, auth)
    pb_grpc.add_AdvisorServicer_to_server(servicer, server)
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return server, servicer, health
