"""The HTTP adapter: REST reads, the dashboard and /metrics over the core."""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rematd import __version__
from rematd.server.core import AdvisorCore, JobNotFound


def _dashboard() -> str:
    return resources.files("rematd.server").joinpath("static/index.html").read_text(encoding="utf-8")


def create_app(core: AdvisorCore) -> FastAPI:
    app = FastAPI(title="rematd", version=__version__, summary="Activation-checkpointing plans for training jobs")
    page = _dashboard()

    @app.exception_handler(JobNotFound)
    async def _not_found(request: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": str(exc), "job": exc.job})

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> str:
        return page

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/v1/jobs")
    def jobs() -> dict[str, Any]:
        return {"jobs": core.list_jobs()}

    @app.get("/api/v1/jobs/{job}")
    def job(job: str) -> dict[str, Any]:
        return core.get_job(job)

    @app.get("/api/v1/jobs/{job}/plans")
    def plans(job: str) -> dict[str, Any]:
        return {"job": job, "plans": core.job_plans(job)}

    @app.get("/api/v1/jobs/{job}/stats")
    def stats(job: str, limit: int = Query(2000, ge=1, le=100_000)) -> dict[str, Any]:
        return {"job": job, "stats": core.job_stats(job, limit=limit)}

    @app.get("/api/v1/jobs/{job}/ooms")
    def ooms(job: str) -> dict[str, Any]:
        return {"job": job, "ooms": core.job_ooms(job)}

    return app
