"""What the HTTP side checks before it does any work: who is writing, and how large the body is.

FastAPI reads and parses a request's body before it runs the route's dependencies; a write with
no token would otherwise cost whatever body it sent. This ASGI layer is the one place writes are
authorized, before a byte of the body is read, in this order: a write a browser sent from another
site is 403; with no token configured, a service beyond loopback takes no writes (401) and one on
loopback takes them only for a loopback ``Host`` (403); else the bearer token decides (401). A
body over the cap (announced or counted as it arrives) is 413. Every answer is JSON with a ``detail``.

Validation errors are answered here too, without echoing the input: a value JSON cannot
carry (NaN, Infinity) or an unbounded string must not decide what the error looks like.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable, Mapping
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rematd.server.core.errors import Unauthenticated
from rematd.server.transport.auth import TokenAuth

MAX_BODY_BYTES = 64 * 1024
"""Largest request body: an explicit pin of every block of the largest model is well under it."""
MAX_DETAIL_CHARS = 300
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


def bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying so: errors never carry unbounded input back."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class CrossSiteWrite(PermissionError):
    """A write sent by a browser page of another origin, or an open write to a name that is not loopback's."""


def _loopback_host(host: str) -> bool:
    """Whether a Host header names loopback: localhost, 127.x.x.x or [::1], with or without a port."""
    name = host[1:].split("]", 1)[0] if host.startswith("[") else host.split(":", 1)[0]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def authorize_write(headers: Mapping[str, str], auth: TokenAuth) -> None:
    """Raise CrossSiteWrite (403) or Unauthenticated (401) unless a write with these (lower-cased) headers may go on.

    The same answer for the same request whatever else it carries: the same-site check, then the
    rule for a service with no token, then the token.
    """
    fetch_site = headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        raise CrossSiteWrite(f"writes from another site are refused (Sec-Fetch-Site: {fetch_site})")
    host = headers.get("host", "")
    origin = headers.get("origin")
    if origin is not None and (origin == "null" or urlsplit(origin).netloc.lower() != host.lower()):
        raise CrossSiteWrite(f"writes from another origin are refused (Origin: {origin})")
    if auth.token is None and auth.open_writes and not _loopback_host(host):
        # A page whose own name resolves to 127.0.0.1 (DNS rebinding) sends its name as Host.
        raise CrossSiteWrite(f"writes without a token go to a loopback name only, not Host: {host}")
    auth.check_write(headers.get("authorization"))


_SINGLE = frozenset({b"host", b"origin", b"content-length", b"transfer-encoding", b"authorization", b"sec-fetch-site"})


def ambiguous_headers(raw: Iterable[tuple[bytes, bytes]]) -> str:
    """Why a request's headers can be read two ways, or "": a proxy in front may pick the other reading (a body
    framed by both Content-Length and Transfer-Encoding, or two of a header that decides who is asking)."""
    names = [bytes(k).lower() for k, _ in raw]
    if b"content-length" in names and b"transfer-encoding" in names:
        return "a request may frame its body by Content-Length or by Transfer-Encoding, not both"
    for name in _SINGLE:
        if names.count(name) > 1:
            return f"the {name.decode()} header is given more than once"
    return ""


async def _json(send: Send, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    response = JSONResponse(status_code=status, content={"detail": detail}, headers=headers)
    await response({"type": "http"}, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


class BodyGuard:
    """ASGI middleware: writes authorized before their body is read (``authorize_write``), and every body capped."""

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
        refusal = self._refusal(scope)
        if refusal is not None:
            await _json(send, *refusal)
            return
        await self.app(scope, *self._bounded(receive, send))

    def _refusal(self, scope: Scope) -> tuple[int, str, dict[str, str]] | None:
        """Why a request is answered before its route sees it (status, detail, headers); None to go on."""
        problem = ambiguous_headers(scope.get("headers", ()))
        if problem:
            return 400, problem, {"Connection": "close"}
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if scope["method"] not in _READS:
            try:
                authorize_write(headers, self.auth)
            except CrossSiteWrite as err:
                self.on_unauthenticated()
                return 403, str(err), {"Connection": "close"}
            except Unauthenticated as err:
                self.on_unauthenticated()
                return 401, str(err), {"WWW-Authenticate": "Bearer", "Connection": "close"}
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return 413, f"the body must be at most {self.max_body_bytes} bytes", {"Connection": "close"}
        return None

    def _bounded(self, receive: Receive, send: Send) -> tuple[Receive, Send]:
        """``receive`` and ``send`` for the route, cut off once the body grows past ``max_body_bytes``."""
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

        async def watched(message: Message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        return counted, watched


def _error(e: Mapping[str, object]) -> dict[str, object]:
    loc = e.get("loc", ())
    return {
        "loc": [bounded(str(p), 64) for p in (loc if isinstance(loc, (list, tuple)) else ())][:8],
        "msg": bounded(str(e.get("msg", ""))),
        "type": str(e.get("type", ""))[:64],
    }


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 naming each field and what was wrong with it, never the value sent."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return JSONResponse(status_code=422, content={"detail": [_error(e) for e in errors[:16]]})


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=500, content={"detail": "the service failed handling this request; see its log"})


def install(app: FastAPI, *, auth: TokenAuth, on_unauthenticated: Callable[[], None]) -> None:
    """Add the guards to a FastAPI app."""
    handler: Callable[[Request, Exception], Awaitable[JSONResponse]] = validation_error
    app.add_exception_handler(RequestValidationError, handler)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(BodyGuard, auth=auth, on_unauthenticated=on_unauthenticated)
