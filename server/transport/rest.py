"""The HTTP adapter: REST reads and writes, the dashboard and /metrics over the core.

Domain errors map here, once: JobNotFound 404, InvalidMessage 422 (with the
field), Unauthenticated 401, SessionError 409, a write from another site 403;
every body is JSON.

Writes are authorized in one place, before their body is read
(``rematd.server.transport.http_guard.authorize_write``): refused to a browser page of
another origin whatever the token (a request a browser marks cross-site with
``Sec-Fetch-Site``, or whose ``Origin`` is not the service's own, is 403); with
no token configured, open only on a loopback service and only to a loopback
``Host`` (a page that rebinds its own name to 127.0.0.1 is refused). The API docs' script and style are served from
the package (swagger-ui-bundle), so ``/docs`` works without the internet.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import to_json
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]

from rematd import __version__
from rematd.messages import MAX_BLOCKS, MAX_INT, InvalidMessage
from rematd.planner import Mode
from rematd.server.core.advisor import JOB_STATES, AdvisorCore
from rematd.server.core.errors import JobNotFound, SessionError, StoreStalled, Unauthenticated
from rematd.server.core.paging import JOBS_PAGE, MAX_JOBS_PAGE, MAX_ROWS_PAGE, ROWS_PAGE
from rematd.server.core.views import STATS_ROWS, JobView
from rematd.server.runtime.allocator import give_back_soon
from rematd.server.store.rows import ControlsRow, ModeName
from rematd.server.transport.auth import TokenAuth
from rematd.server.transport.http_guard import MAX_BODY_BYTES, bounded, install
from rematd.server.transport.rest_models import (
    Health,
    Invalid,
    JobList,
    JobOoms,
    JobPlans,
    JobStats,
    NotReady,
    Problem,
    Ready,
)

DOCS_ASSETS = "/docs-assets"
RowsLimit = Annotated[int, Query(ge=1, le=MAX_ROWS_PAGE, description="rows a page holds")]
Cursor = Annotated[str | None, Query(max_length=1024, description="next_cursor of the page before")]


log = logging.getLogger("rematd.server")


def _json(view: object) -> Response:
    """A read view as JSON, as it is. The endpoint's response model documents it, and the tests hold every view
    to its model; validating each row here would cost more than ten times the encoding on a large read, in the
    process that serves the training ranks' streams."""
    return Response(to_json(view), media_type="application/json")


LISTS_AT_ONCE = 2
"""Reads of a list (jobs, plans, statistics, OOM events) made at once; the others wait their turn."""
LARGE_ANSWER_BYTES = 1 << 20
"""An answer this large gives its memory back to the system once sent."""


LIST_WAIT_SECONDS = 10.0
"""How long a read of a list waits for its turn before it is answered 503."""


class Lists:
    """Reads that return lists, bounded: each holds its rows and their JSON (a page of statistics is up to
    2 MiB of JSON, a page of plans up to 11 MiB, and several times that in rows) from when it is made until
    it is delivered, so a few at a time (the others wait their turn, then are told to try again), and what a
    large one held goes back to the system after it (four reads of 100,000 rows left 130 MiB resident)."""

    def __init__(self, at_once: int = LISTS_AT_ONCE) -> None:
        self._turns = threading.BoundedSemaphore(at_once)

    def answer(self, read: Callable[[], object]) -> Response:
        if not self._turns.acquire(timeout=LIST_WAIT_SECONDS):
            return JSONResponse(
                status_code=503,
                content={"detail": "other large reads are under way; try again shortly"},
                headers={"Retry-After": "5"},
            )
        try:
            body = to_json(read())
        except BaseException:
            self._turns.release()
            raise
        return _Delivered(body, on_done=self._delivered)

    def _delivered(self, size: int) -> None:
        self._turns.release()
        if size >= LARGE_ANSWER_BYTES:
            give_back_soon()


class _Delivered(Response):
    """A JSON answer that says when it has been delivered, or its client has gone (cut off, disconnected)."""

    def __init__(self, body: bytes, *, on_done: Callable[[int], None]) -> None:
        super().__init__(body, media_type="application/json")
        self._on_done: Callable[[int], None] | None = on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._done()

    def _done(self) -> None:
        done, self._on_done = self._on_done, None
        if done is not None:
            size, self.body = len(self.body), b""
            done(size)

    def __del__(self) -> None:
        self._done()  # never sent (its request was given up): its turn is not lost


MODE_COLOURS = {
    Mode.STORE: "#d9dee6",
    Mode.SELECTIVE: "#f2b84b",
    Mode.RECOMPUTE: "#2563eb",
    Mode.OFFLOAD: "#0f9d8a",
    Mode.COMPRESS: "#a855f7",
    Mode.TITAN: "#e07b39",
    Mode.ATTENTION: "#f7d774",
    Mode.MLP: "#c9a227",
}
"""Each mode's colour on the dashboard: the vocabulary's names and letters come from ``Mode``."""


def dashboard_page() -> str:
    """The dashboard, with the mode vocabulary (name, letter, colour) it draws plans in."""
    vocabulary = [{"name": m.label, "letter": m.letter, "colour": MODE_COLOURS[m]} for m in Mode]
    page = resources.files("rematd.server").joinpath("static/index.html").read_text(encoding="utf-8")
    return page.replace("/*MODES*/[]", json.dumps(vocabulary))


class PinBody(BaseModel):
    """A plan to pin: every k-th block or a set of blocks recomputing (the rest storing), or one mode per block."""

    # Strict: a boolean or a string is not a block count (JSON's true would read as 1, "4" as 4).
    model_config = ConfigDict(extra="forbid", strict=True)
    # Named as the controls keep them (``ControlsRow``, the ``job_controls`` table); the names of a plan's
    # fields that the body took before are still accepted.
    pin_every: int | None = Field(
        None,
        ge=0,
        le=MAX_BLOCKS,
        validation_alias=AliasChoices("pin_every", "checkpoint_every"),
        description="k for every k-th block; 0 for none (also accepted as checkpoint_every)",
    )
    pin_blocks: list[Annotated[int, Field(ge=0, le=MAX_BLOCKS)]] | None = Field(
        None,
        max_length=MAX_BLOCKS,
        validation_alias=AliasChoices("pin_blocks", "blocks"),
        description="block indices to recompute (also accepted as blocks)",
    )
    pin_modes: list[ModeName] | None = Field(
        None,
        max_length=MAX_BLOCKS,
        validation_alias=AliasChoices("pin_modes", "modes"),
        description="one mode per block, at every sequence length (also accepted as modes)",
    )

    @model_validator(mode="after")
    def _one(self) -> PinBody:
        if sum(x is not None for x in (self.pin_every, self.pin_blocks, self.pin_modes)) != 1:
            raise ValueError("give exactly one of pin_every, pin_blocks or pin_modes")
        return self


class TuneBody(BaseModel):
    """Overrides of a job's planning; null clears an override."""

    # Strict: ``"budget_bytes": true`` is not a budget of one byte, nor ``"1000"`` one of 1,000.
    model_config = ConfigDict(extra="forbid", strict=True)
    margin_ratio: float | None = Field(None, ge=0.0, lt=1.0, allow_inf_nan=False)
    budget_bytes: int | None = Field(None, gt=0, le=MAX_INT)

    @model_validator(mode="after")
    def _some(self) -> TuneBody:
        if not self.model_fields_set:
            raise ValueError("give margin_ratio and/or budget_bytes")
        return self


Responses = dict[int | str, dict[str, object]]


def _problem(description: str) -> dict[str, object]:
    return {"model": Problem, "description": description}


_EVERY: Responses = {
    400: _problem(
        "a request that reads two ways or not at all: a header that says who is asking given twice, a body framed "
        "by both Content-Length and Transfer-Encoding, a line ending in a bare LF, a folded header, a head over "
        "64 KiB, or one HTTP cannot parse"
    ),
    500: _problem("the service failed handling this request (its log says why)"),
}
"""What any request may be answered besides its route's own."""
_UNAUTHORIZED: Responses = {401: _problem("missing or wrong bearer token")}
_STORE_AWAY: Responses = {503: _problem("the store is out of reach, or other large reads are under way (Retry-After)")}
_NO_JOB: Responses = {404: _problem("no job of that name")}
_INVALID: Responses = {422: {"model": Invalid, "description": "a parameter or body the service cannot take"}}
_WRITES: Responses = {
    **_UNAUTHORIZED,
    **_STORE_AWAY,
    **_NO_JOB,
    **_INVALID,
    403: _problem("sent from another site, or without a token to a name that is not loopback's"),
    413: _problem(f"a body over {MAX_BODY_BYTES} bytes"),
}


def create_app(
    core: AdvisorCore, auth: TokenAuth | None = None, *, serving: Callable[[], bool] = lambda: True
) -> FastAPI:
    """The HTTP app; ``serving`` says whether the service takes new ranks (false while it drains and stops)."""
    auth = auth or TokenAuth()
    app = FastAPI(
        title="rematd",
        version=__version__,
        summary="Activation-checkpointing plans for training jobs",
        docs_url=None,
        redoc_url=None,
        responses=_EVERY,
    )
    install(app, auth=auth, on_unauthenticated=core.metrics.unauthenticated.labels("http").inc)
    _map_errors(app, core)
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")
    app.include_router(_pages())
    app.include_router(_service(core, auth, serving))

    def store_answers() -> None:
        core.store_answers()  # a read or a write would wait on a database that does not answer: 503 at once

    def reader(request: Request) -> None:
        auth.check_read(request.headers.get("authorization"))
        store_answers()

    app.include_router(
        _job_reads(core), dependencies=[Depends(reader)], responses={**_UNAUTHORIZED, **_STORE_AWAY, **_INVALID}
    )
    app.include_router(_job_controls(core), dependencies=[Depends(store_answers)], responses=_WRITES)
    return app


def _map_errors(app: FastAPI, core: AdvisorCore) -> None:
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


def _pages() -> APIRouter:
    """The dashboard and the API's docs, served from the package (no CDN on an air-gapped cluster)."""
    router = APIRouter(include_in_schema=False)
    page = dashboard_page()

    @router.get("/", response_class=HTMLResponse)
    async def dashboard() -> str:
        return page

    @router.get("/docs")
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="rematd API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )

    return router


def _service(core: AdvisorCore, auth: TokenAuth, serving: Callable[[], bool]) -> APIRouter:
    """Liveness, readiness and /metrics."""
    router = APIRouter()

    @router.get("/healthz", response_model=Health)
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @router.get(
        "/readyz",
        responses={
            200: {"model": Ready, "description": "ready"},
            503: {"model": NotReady, "description": "draining or shutting down, or the store cannot be written"},
        },
    )
    def readyz() -> JSONResponse:
        """Ready to take training ranks: serving (not draining) and the store takes writes. Liveness is /healthz.

        Not ready from the start of a shutdown, as gRPC health says NOT_SERVING then: load balancers
        and Kubernetes move new ranks to other replicas during ``--drain-seconds``.
        """
        if not serving():
            return JSONResponse(
                status_code=503, content={"detail": "draining: the service is shutting down and takes no new ranks"}
            )
        return _readiness(core)

    @router.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        # One render on a worker thread serves every scrape for --metrics-cache-seconds (metrics.scrape).
        if auth.closed_metrics:
            auth.check(request.headers.get("authorization"))
        body = await core.metrics.scrape.body()
        if "gzip" in request.headers.get("accept-encoding", ""):
            headers = {"content-encoding": "gzip", "vary": "accept-encoding"}
            return Response(body.gzipped, media_type=CONTENT_TYPE_LATEST, headers=headers)
        return Response(body.plain, media_type=CONTENT_TYPE_LATEST, headers={"vary": "accept-encoding"})

    return router


def _readiness(core: AdvisorCore) -> JSONResponse:
    unwritable = core.unwritable()
    if unwritable is None:
        return JSONResponse({"status": "ready"})
    failure, seconds = unwritable
    return JSONResponse(
        status_code=503,
        content={"detail": bounded(f"the store cannot be written: {failure}"), "failing_seconds": round(seconds, 1)},
    )


def _job_reads(core: AdvisorCore) -> APIRouter:
    """Jobs, and each job's plans, statistics and OOM events."""
    router = APIRouter(prefix="/api/v1/jobs")

    lists = Lists()

    @router.get("", response_model=JobList)
    def jobs(
        state: Annotated[str | None, Query(description=f"one of {', '.join(JOB_STATES)}")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_JOBS_PAGE)] = JOBS_PAGE,
        cursor: Cursor = None,
    ) -> Response:
        def read() -> dict[str, object]:
            page = core.jobs_page(state, limit=limit, cursor=cursor)
            return {"jobs": page.rows, "next_cursor": page.next_cursor}

        return lists.answer(read)

    @router.get("/{job}", response_model=JobView, responses=_NO_JOB)
    def job(job: str) -> Response:
        return _json(core.get_job(job))

    @router.get("/{job}/plans", response_model=JobPlans, responses=_NO_JOB)
    def plans(job: str, limit: RowsLimit = ROWS_PAGE, cursor: Cursor = None) -> Response:
        def read() -> dict[str, object]:
            page = core.plans_page(job, limit=limit, cursor=cursor)
            return {"job": job, "plans": page.rows, "next_cursor": page.next_cursor}

        return lists.answer(read)

    @router.get("/{job}/stats", response_model=JobStats, responses=_NO_JOB)
    def stats(
        job: str,
        limit: int = Query(STATS_ROWS, ge=1, le=MAX_ROWS_PAGE, description="the latest steps, at most"),
        since: float | None = Query(None, ge=0, le=1e11, allow_inf_nan=False, description="unix seconds"),
        until: float | None = Query(None, ge=0, le=1e11, allow_inf_nan=False, description="unix seconds"),
        rank: int | None = Query(None, ge=0, le=MAX_INT),
    ) -> Response:
        return lists.answer(
            lambda: {"job": job, "stats": core.job_stats(job, limit=limit, since=since, until=until, rank=rank)}
        )

    @router.get("/{job}/ooms", response_model=JobOoms, responses=_NO_JOB)
    def ooms(job: str, limit: RowsLimit = ROWS_PAGE, cursor: Cursor = None) -> Response:
        def read() -> dict[str, object]:
            page = core.ooms_page(job, limit=limit, cursor=cursor)
            return {"job": job, "ooms": page.rows, "next_cursor": page.next_cursor}

        return lists.answer(read)

    return router


def _job_controls(core: AdvisorCore) -> APIRouter:
    """An operator's writes: pins, overrides, ending a job."""
    router = APIRouter(prefix="/api/v1/jobs")

    @router.post("/{job}/pin", response_model=ControlsRow)
    def pin(job: str, body: PinBody) -> Response:
        """Pin the job's plan: its ranks are sent this plan from their next step until it is unpinned."""
        return _json(core.pin(job, pin_every=body.pin_every, pin_blocks=body.pin_blocks, pin_modes=body.pin_modes))

    @router.delete("/{job}/pin", response_model=ControlsRow)
    def unpin(job: str) -> Response:
        return _json(core.unpin(job))

    @router.patch("/{job}", response_model=ControlsRow)
    def tune(job: str, body: TuneBody) -> Response:
        """Override the job's margin or budget; the next plan honours it."""
        return _json(core.tune(job, {k: getattr(body, k) for k in body.model_fields_set}))

    @router.post("/{job}/end", response_model=JobView)
    def end(job: str) -> Response:
        """Mark the job ended (its metrics go; a live rank's stream is closed at its next message)."""
        return _json(core.end_job(job))

    return router
