"""The REST API's writes, an operator's: pinning a job's plan, overriding its margin or budget, ending it.

Each is authorized before its body is read (``http_guard.authorize_write``); the bodies are strict.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from rematd.planner.messages import MAX_BLOCKS, MAX_INT
from rematd.server.core.advisor import AdvisorCore
from rematd.server.core.views import JobView
from rematd.server.store.rows import ControlsRow, ModeName
from rematd.server.transport.rest_responses import as_json


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


def job_write_routes(core: AdvisorCore) -> APIRouter:
    """An operator's writes: pins, overrides, ending a job."""
    router = APIRouter(prefix="/api/v1/jobs")

    @router.post("/{job}/pin", response_model=ControlsRow)
    def pin(job: str, body: PinBody) -> Response:
        """Pin the job's plan: its ranks are sent this plan from their next step until it is unpinned."""
        return as_json(core.pin(job, pin_every=body.pin_every, pin_blocks=body.pin_blocks, pin_modes=body.pin_modes))

    @router.delete("/{job}/pin", response_model=ControlsRow)
    def unpin(job: str) -> Response:
        return as_json(core.unpin(job))

    @router.patch("/{job}", response_model=ControlsRow)
    def tune(job: str, body: TuneBody) -> Response:
        """Override the job's margin or budget; the next plan honours it."""
        return as_json(core.tune(job, {k: getattr(body, k) for k in body.model_fields_set}))

    @router.post("/{job}/end", response_model=JobView)
    def end(job: str) -> Response:
        """Mark the job ended (its metrics go; a live rank's stream is closed at its next message)."""
        return as_json(core.end_job(job))

    return router
