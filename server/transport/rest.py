"""The HTTP adapter: REST reads and writes, the dashboard and /metrics over the core, assembled.

The routes: jobs and their rows (``rest_reads``), an operator's writes (``rest_writes``), the
dashboard, the API's docs, health and /metrics (``rest_ops``). Domain errors map once, for every
route (``rest_errors``): JobNotFound 404, InvalidMessage 422 (with the field), Unauthenticated 401,
SessionError 409, a write from another site 403; every body is JSON.

Writes are authorized in one place, before their body is read
(``rematd.server.transport.http_guard.authorize_write``): refused to a browser page of
another origin whatever the token (a request a browser marks cross-site with
``Sec-Fetch-Site``, or whose ``Origin`` is not the service's own, is 403); with
no token configured, open only on a loopback service and only to a loopback
``Host`` (a page that rebinds its own name to 127.0.0.1 is refused). The API docs' script and style are served from
the package (swagger-ui-bundle), so ``/docs`` works without the internet.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]

from rematd import __version__
from rematd.server.core.advisor import AdvisorCore
from rematd.server.transport.auth import TokenAuth
from rematd.server.transport.http_guard import install
from rematd.server.transport.rest_errors import map_errors
from rematd.server.transport.rest_ops import DOCS_ASSETS, health_routes, page_routes
from rematd.server.transport.rest_reads import job_read_routes
from rematd.server.transport.rest_responses import EVERY, INVALID, STORE_AWAY, UNAUTHORIZED, WRITES
from rematd.server.transport.rest_writes import job_write_routes


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
        responses=EVERY,
    )
    install(app, auth=auth, on_unauthenticated=core.metrics.unauthenticated.labels("http").inc)
    map_errors(app, core)
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")
    app.include_router(page_routes())
    app.include_router(health_routes(core, auth, serving))

    def store_answers() -> None:
        core.store_answers()  # a read or a write would wait on a database that does not answer: 503 at once

    def reader(request: Request) -> None:
        auth.check_read(request.headers.get("authorization"))
        store_answers()

    app.include_router(
        job_read_routes(core), dependencies=[Depends(reader)], responses={**UNAUTHORIZED, **STORE_AWAY, **INVALID}
    )
    app.include_router(job_write_routes(core), dependencies=[Depends(store_answers)], responses=WRITES)
    return app
