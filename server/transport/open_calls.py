"""The long calls anyone may open without the token: the health service's ``Watch`` and server reflection.

Probes and tools need them open (``grpc_health_probe``, Kubernetes, ``grpcurl``), so they cannot ask for
the token; but each one holds a call, its memory and its connection for as long as the caller likes.
100 connections each holding a ``Watch`` stayed open past ``--idle-connection-seconds`` (a connection
with a call open is not idle), 200 of them under a 300-descriptor limit kept a trainer with the token
out, and 15,000 on one connection took 280 MiB. Here they are bounded in number (the newest over the
bound is refused ``RESOURCE_EXHAUSTED``) and in time (each ends, ``OK``, after the idle limit: a
watcher watches again, and a connection left with no call is closed as any idle one is).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

log = logging.getLogger("rematd.server")

MAX_OPEN_CALLS = 64
"""Calls of these methods open at once, at most (fewer when the descriptor limit is low)."""
OPEN_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)


def open_call_limit(grpc_connections: int) -> int:
    """How many such calls are held at once: a quarter of the gRPC connections at most, so that they never
    take the descriptors the training ranks need."""
    return max(1, min(MAX_OPEN_CALLS, grpc_connections // 4))


if TYPE_CHECKING:
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:  # generic in the stubs only
    _Interceptor = grpc.aio.ServerInterceptor


class OpenCalls(_Interceptor):
    """Bounds the calls of ``OPEN_METHODS``: at most ``most`` at once, each ended after ``seconds``."""

    def __init__(self, *, most: int, seconds: float) -> None:
        self.most = most
        self.seconds = seconds
        self.open = 0
        self.refused = 0
        """Calls refused over the bound (since start)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        if handler is None or details.method not in OPEN_METHODS:
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._bounded(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._bounded(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _bounded(self, behaviour: Callable[..., Any]) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]:
        generator = inspect.isasyncgenfunction(behaviour)

        async def bounded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            if self.open >= self.most:
                self.refused += 1
                log.warning("a call anyone may open was refused: %d are open, the most this service holds", self.open)
                # Not context.abort: its exception would hold the call until the collector runs.
                context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                context.set_details(f"{self.open} such calls are open, the most this service holds; try again later")
                return
            self.open += 1
            try:
                async with asyncio.timeout(self.seconds):
                    if generator:
                        async for reply in behaviour(request, context):
                            await context.write(reply)
                    else:
                        await behaviour(request, context)
            except TimeoutError:
                context.set_details(f"ended after {self.seconds:.0f} s (--idle-connection-seconds); call again")
            finally:
                self.open -= 1

        return bounded
