"""The HTTP side's pages and operations: the dashboard, the API's docs, liveness, readiness and /metrics."""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from rematd import __version__
from rematd.planner import Mode
from rematd.server.core.advisor import AdvisorCore
from rematd.server.transport.auth import TokenAuth
from rematd.server.transport.http_guard import bounded
from rematd.server.transport.rest_models import Health, NotReady, Ready

DOCS_ASSETS = "/docs-assets"


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


def page_routes() -> APIRouter:
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


def health_routes(core: AdvisorCore, auth: TokenAuth, serving: Callable[[], bool]) -> APIRouter:
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
