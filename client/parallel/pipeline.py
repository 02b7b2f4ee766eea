"""Pipeline parallel with ``torch.distributed.pipelining``: a plan per stage that knows its microbatches in flight.

A schedule runs the forwards of several microbatches on a stage before the first one's backward: under
``ScheduleGPipe`` all of them, under ``Schedule1F1B`` ``min(n_microbatches, stages - stage_index)``, under
``ScheduleInterleaved1F1B`` a count per virtual stage. The stage's peak is what those microbatches keep at once,
so each stage needs a plan of its own: the first stages leaner than the last at one budget. The counts are read
from the schedule's own order of actions for this rank (the moment the most microbatches are alive), so every
schedule that runs whole backwards is priced as it runs.

A step is the schedule's ``step()``: rematd's step starts there, before any microbatch (where every rank of a
stage is, whatever the other stages do: a plan agreement, inside the stage's own group, is issued then), and
ends at ``optimizer.step()`` as elsewhere. Stages never agree with each other.

Schedules that split backward into an input and a weight part (the zero-bubble ones, ``ScheduleDualPipeV``)
hold activations between the two: refused, naming those that are supported.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from rematd.client.parallel.base import SetUp, imported
from rematd.planner import Shape

SUPPORTED = "ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B"


def is_schedule(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.distributed.pipelining`` schedule."""
    base = imported("torch.distributed.pipelining.schedules", "_PipelineSchedule")
    return base is not None and isinstance(obj, base)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage this rank runs."""

    index: int
    """Its index in the pipeline (0: the first)."""
    module: nn.Module
    """The module it runs (``PipelineStage.submod``)."""
    in_flight: int
    """Microbatches whose activations it holds at once at the rank's peak."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """What rematd reads of a schedule, once."""

    schedule: Any
    kind: str
    """Its class's name."""
    n_microbatches: int
    num_stages: int
    stages: tuple[Stage, ...]
    """This rank's stages, in the order they run a microbatch."""

    def describe(self) -> str:
        stages = ", ".join(f"stage {s.index}: {s.in_flight} in flight" for s in self.stages)
        return f"{self.kind}, {self.n_microbatches} microbatches over {self.num_stages} stages ({stages})"

    def microbatch_shape(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shape | None:
        """The shape of one microbatch of the whole batch ``step()`` was given, or None on a stage not given it."""
        return microbatch_shape(args, kwargs, self.n_microbatches)


def alive_at_peak(actions: Sequence[Any], stages: Sequence[int]) -> dict[int, int]:
    """Per stage of ``stages``, the microbatches alive (forward run, backward not yet) at the first moment the
    most are alive at once, walking a rank's actions (``_Action``: a stage index and a computation type)."""
    alive = dict.fromkeys(stages, 0)
    best: dict[int, int] = dict(alive)
    for action in actions:
        if action is None:
            continue
        kind = str(getattr(action.computation_type, "value", action.computation_type))
        if kind in ("I", "W"):
            raise ValueError(
                "pipeline: the schedule splits backward into input and weight parts (a zero-bubble schedule); "
                f"rematd supports schedules that run whole backwards: {SUPPORTED}"
            )
        if action.stage_index not in alive or kind not in ("F", "B"):
            continue
        alive[action.stage_index] += 1 if kind == "F" else -1
        if sum(alive.values()) > sum(best.values()):
            best = dict(alive)
    return {s: max(1, n) for s, n in best.items()}


def _stages_of(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def _order(schedule: Any, stages: Sequence[Any]) -> Sequence[Any]:
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        order = schedule._get_pipeline_order() if hasattr(schedule, "_get_pipeline_order") else None
    if not order:
        raise ValueError(
            f"pipeline: {type(schedule).__name__} does not say the order of its actions; rematd supports {SUPPORTED}"
        )
    # Single-stage schedules key their order by stage index, the others by the rank in the pipeline group.
    rank = getattr(schedule, "rank", stages[0].stage_index)
    return order[rank]  # type: ignore[no-any-return]


def read_schedule(schedule: Any) -> Schedule:
    """The schedule's stages on this rank and their microbatches in flight; ``ValueError`` naming the setting for
    a schedule rematd cannot plan for."""
    if not is_schedule(schedule):
        raise TypeError(f"pipeline must be a torch.distributed.pipelining schedule, got {type(schedule).__name__}")
    if getattr(schedule, "_loss_fn", None) is None:
        raise ValueError(
            "pipeline: the schedule has no loss_fn, so its step() runs no backward and nothing is checkpointed; "
            "give the schedule loss_fn= (rematd plans training steps)"
        )
    stages = _stages_of(schedule)
    alive = alive_at_peak(_order(schedule, stages), [s.stage_index for s in stages])
    return Schedule(
        schedule=schedule,
        kind=type(schedule).__name__,
        n_microbatches=int(schedule._n_microbatches),
        num_stages=int(stages[0].num_stages),
        stages=tuple(
            Stage(index=int(s.stage_index), module=_inner(s.submod), in_flight=alive[s.stage_index])
            for s in sorted(stages, key=lambda s: s.stage_index)
        ),
    )


def _inner(module: nn.Module) -> nn.Module:
    """A stage's module as rematd attaches to it (DDP's inner module)."""
    inner = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
    assert isinstance(inner, nn.Module)
    return inner


def running_schedule(depth: int = 64) -> Any | None:
    """The ``torch.distributed.pipelining`` schedule whose ``step()`` is running on this thread's stack (a stage
    module's forward called by it), or None. Read once, at a handle's first step: a module attached without
    ``h.pipeline`` learns so that a schedule runs it."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if "pipelining" in frame.f_code.co_filename:
            found = frame.f_locals.get("self")
            if is_schedule(found):
                return found
        frame = frame.f_back
    return None


def microbatch_shape(args: tuple[Any, ...], kwargs: dict[str, Any], n_microbatches: int) -> Shape | None:
    """The shape of one microbatch of the whole batch ``step()`` was given (split along its first dimension, the
    schedules' default), or None when this stage is not given the batch (it receives activations)."""
    from rematd.client.call_shape import shape_of

    whole = shape_of(args, kwargs)
    if not whole.batch:
        return None
    batch = math.ceil(whole.batch / n_microbatches)
    return Shape(batch=batch, seq_len=whole.seq_len, tokens=batch * whole.seq_len)


class StepStart:
    """``schedule.step`` as rematd leaves it: ``before(args, kwargs)`` (a rematd step starts), then the
    schedule's own. Removed with :meth:`remove`, as a hook is."""

    __slots__ = ("before", "own", "schedule")

    def __init__(self, schedule: Any, before: Callable[[tuple[Any, ...], dict[str, Any]], None]) -> None:
        self.schedule, self.own, self.before = schedule, schedule.step, before
        schedule.__dict__["step"] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.before(args, kwargs)
        return self.own(*args, **kwargs)

    def remove(self) -> None:
        if self.schedule.__dict__.get("step") is self:
            del self.schedule.__dict__["step"]


class Pipeline(SetUp):
    """This rank's pipeline stages around the set-up of their modules (plain, FSDP2, tensor parallel): that
    answers for memory, weights and agreement (inside the stage, over the stages' own device mesh); the
    pipeline adds the microbatches in flight."""

    def __init__(self, schedule: Schedule, inner: SetUp, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.schedule = schedule
        self.inner = inner
        self.agreement = inner.agreement
        self.is_weight = inner.is_weight
        self.name = f"pipeline ({schedule.describe()}) over {inner.name}"
        found = [self._stage_of(b) for b in blocks]
        self._in_flight = tuple(s.in_flight for s in found)
        self._stages = tuple(schedule.stages.index(s) for s in found)
        # The memory outside the blocks (embeddings, the head) counted at the stage that holds most at once.
        self._other_in_flight = max(s.in_flight for s in schedule.stages)

    def _stage_of(self, block: nn.Module) -> Stage:
        for stage in self.schedule.stages:
            if any(m is block for m in stage.module.modules()):
                return stage
        raise ValueError(f"pipeline: block {type(block).__name__} lies in none of this rank's stage modules")

    @property
    def gathered_at_peak(self) -> int:
        return self.inner.gathered_at_peak

    def static_bytes(self, optimizer: Any, engine: nn.Module | None) -> int:
        return self.inner.static_bytes(optimizer, engine)

    def weight_storages(self) -> frozenset[int]:
        return self.inner.weight_storages()

    def block_weights(self, module: nn.Module) -> frozenset[int]:
        return self.inner.block_weights(module)

    def recomputing(self, module: nn.Module) -> Any:
        return self.inner.recomputing(module)

    def step_begins(self, rerun: tuple[bool, ...]) -> None:
        self.inner.step_begins(rerun)

    def in_flight(self, blocks: int) -> tuple[int, ...]:
        return self._in_flight

    def stages(self, blocks: int) -> tuple[int, ...]:
        return self._stages

    @property
    def other_in_flight(self) -> int:
        return self._other_in_flight
