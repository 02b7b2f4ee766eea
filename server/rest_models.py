"""What the REST API returns, as models: ``/openapi.json`` documents each endpoint's response from these.

They mirror the core's read views key for key: a view validated against its model and dumped with
``exclude_unset=True`` comes back unchanged (the tests hold each view to this). Rows of the record's growing
tables (step statistics, which a migration may widen) keep keys not named here (``extra="allow"``). The
endpoints send the views as they are; these models document them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ModeName = Literal["store", "selective", "recompute", "offload"]
JobState = Literal["running", "disconnected", "ended"]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Open(BaseModel):
    """A row of a table the record may widen: keys beyond those named pass through."""

    model_config = ConfigDict(extra="allow")


class Health(_Closed):
    status: Literal["ok"]
    version: str


class Ready(_Closed):
    status: Literal["ready"]


class NotReady(_Closed):
    detail: str
    failing_seconds: float | None = Field(None, description="how long the record has refused writes")


class ShapePlanEntry(_Closed):
    """One row of a plan's per-length table: what steps up to this length and token count run."""

    max_seq_len: int
    max_tokens: int
    modes: list[ModeName]
    predicted_peak_bytes: int
    predicted_overhead_ratio: float


class PlanRecord(_Closed):
    """A plan as the record keeps it."""

    rank: int = Field(description="the rank it was made for")
    version: int
    checkpoint_every: int
    blocks: list[int] = Field(description="blocks recomputing")
    modes: list[ModeName] = Field(description="one mode per block")
    shape_plans: list[ShapePlanEntry] = Field(description="per sequence length, shortest first")
    predicted_peak_bytes: int
    predicted_overhead_ratio: float
    target_bytes: int
    reason: str
    created_at: float


class _StepStats(_Open):
    step: int
    time: float = Field(description="unix seconds")
    peak_bytes: int
    budget_bytes: int
    predicted_peak_bytes: int
    plan_version: int
    seq_len: int
    batch: int
    step_seconds: float


class StepStatsRow(_StepStats):
    """One step's statistics from one rank, as the record keeps them."""

    rank: int


class LastStats(_StepStats):
    """A rank's last statistics (older records lack the keys with defaults; they are then left out)."""

    oom_risk: float | None = None
    recompiles_total: int | None = Field(None, description="the rank's compiles so far")


class OomEvent(_Closed):
    rank: int
    step: int
    time: float
    seq_len: int
    batch: int
    plan_version: int
    message: str


class Controls(_Closed):
    """An operator's overrides of one job's planning."""

    job: str
    pin_blocks: list[int] | None
    pin_modes: list[ModeName] | None
    pin_every: int | None
    margin_ratio: float | None
    budget_bytes: int | None
    ended_at: float | None


class ModePrice(_Closed):
    """How sure the planner is of what one mode costs on this rank."""

    mode: ModeName
    state: Literal["measured", "trial", "estimate"] = Field(
        description="measured: timed often enough; trial: being measured now; estimate: untried, priced "
        "at no less than recomputing"
    )
    timed_blocks: int = Field(description="blocks of this mode timed so far")
    scale: float | None = Field(description="measured over profiled seconds, once measured")


class RankView(_Closed):
    rank: int
    connected: bool
    state: str = Field(description="connected, disconnected or ended")
    device: str
    last_stats: LastStats | None
    plan_version: int | None
    modes: list[ModeName] | None = Field(description="what its last step's length runs")
    checkpointed_blocks: list[int] | None
    oom_risk: float | None
    prices: list[ModePrice] | None = Field(default=None, description="how sure each mode's price is (live ranks)")


class InForce(_Closed):
    """What the job's newest step length runs under its newest plan."""

    seq_len: int | None
    max_seq_len: int | None
    modes: list[ModeName]
    predicted_peak_bytes: int
    predicted_overhead_ratio: float


class JobView(_Closed):
    job: str
    state: JobState
    created_at: float
    updated_at: float
    ended_at: float | None
    world_size: int
    num_blocks: int
    budget_bytes: int
    model_fingerprint: str
    device: str
    ranks: list[RankView]
    plan: PlanRecord | None
    in_force: InForce | None
    peak_bytes: int | None
    headroom_ratio: float | None
    oom_risk: float | None
    oom_events: int
    recompiles: int
    controls: Controls


class JobList(_Closed):
    jobs: list[JobView]
    next_cursor: str | None = Field(None, description="pass as cursor for the next page; null on the last")


class JobPlans(_Closed):
    job: str
    plans: list[PlanRecord]
    next_cursor: str | None = Field(None, description="pass as cursor for the next page; null on the last")


class JobStats(_Closed):
    job: str
    stats: list[StepStatsRow]


class JobOoms(_Closed):
    job: str
    ooms: list[OomEvent]
    next_cursor: str | None = Field(None, description="pass as cursor for the next page; null on the last")
