"""What the HTTP side checks before it does any work: who is writing, and how large the body is.

FastAPI reads and parses a request's body before it runs the route's dependencies, the token
check among them; a write with no token would otherwise cost whatever body it sent. This ASGI
layer answers first: 401 for a write without the right token, 413 for a body over the cap
(announced or counted as it arrives), both as JSON with a ``detail``, before a byte is parsed.

Validation errors are answered here too, without echoing the input: a value JSON cannot
carry (NaN, Infinity) or an unbounded string must not decide what the error looks like.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rematd.server.auth import TokenAuth
from rematd.server.errors import Unauthenticated

MAX_BODY_BYTES = 64 * 1024
"""Largest request body: an explicit pin of every block of the largest model is well under it."""
MAX_DETAIL_CHARS = 300
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


def bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying so: errors never carry unbounded input back."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


async def _json(send: Send, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    response = JSONResponse(status_code=status, content={"detail": detail}, headers=headers)
    await response({"type": "http"}, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


class BodyGuard:
    """ASGI middleware: writes authenticated before their body is read, and every body capped."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        auth: TokenAuth,
        on_unauthenticated: Callable[[], None],
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.app = app
        self.auth = auth
        self.on_unauthenticated = on_unauthenticated
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if scope["method"] not in _READS:
            try:
                self.auth.check(headers.get("authorization"))
            except Unauthenticated as err:
                self.on_unauthenticated()
                await _json(send, 401, str(err), {"WWW-Authenticate": "Bearer", "Connection": "close"})
                return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await _json(send, 413, f"the body must be at most {self.max_body_bytes} bytes", {"Connection": "close"})
            return
        seen = 0
        refused = started = False

        async def counted() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes and not refused:
                    # Answered here, and the route told the client went: a raise would be turned into a
                    # 400 by the body parser.
                    refused = True
                    if not started:
                        await _json(
                            send, 413, f"the body must be at most {self.max_body_bytes} bytes", {"Connection": "close"}
                        )
                    return {"type": "http.disconnect"}
            return message

        async def watched(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counted, watched)


def _error(e: Any) -> dict[str, Any]:
    return {
        "loc": [bounded(str(p), 64) for p in e.get("loc", ())][:8],
        "msg": bounded(str(e.get("msg", ""))),
        "type": str(e.get("type", ""))[:64],
    }


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 naming each field and what was wrong with it, never the value sent."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return JSONResponse(status_code=422, content={"detail": [_error(e) for e in errors[:16]]})


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=500, content={"detail": "the service failed handling this request; see its log"})


def install(app: Any, *, auth: TokenAuth, on_unauthenticated: Callable[[], None]) -> None:
    """Add the guards to a FastAPI app."""
    handler: Callable[[Request, Exception], Awaitable[JSONResponse]] = validation_error
    app.add_exception_handler(RequestValidationError, handler)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(BodyGuard, auth=auth, on_unauthenticated=on_unauthenticated)
