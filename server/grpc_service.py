"""The gRPC adapter: proto messages in, core calls, proto messages out."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from rematd import wire
from rematd.records import InvalidMessage
from rematd.server.core import AdvisorCore, RankSession
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

log = logging.getLogger("rematd.server")


class AdvisorServicer(pb_grpc.AdvisorServicer):
    """Maps domain errors to gRPC status codes; all logic lives in the core."""

    def __init__(self, core: AdvisorCore) -> None:
        self.core = core

    async def Session(
        self,
        request_iterator: AsyncIterator[pb.ClientMessage],
        context: grpc.aio.ServicerContext[pb.ClientMessage, pb.ServerMessage],
    ) -> AsyncIterator[pb.ServerMessage]:
        session: RankSession | None = None
        ended = False
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                try:
                    if kind == "hello":
                        if session is not None:
                            raise InvalidMessage("hello", "sent twice on one stream")
                        session, plan = self.core.open_session(wire.hello_from_pb(msg.hello))
                        yield pb.ServerMessage(plan=wire.plan_to_pb(plan))
                    elif kind is None:
                        raise InvalidMessage("kind", "empty message")
                    elif session is None:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"send hello before {kind}")
                    elif kind == "stats":
                        stats = wire.stats_from_pb(msg.stats)
                        new = self.core.on_stats(session, stats)
                        if new is not None:
                            yield pb.ServerMessage(plan=wire.plan_to_pb(new))
                        yield pb.ServerMessage(
                            ack=pb.StepAck(
                                step=stats.step,
                                plan_version=session.planner.plan.version,
                                oom_risk=session.planner.oom_risk,
                            )
                        )
                    elif kind == "oom":
                        new = self.core.on_oom(session, wire.oom_from_pb(msg.oom))
                        if new is not None:
                            yield pb.ServerMessage(plan=wire.plan_to_pb(new))
                    elif kind == "goodbye":
                        ended = True
                        return
                except (InvalidMessage, ValueError) as err:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        finally:
            if session is not None:
                self.core.close_session(session, ended=ended)
