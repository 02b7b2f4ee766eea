"""Which parallel set-up a model trains under: the one module outside the backends' own that names them.

At ``attach``: what to attach to (a model, DDP's or a DeepSpeed engine's inner module, the stage modules of a
``torch.distributed.pipelining`` schedule), and what is refused. At the first step, when the set-up is complete
(``fully_shard`` and ``deepspeed.initialize`` may come after ``attach``): the :class:`SetUp` the steps ask.

=========================== =============================== ======================================================
set-up                      module                          agreeing ranks
=========================== =============================== ======================================================
plain, DDP                  :mod:`.base`                    none (``same_plan=True``: the process group)
FSDP2 (and tensor parallel) :mod:`.fsdp`                    the parameters' device mesh, each dimension
tensor parallel             :mod:`.tensor`                  the parameters' device mesh
DeepSpeed ZeRO-3            :mod:`.zero`                    ZeRO-3's data-parallel group
pipeline stage(s)           :mod:`.pipeline`                the stage's own mesh (its modules' set-up); stages
                                                            never agree with each other
=========================== =============================== ======================================================
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from rematd.client.checks.model import check_module
from rematd.client.parallel.agreement import Agreement
from rematd.client.parallel.base import SetUp
from rematd.client.parallel.fsdp import Fsdp, check_units, is_sharded, refuse_fsdp1
from rematd.client.parallel.fsdp import block_class as fsdp_block_class
from rematd.client.parallel.pipeline import (
    Pipeline,
    Schedule,
    StepStart,
    is_schedule,
    read_schedule,
    running_schedule,
)
from rematd.client.parallel.ranks import dist_rank
from rematd.client.parallel.tensor import TensorParallel, has_dtensors
from rematd.client.parallel.zero import Zero3, follow, is_engine, is_zero3, refuse_unsupported
from rematd.client.parallel.zero import check_engine as check_zero_engine

log = logging.getLogger("rematd.client")

# What the rest of the client asks of the parallel set-ups: it names no backend module itself.
__all__ = [
    "Schedule",
    "StepStart",
    "Target",
    "block_class",
    "check_blocks",
    "check_engine",
    "follow",
    "pick",
    "read_schedule",
    "resolve",
    "running_schedule",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """What ``attach`` works on."""

    model: nn.Module
    """The module the blocks are found in (a pipeline rank's stage modules together, when it runs several)."""
    roots: tuple[nn.Module, ...]
    """The modules whose forward is a step's forward (a pipeline rank's stage modules)."""
    engine: nn.Module | None = None
    """The DeepSpeed engine attached to, if any."""
    schedule: Schedule | None = None
    """The pipeline schedule attached to, if any."""
    group: Any = None
    """DDP's process group, for ``same_plan=True``."""


def resolve(obj: object) -> Target:
    """What to attach to for ``obj`` (a model, DDP, a DeepSpeed engine or a pipeline schedule); raises
    :class:`rematd.client.UnsupportedModel` for what rematd cannot switch, naming what to change."""
    if is_schedule(obj):
        schedule = read_schedule(obj)
        modules = [stage_module(s.module) for s in schedule.stages]
        model = modules[0] if len(modules) == 1 else stages_together(schedule)
        return Target(model=model, roots=tuple(modules), schedule=schedule)
    model = check_module(obj)
    refuse_fsdp1(model)
    refuse_unsupported(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return Target(model=model.module, roots=(model.module,), group=model.process_group)
    if is_engine(model):
        inner = model.module
        assert isinstance(inner, nn.Module)
        return Target(model=inner, roots=(inner,), engine=model)
    return Target(model=model, roots=(model,))


def stage_module(module: nn.Module) -> nn.Module:
    """A pipeline stage's module, checked as any model is."""
    checked = check_module(module)
    refuse_fsdp1(checked)
    return checked


def stages_together(schedule: Schedule) -> nn.Module:
    """A rank's stage modules in one container (``stage<index>``), where its blocks are found by their names."""
    return nn.ModuleDict({f"stage{s.index}": s.module for s in schedule.stages})


def check_blocks(model: nn.Module, found: Sequence[tuple[str, nn.Module]]) -> None:
    """The blocks as the model's set-up allows them (FSDP: each inside one unit), when it is set up already."""
    check_units(model, found)


def block_class(m: nn.Module) -> type[nn.Module]:
    """The class a block was defined with, whatever a backend made of it (FSDP2 derives a class of its own)."""
    return fsdp_block_class(m)


def check_engine(engine: object) -> None:
    """``h.engine``: an engine whose step ends a rematd step (DeepSpeed's), or None."""
    check_zero_engine(engine)


def follow_engine(engine: nn.Module, after: Callable[[], None]) -> Callable[[], None]:
    """Run ``after()`` after each step of ``engine`` that stepped the optimizer; returns what undoes it."""
    return follow(engine, after)


def pick(
    model: nn.Module,
    blocks: Sequence[tuple[str, nn.Module]],
    *,
    same_plan: bool | None,
    schedule: Schedule | None,
    group: Any = None,
) -> SetUp:
    """The set-up of a model at its first step. ``same_plan``: None lets the set-up say whether its ranks agree
    (those that replay collectives, or share one memory shape, do); False turns the agreement off; True turns it
    on for plain ranks too (over ``group``, DDP's, or the default group)."""
    agree = same_plan is not False
    inner: SetUp
    if is_sharded(model):
        inner = Fsdp(model, blocks, agree=agree)
    elif is_zero3(model):
        inner = Zero3(model, [m for _, m in blocks], agree=agree)
    elif has_dtensors(model):
        inner = TensorParallel(model)
        if not agree:
            inner.agreement = None
    else:
        inner = SetUp()
        if same_plan and schedule is None and dist_rank()[1] > 1:
            inner.agreement = Agreement([group], "the process group" if group is not None else "every rank")
    if schedule is None:
        return inner
    if same_plan and inner.agreement is None:
        log.info("rematd: same_plan=True, but this pipeline stage shares its parameters with no other rank")
    return Pipeline(schedule, inner, [m for _, m in blocks])
