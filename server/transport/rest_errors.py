"""The domain's errors as HTTP statuses, once for every route, and the store's outages as REST sees them.

JobNotFound is 404, InvalidMessage 422 (with the field), Unauthenticated 401, SessionError 409, a store out of
reach (or one that does not answer) 503; a 405 lists every method the API serves at the path. An outage is said
once when it starts and once when it ends, however many requests fail meanwhile.
"""

from __future__ import annotations

import logging
import re
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rematd.planner.messages import InvalidMessage
from rematd.server.core.advisor import AdvisorCore
from rematd.server.core.errors import JobNotFound, SessionError, StoreStalled, Unauthenticated
from rematd.server.transport.http_guard import bounded

log = logging.getLogger("rematd.server")


def map_errors(app: FastAPI, core: AdvisorCore) -> None:
    """The domain's errors as HTTP statuses, once for every route."""

    @app.exception_handler(JobNotFound)
    async def _not_found(request: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": bounded(str(exc)), "job": bounded(exc.job)})

    @app.exception_handler(InvalidMessage)
    async def _invalid(request: Request, exc: InvalidMessage) -> JSONResponse:
        # The shape of a parameter the route's own validation refused, and the field named apart.
        error = {"loc": [exc.field], "msg": bounded(str(exc)), "type": "value_error"}
        return JSONResponse(status_code=422, content={"detail": [error], "field": exc.field})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code != 405:
            return await http_exception_handler(request, exc)
        # Starlette answers with the methods of the first route whose path matched; a path served by several
        # routes (POST and DELETE of a pin) takes all of theirs, as the API's schema lists them.
        said = (exc.headers or {}).get("Allow", "")
        allowed = {m.strip() for m in said.split(",") if m.strip()} | methods.of(request.url.path)
        return JSONResponse(
            status_code=405, content={"detail": exc.detail}, headers={"Allow": ", ".join(sorted(allowed))}
        )

    @app.exception_handler(Unauthenticated)
    async def _unauthenticated(request: Request, exc: Unauthenticated) -> JSONResponse:
        core.metrics.unauthenticated.labels("http").inc()
        return JSONResponse(status_code=401, content={"detail": str(exc)}, headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(SessionError)
    async def _conflict(request: Request, exc: SessionError) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": str(exc)})

    outage = _Outage()
    methods = _Methods(app)

    @app.exception_handler(StoreStalled)
    @app.exception_handler(SQLAlchemyError)
    async def _store_away(request: Request, exc: Exception) -> JSONResponse:
        outage.failed(exc)
        said = str(exc) if isinstance(exc, StoreStalled) else "the store is out of reach"
        return JSONResponse(
            status_code=503,
            content={"detail": bounded(f"{said}: try again once it is back")},
            headers={"Retry-After": "5"},
        )

    app.add_middleware(_OutageWatch, outage=outage)


class _Methods:
    """The methods the API's schema serves at a path (read from the schema once, at the first 405)."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app
        self._paths: list[tuple[re.Pattern[str], set[str]]] | None = None

    def of(self, path: str) -> set[str]:
        if self._paths is None:
            self._paths = []
            for template, operations in self._app.openapi().get("paths", {}).items():
                pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
                served = {m.upper() for m in operations}
                self._paths.append((re.compile(f"{pattern}$"), served))
        return {m for pattern, served in self._paths if pattern.match(path) for m in served}


class _OutageWatch:
    """ASGI middleware: during an outage, the first response under 500 ends it. Outside one, nothing."""

    def __init__(self, app: ASGIApp, *, outage: _Outage) -> None:
        self.app = app
        self.outage = outage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.outage.since is None:
            await self.app(scope, receive, send)
            return

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] < 500:
                self.outage.back()
            await send(message)

        await self.app(scope, receive, watched)


class _Outage:
    """The store out of reach for REST reads: said once when it goes and once when it is back, however many
    reads fail meanwhile (each answered 503)."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.failures = 0
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            if self.since is not None:
                return
            self.since = time.monotonic()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("rematd: REST reads cannot reach the store (%s); they answer 503 until it is back", first[:200])

    def back(self) -> None:
        with self._lock:
            since, failures, self.since, self.failures = self.since, self.failures, None, 0
        if since is not None:
            log.warning(
                "rematd: REST reads reach the store again after %.0f s (%d answered 503 meanwhile)",
                time.monotonic() - since,
                failures,
            )
