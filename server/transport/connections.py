"""What an HTTP connection may hold: a file descriptor for a bounded time, among a bounded number, with a
request framed one way only.

uvicorn closes a keep-alive connection some seconds after its last response, but not one that never
sends a request, nor one that sends its headers a byte at a time: 1,100 such connections used every
file descriptor of the process, and then gRPC streams, ``/healthz`` and the store stopped with it.
Here a connection gets ``http_request_seconds`` to send a whole request, the service holds at most
``max_http_connections`` of them (more are answered 503 and closed at once), and that cap stays
below the process's descriptor limit so that gRPC and the database keep theirs.

A request head is also read as it arrived, before h11 (which is lenient) parses it: bare LF line
ends and obsolete line folding are refused with 400, since a proxy in front may frame the same
bytes differently (request smuggling).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from rematd.server.config import HttpOptions

log = logging.getLogger("rematd.server")

FD_RESERVE = 64
"""Descriptors kept for the store, logs, and what the process opens besides connections."""
MAX_HEAD_BYTES = 64 * 1024
"""Longest request head (line and headers) read."""


@dataclass(frozen=True, slots=True)
class Budget:
    """How the process's file descriptors are shared between the transports."""

    fd_limit: int
    http: int
    """HTTP connections held at once."""
    grpc: int
    """gRPC connections accepted at once."""

    def describe(self) -> str:
        return (
            f"connections: at most {self.http} HTTP and {self.grpc} gRPC at once "
            f"(file descriptor limit {self.fd_limit}, {FD_RESERVE} kept for the store)"
        )


def fd_budget(options: HttpOptions) -> Budget:
    """Raise the soft descriptor limit to the hard one, and share it: HTTP gets at most a quarter."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # a container may refuse it: the limit as it is still bounds both transports
    usable = max(soft - FD_RESERVE, 32)
    http = max(1, min(options.max_http_connections, usable // 4))
    return Budget(fd_limit=soft, http=http, grpc=max(1, usable - http))


def framing_problem(head: bytes) -> str:
    """Why a request head (as far as it arrived) is refused, or ""."""
    at = head.find(b"\n")
    hosts = 0
    while at >= 0:
        if at == 0 or head[at - 1] != 0x0D:
            return "a line of the request ends with a bare LF; use CRLF"
        if head[at + 1 : at + 2] in (b" ", b"\t") and head[:at].strip(b"\r\n"):
            return "a header is folded over lines (obsolete line folding)"
        if head[at + 1 : at + 6].lower() == b"host:":
            hosts += 1
            if hosts > 1:
                # h11 refuses it too, in plain text: said here as every other refusal is, naming the header.
                return "the host header is given more than once"
        at = head.find(b"\n", at + 1)
    return ""


def _refusal(status: int, reason: str, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request, a cap on connections and strict framing."""

    cap: ClassVar[int] = 512
    request_seconds: ClassVar[float] = 10.0
    response_seconds: ClassVar[float] = 30.0
    refused: ClassVar[int] = 0
    """Connections refused over the cap (since start): every one held was sending or awaiting a request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._respond_by: asyncio.TimerHandle | None = None
        self._head = bytearray()
        self._over_cap = False
        self.opened_at = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.cap and not self._evict_one():
            # Answered and closed at once: the descriptor is back before the next accept.
            self._over_cap = True
            self.transport = transport
            type(self).refused += 1
            log.warning("HTTP connection refused: %d are open, the most this service holds", len(self.connections))
            transport.write(_refusal(503, "Service Unavailable", "too many connections; try again later"))
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets it only on sockets made with IPPROTO_TCP, not on those of a listener made with proto 0:
            # without it a keep-alive response's body waited for the client's delayed ACK (40 ms a request).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        self.opened_at = self.loop.time()
        self._arm()

    def _evict_one(self) -> bool:
        """Close the oldest connection that is not sending or awaiting a request (idle, or headers still
        arriving), so that a full house of idle connections never keeps a real request out."""
        idle = [c for c in self.connections if isinstance(c, GuardedH11) and c.waiting()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.opened_at)
        oldest.transport.abort()  # the descriptor is free now, not after a close handshake
        self.connections.discard(oldest)
        return True

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse: refused in JSON, as every other answer is."""
        self._disarm()
        self.transport.write(_refusal(400, "Bad Request", msg))
        self.transport.close()

    def waiting(self) -> bool:
        """Neither sending a request nor awaiting its response."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.request_seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            # No whole request in time: idle since it opened, or headers (or a body) trickling in.
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._over_cap:
            return
        if self.conn.their_state is h11.IDLE:
            self._arm()
            self._head += data[: MAX_HEAD_BYTES + 1 - len(self._head)]
            end = self._head.find(b"\r\n\r\n")
            problem = framing_problem(bytes(self._head if end < 0 else self._head[: end + 2]))
            if not problem and end < 0 and len(self._head) > MAX_HEAD_BYTES:
                problem = f"the request head is longer than {MAX_HEAD_BYTES} bytes"
            if problem:
                self._disarm()
                self.transport.write(_refusal(400, "Bad Request", problem))
                self.transport.close()
                return
            if end >= 0:
                self._head.clear()
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()

    # A response the client does not take: the write buffer fills (``pause_writing``), or a connection being
    # closed still holds unsent bytes. Either way the client gets ``response_seconds`` to take them.

    def pause_writing(self) -> None:
        super().pause_writing()
        self._unsent_deadline()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._respond_by is not None:
            self._respond_by.cancel()
            self._respond_by = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.get_write_buffer_size():
            self._unsent_deadline()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        if self.transport.get_write_buffer_size():
            self._unsent_deadline()

    def _unsent_deadline(self) -> None:
        if self._respond_by is None:
            self._respond_by = self.loop.call_later(self.response_seconds, self._not_taken)

    def _not_taken(self) -> None:
        """Cut off a response the client has not taken in time: one that stopped reading (a zero TCP window)
        would hold its descriptor and the buffered body for ever, a closing connection's included."""
        self._respond_by = None
        unsent = self.transport.get_write_buffer_size()
        if unsent:
            log.warning("HTTP response cut off: the client took nothing for %.0f s (%d bytes unsent)",
                        self.response_seconds, unsent)  # fmt: skip
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._respond_by is not None:
            self._respond_by.cancel()
            self._respond_by = None
        if self._over_cap:
            return
        super().connection_lost(exc)


def guarded_protocol(cap: int, request_seconds: float, response_seconds: float = 30.0) -> type[GuardedH11]:
    """The protocol class uvicorn builds each connection with, for this service's limits."""
    limits = {"cap": cap, "request_seconds": request_seconds, "response_seconds": response_seconds}
    return type("GuardedH11", (GuardedH11,), {**limits, "refused": 0})
