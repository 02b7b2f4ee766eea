"""What the REST API returns: ``/openapi.json`` documents each endpoint's response from these.

The rows and views themselves are defined once, where they are made (``rematd.server.store.rows``,
``rematd.server.core.views``); this module adds only the envelopes the endpoints wrap them in. The
endpoints send the views as they are; the tests hold each view to its model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rematd.server.core.views import JobView
from rematd.server.store.rows import StoredOomRow, StoredPlanRow, StoredStepRow


class _Closed(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Health(_Closed):
    status: Literal["ok"]
    version: str


class Ready(_Closed):
    status: Literal["ready"]


class Problem(_Closed):
    """Why a request was refused: what was wrong, in words (and the job it named, where there is none)."""

    detail: str
    job: str | None = Field(None, description="the job the path names, where it does not exist")


class FieldError(_Closed):
    loc: list[str | int]
    msg: str
    type: str


class Invalid(_Closed):
    """A request whose parameters or body the service cannot take: each field and what was wrong with it."""

    detail: list[FieldError]
    field: str | None = Field(None, description="the field, where the service's own checks refused it")


class NotReady(_Closed):
    detail: str
    failing_seconds: float | None = Field(None, description="how long the store has refused writes")


_NEXT = "pass as cursor for the next page; null on the last"


class JobList(_Closed):
    jobs: list[JobView]
    next_cursor: str | None = Field(None, description=_NEXT)


class JobPlans(_Closed):
    job: str
    plans: list[StoredPlanRow]
    next_cursor: str | None = Field(None, description=_NEXT)


class JobStats(_Closed):
    job: str
    stats: list[StoredStepRow]


class JobOoms(_Closed):
    job: str
    ooms: list[StoredOomRow]
    next_cursor: str | None = Field(None, description=_NEXT)
