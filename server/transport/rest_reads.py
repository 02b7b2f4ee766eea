"""The REST API's reads of jobs, and of each job's plans, statistics and OOM events.

A read of a list holds its rows and their JSON until they are delivered, so a few are made at a time
(``Lists``); the others wait their turn, then are told to try again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from pydantic_core import to_json
from starlette.types import Receive, Scope, Send

from rematd.planner.messages import MAX_INT
from rematd.server.core.advisor import JOB_STATES, AdvisorCore
from rematd.server.core.paging import JOBS_PAGE, MAX_JOBS_PAGE, MAX_ROWS_PAGE, ROWS_PAGE
from rematd.server.core.views import STATS_ROWS, JobView
from rematd.server.runtime.allocator import give_back_soon
from rematd.server.transport.rest_models import JobList, JobOoms, JobPlans, JobStats
from rematd.server.transport.rest_responses import NO_JOB, as_json

RowsLimit = Annotated[int, Query(ge=1, le=MAX_ROWS_PAGE, description="rows a page holds")]
Cursor = Annotated[str | None, Query(max_length=1024, description="next_cursor of the page before")]


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


def job_read_routes(core: AdvisorCore) -> APIRouter:
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

    @router.get("/{job}", response_model=JobView, responses=NO_JOB)
    def job(job: str) -> Response:
        return as_json(core.get_job(job))

    @router.get("/{job}/plans", response_model=JobPlans, responses=NO_JOB)
    def plans(job: str, limit: RowsLimit = ROWS_PAGE, cursor: Cursor = None) -> Response:
        def read() -> dict[str, object]:
            page = core.plans_page(job, limit=limit, cursor=cursor)
            return {"job": job, "plans": page.rows, "next_cursor": page.next_cursor}

        return lists.answer(read)

    @router.get("/{job}/stats", response_model=JobStats, responses=NO_JOB)
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

    @router.get("/{job}/ooms", response_model=JobOoms, responses=NO_JOB)
    def ooms(job: str, limit: RowsLimit = ROWS_PAGE, cursor: Cursor = None) -> Response:
        def read() -> dict[str, object]:
            page = core.ooms_page(job, limit=limit, cursor=cursor)
            return {"job": job, "ooms": page.rows, "next_cursor": page.next_cursor}

        return lists.answer(read)

    return router
