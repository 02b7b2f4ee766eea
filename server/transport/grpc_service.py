"""The gRPC adapter: proto messages in, core calls, proto messages out.

Besides the Advisor service, the server carries the standard health service
(SERVING, then NOT_SERVING from the start of a shutdown) and server reflection,
so generic tools (grpcurl, grpc_health_probe, Kubernetes gRPC probes) work.

Each stream's messages are handled in ``grpc_stream``; domain errors become status codes in ``grpc_status``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from rematd import wire
from rematd.planner import Plan
from rematd.planner.messages import InvalidMessage
from rematd.server.config import GrpcOptions
from rematd.server.core.advisor import AdvisorCore, RankSession
from rematd.server.core.errors import ShuttingDown
from rematd.server.runtime.gc_schedule import Collections
from rematd.server.transport.auth import METADATA_KEY, TokenAuth
from rematd.server.transport.grpc_status import DOMAIN_ERRORS, RECONNECT, status_of
from rematd.server.transport.grpc_stream import OpenStream, Stream
from rematd.server.transport.http_guard import bounded
from rematd.server.transport.message_limits import precheck_hello
from rematd.server.transport.open_calls import MAX_OPEN_CALLS, OpenCalls, open_call_limit
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

log = logging.getLogger("rematd.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Advisor"].full_name


HELLOS_AT_ONCE = 2
"""Hellos converted and planned at the same time (the others wait their turn on their worker threads)."""


class AdvisorServicer(pb_grpc.AdvisorServicer):
    """Maps domain errors to gRPC status codes; all logic lives in the core."""

    def __init__(self, core: AdvisorCore, auth: TokenAuth | None = None) -> None:
        self.core = core
        self.auth = auth or TokenAuth()
        self.draining = False
        self.closing = False
        self.flushed = asyncio.Event()
        """Set once what the open streams sent is in the store; they are told to reconnect after it."""
        self._open: set[OpenStream] = set()
        self.collections = Collections()
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

    async def told_to_reconnect(self) -> tuple[grpc.StatusCode, str]:
        await self.flushed.wait()
        return grpc.StatusCode.UNAVAILABLE, RECONNECT

    def failure_of(self, err: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status a domain error ends a stream with; its details bounded (they travel in a header)."""
        code = status_of(err)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            self.core.metrics.unauthenticated.labels("grpc").inc()
        return code, bounded(str(err))

    @staticmethod
    def end_with(
        context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage], failure: tuple[grpc.StatusCode, str]
    ) -> None:
        """End the stream with ``failure`` once the handler returns.

        Not ``context.abort``: its exception is kept by the call's state, which its traceback's frames
        keep in turn, a cycle that holds the call (and the message it received) until the collector
        runs, and the collector runs seldom in this service.
        """
        context.set_code(failure[0])
        context.set_details(failure[1])

    def fault(self, kind: str, err: Exception) -> tuple[grpc.StatusCode, str]:
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
        except DOMAIN_ERRORS as err:
            return self.failure_of(err)
        except Exception as err:
            return self.fault("hello", err)

    async def open_hello(self, hello: pb.Hello) -> tuple[RankSession, Plan] | tuple[grpc.StatusCode, str]:
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
        except DOMAIN_ERRORS as err:
            return self.failure_of(err)
        return None

    async def Session(
        self,
        request_iterator: AsyncIterator[pb.ClientMessage],
        context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage],
    ) -> AsyncIterator[pb.ServerMessage]:
        refused = self._admitted(context)
        if refused is not None:
            self.end_with(context, refused)
            return
        stream = Stream(self, context)
        self._open.add(stream.open)
        messages = aiter(request_iterator)
        try:
            while (msg := await stream.next_message(messages)) is not None:
                out, failure = await stream.answer(msg)
                if failure is not None:
                    self.end_with(context, failure)
                    return
                for m in out:
                    yield m
                if stream.ended:
                    return
        finally:
            self._open.discard(stream.open)
            self.collections.request(stream.received)
            if stream.session is not None:
                await self._close(stream.session, ended=stream.ended)


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
