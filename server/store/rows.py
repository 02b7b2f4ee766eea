"""The rows the store keeps, each defined once.

The core builds them, the store writes and reads them (its tables, columns and statements come from
these: ``tables``), and the REST API returns them as they are: its response models are these types, so ``/openapi.json``
documents what the store holds. Tests hold the database's tables to these definitions, and the
dashboard's reads to their keys.

They are ``TypedDict``s rather than dataclasses: the rows travel as plain JSON-able dicts from the
database to the HTTP response, and a class of their own at each end would be one more copy.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args, get_type_hints

from pydantic import ConfigDict, Field, with_config
from typing_extensions import NotRequired, TypedDict

ModeName = Literal["store", "selective", "recompute", "offload", "compress", "titan", "attention", "mlp"]


class StepRow(TypedDict):
    """One step's statistics from one rank, as the core hands them to the store."""

    step: int
    time: Annotated[float, Field(description="unix seconds, when the service received the step")]
    peak_bytes: Annotated[int, Field(description="measured peak of the budgeted memory")]
    budget_bytes: int
    predicted_peak_bytes: Annotated[int, Field(description="what the planner predicted for the plan the step ran")]
    plan_version: int
    seq_len: int
    batch: int
    step_seconds: float
    oom_risk: Annotated[float | None, Field(description="0-1; null from clients that do not measure it")]


@with_config(ConfigDict(extra="allow"))
class StoredStepRow(StepRow):
    """A step's row read back: the rank it came from (a migration may widen the table: keys beyond
    these pass through)."""

    rank: int


class LastStepRow(StepRow):
    """A rank's newest step, kept with the rank."""

    recompiles_total: NotRequired[Annotated[int, Field(description="the rank's compiles so far")]]
    thread_seconds: NotRequired[
        Annotated[
            float,
            Field(
                description="seconds rematd's own code ran on the rank's training thread per step (hooks, wrappers; "
                "the mean of the steps the report covered)"
            ),
        ]
    ]
    routed_bytes: NotRequired[
        Annotated[
            int,
            Field(
                description="bytes a mixture of experts' routing added to the step's peak beyond the rows its experts "
                "typically receive (the client's measure from its profile; 0 for a balanced step or no experts)"
            ),
        ]
    ]
    modes: NotRequired[
        Annotated[
            list[ModeName],
            Field(
                description="the modes the step ran when not its plan's (a pin in the training process, or the "
                "plan a sharded job's ranks agreed on); predicted_peak_bytes is theirs"
            ),
        ]
    ]
    predicted_overhead_ratio: NotRequired[
        Annotated[float, Field(description="with modes: their predicted recompute overhead")]
    ]


class OomRow(TypedDict):
    """An out-of-memory event a rank reported."""

    step: int
    time: float
    seq_len: int
    batch: int
    plan_version: int
    message: str


class StoredOomRow(OomRow):
    rank: int


class ShapePlanRow(TypedDict):
    """One row of a plan's per-length table: what steps up to this length and token count run."""

    max_seq_len: int
    max_tokens: int
    modes: list[ModeName]
    predicted_peak_bytes: int
    predicted_overhead_ratio: float


class PlanRow(TypedDict):
    """A plan as the core hands it to the store."""

    version: int
    checkpoint_every: int
    blocks: Annotated[list[int], Field(description="blocks recomputing")]
    modes: Annotated[list[ModeName], Field(description="one mode per block")]
    shape_plans: Annotated[list[ShapePlanRow], Field(description="per sequence length, shortest first")]
    predicted_peak_bytes: int
    predicted_overhead_ratio: float
    target_bytes: int
    reason: str
    seq_len: Annotated[
        int | None,
        Field(
            description="the length of the step the plan was made at (the profiled step's for a rank's first "
            "plan); null for plans stored before it was kept"
        ),
    ]


class StoredPlanRow(PlanRow):
    """A plan read back from the store."""

    rank: Annotated[int, Field(description="the rank it was made for")]
    created_at: float


class WarmPlanRow(TypedDict):
    """A plan a finished or steady job left for the next job of the same model on the same device."""

    model_fingerprint: str
    device: str
    shape_bucket: Annotated[int, Field(description="bit length of the tokens per batch it was planned at")]
    job: Annotated[str, Field(description="the job that left it")]
    blocks: list[int]
    num_blocks: int
    budget_bytes: int
    modes: list[ModeName]
    shape_plans: list[ShapePlanRow]
    updated_at: float


class ControlsRow(TypedDict):
    """An operator's overrides of one job's planning."""

    job: str
    pin_blocks: list[int] | None
    pin_modes: list[ModeName] | None
    pin_every: int | None
    margin_ratio: float | None
    budget_bytes: int | None
    ended_at: float | None


class StoredControlsRow(ControlsRow):
    """Controls read back, with the revision every worker and replica polls for."""

    revision: int
    updated_at: float


class JobRow(TypedDict):
    """A job as the store keeps it."""

    job: str
    created_at: float
    updated_at: float
    ended_at: float | None
    world_size: int
    num_blocks: int
    budget_bytes: int
    model_fingerprint: str
    device: str


class RankRow(TypedDict):
    """A rank of a job as the store keeps it."""

    job: str
    rank: int
    device: str
    state: str
    last_stats: LastStepRow | None


def keys(row: type) -> tuple[str, ...]:
    """A row type's keys, in the order they are declared."""
    return tuple(get_type_hints(row))


def nullable(row: type) -> frozenset[str]:
    """A row type's keys that may hold None."""
    return frozenset(k for k, kind in get_type_hints(row).items() if type(None) in get_args(kind))
