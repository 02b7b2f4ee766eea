"""One rank's stream on the Advisor service: its messages read, dispatched to the core and answered.

A stream awaits its hello, then takes steps and OOMs until the rank says goodbye, a message fails, or the
service shuts down and tells it to reconnect. Work that grows with the profile (a large model's step, an OOM
and the plan it brings) runs on a worker thread, waited for to its end even when the stream goes meanwhile.
The servicer (``grpc_service``) admits streams, opens and closes their sessions, and ends them with a status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc
from google.protobuf.message import DecodeError

from rematd import wire
from rematd.planner import Plan
from rematd.planner.messages import InvalidMessage, OomReport
from rematd.server.core.advisor import RankSession
from rematd.server.core.errors import SessionError
from rematd.server.transport.grpc_status import DOMAIN_ERRORS
from rematd.server.transport.message_limits import precheck_stats
from rematd.v1 import advisor_pb2 as pb

if TYPE_CHECKING:
    from rematd.server.transport.grpc_service import AdvisorServicer

_R = TypeVar("_R")

# Steps of profiles this large are planned on a worker thread: planning grows with the blocks, and
# a 4,096-block step can take a quarter of a second; smaller ones cost less than the thread hop.
OFF_LOOP_BLOCKS = 512


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


class OpenStream:
    """What shutdown needs to know of one open stream."""

    __slots__ = ("reading", "task", "told")

    def __init__(self, task: asyncio.Task[object] | None) -> None:
        self.task = task
        self.reading = False
        """Waiting for the rank's next message (the only place a stream is interrupted)."""
        self.told = False
        """Interrupted by shutdown, not by the rank."""


_Answer = tuple[Sequence[pb.ServerMessage], tuple[grpc.StatusCode, str] | None]
"""What a message is answered with, and the status that ends the stream instead, if any."""


class Stream:
    """One rank's stream: awaiting its hello (no ``session`` yet), then open until the rank says goodbye
    (``ended``), a message fails, or the service shuts down and tells it to reconnect."""

    def __init__(
        self, servicer: AdvisorServicer, context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage]
    ) -> None:
        self.servicer = servicer
        self.core = servicer.core
        self.context = context
        self.open = OpenStream(asyncio.current_task())
        self.session: RankSession | None = None
        self.ended = False
        self.secret_sent = False
        self.received = 0
        """Bytes received, for the collector's schedule."""

    async def next_message(self, messages: AsyncIterator[pb.ClientMessage]) -> pb.ClientMessage | None:
        """The rank's next message; None once the stream is over (its status set where it failed)."""
        servicer = self.servicer
        if servicer.closing:
            servicer.end_with(self.context, await servicer.told_to_reconnect())
            return None
        self.open.reading = True
        try:
            msg = await anext(messages)
        except StopAsyncIteration:
            return None
        except DecodeError as err:
            self.core.metrics.invalid_messages.inc()
            bad = InvalidMessage("message", f"not a rematd.v1.ClientMessage ({err})")
            servicer.end_with(self.context, servicer.failure_of(bad))
            return None
        except asyncio.CancelledError:
            if not self.open.told:
                raise
            servicer.end_with(self.context, await servicer.told_to_reconnect())
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
        except DOMAIN_ERRORS as err:
            answer = (), self.servicer.failure_of(err)
        except Exception as err:
            # Ends this stream only: the rank reconnects.
            answer = (), self.servicer.fault(str(kind), err)
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
        opened = await self.servicer.open_hello(hello)
        if isinstance(opened[0], RankSession) and isinstance(opened[1], Plan):
            self.session = opened[0]
            self.servicer.collections.opened()
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
