"""The shapes of what the REST API reads, defined here once: a job with its ranks and the plan in force, how
sure each mode's price is, and the bounds of a read (the rows of statistics, the modes of a page of plans).

The REST API's response models are these types; ``read_views`` shapes them from the store and the live
sessions.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field
from typing_extensions import TypedDict

from rematd.server.store.rows import ControlsRow, JobRow, LastStepRow, ModeName, StoredPlanRow

JobState = Literal["running", "disconnected", "ended"]
JOB_STATES: tuple[JobState, ...] = ("running", "disconnected", "ended")
STATS_ROWS = 2000
"""Rows a read of a job's statistics returns unless it asks for another number."""
PAGE_MODES = 1_000_000
"""Modes a page of plans holds at most (about 11 MiB of JSON): 10,000 plans of a 4,096-block model would be
gigabytes, so a wide model's page holds fewer plans and says where the next starts."""
MODES_PER_BLOCK = 17
"""A plan's modes per block: its own and those of the most entries its table has (16 by default)."""


class StatsQuery(TypedDict, total=False):
    """Which steps a read of a job's statistics returns."""

    limit: int
    since: float | None
    until: float | None
    rank: int | None


PriceState = Literal["measured", "trial", "estimate"]
"""How sure a price is (``PlanSession.prices``)."""


class BucketPrice(TypedDict):
    """How sure the planner is of what one mode costs at the lengths of one bucket."""

    max_seq_len: Annotated[int, Field(description="the top of the length bucket")]
    state: Annotated[
        PriceState,
        Field(
            description="measured: timed often enough in this bucket; trial: being measured here now; "
            "estimate: priced by the scale over all lengths (or, untried, at no less than recomputing)"
        ),
    ]
    timed_blocks: Annotated[int, Field(description="blocks of this mode timed in this bucket")]
    scale: Annotated[float, Field(description="measured over profiled seconds that price this bucket")]
    last_step: Annotated[int | None, Field(description="the step this mode was last timed in this bucket")]
    step_share: Annotated[
        list[float] | None,
        Field(
            description="where this bucket's step times moved the price: per group of blocks by position "
            "(first blocks first), what a block in this mode adds to a step by the step times, as a fraction "
            "of the step (negative: faster than storing it)"
        ),
    ]
    block_share: Annotated[
        list[float] | None,
        Field(description="the same by the per-block prices, where step_share is given"),
    ]


class ModePrice(TypedDict):
    """How sure the planner is of what one mode costs on this rank."""

    mode: ModeName
    state: Annotated[
        PriceState,
        Field(
            description="measured: timed often enough; trial: being measured now; estimate: untried, priced "
            "at no less than recomputing"
        ),
    ]
    timed_blocks: Annotated[int, Field(description="blocks of this mode timed so far")]
    scale: Annotated[float | None, Field(description="measured over profiled seconds, once measured")]
    buckets: Annotated[
        list[BucketPrice], Field(description="the same per length bucket timed (the 16 last timed), shortest first")
    ]


class RankView(TypedDict):
    rank: int
    connected: bool
    state: Annotated[str, Field(description="connected, disconnected or ended")]
    device: str
    last_stats: LastStepRow | None
    plan_version: int | None
    modes: Annotated[list[ModeName] | None, Field(description="what its last step's length runs")]
    checkpointed_blocks: list[int] | None
    oom_risk: float | None
    prices: Annotated[
        list[ModePrice] | None, Field(description="how sure each mode's price is (ranks whose stream is here)")
    ]
    served_here: Annotated[
        bool,
        Field(
            description="this process holds the rank's stream: its plan, risk and prices are read from memory; "
            "otherwise (another worker or replica holds it, or none) from the store's latest rows"
        ),
    ]
    figures_at: Annotated[
        float | None,
        Field(description="unix seconds: when the step its figures come from was received (null before one)"),
    ]


class InForce(TypedDict):
    """What the job's newest step ran: the plan it reported, at its length."""

    version: Annotated[int, Field(description="the version of the plan the newest step ran")]
    seq_len: int | None
    max_seq_len: int | None
    modes: list[ModeName]
    predicted_peak_bytes: int
    predicted_overhead_ratio: float
    lossy: Annotated[bool, Field(description="some block compresses its saved activations: close, not bitwise")]
    source: Annotated[
        Literal["plan", "ranks"],
        Field(
            description="plan: the job's newest plan at that length; ranks: the modes its newest step ran instead "
            "(a pin in the training process, h.pin_modes, or the plan a sharded job's ranks agreed on)"
        ),
    ]


class JobView(JobRow):
    """A job as the store keeps it, with its ranks, its plan in force and the figures they give."""

    state: JobState
    ranks: list[RankView]
    plan: StoredPlanRow | None
    in_force: InForce | None
    peak_bytes: int | None
    headroom_ratio: float | None
    oom_risk: float | None
    oom_events: int
    recompiles: int
    controls: ControlsRow
