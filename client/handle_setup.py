"""A handle's construction: what ``attach`` works on resolved, the blocks found and wrapped, where plans come from
(a service's stream, the planner's thread, or this thread), and the step cycle over them all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rematd.client.assembly import BlockParts, build_parts
from rematd.client.blocks.discovery import find_stage_blocks, model_fingerprint
from rematd.client.options import AttachOptions
from rematd.client.parallel.pick import Target, check_blocks, resolve
from rematd.client.plans.applier import PlanApplier
from rematd.client.plans.background import ThreadedBackend
from rematd.client.plans.sources import Backend, EmbeddedBackend
from rematd.client.service.stream import StreamBackend
from rematd.client.steps.boundaries import StepCycle


@dataclass(frozen=True, slots=True)
class HandleSetUp:
    """The parts a handle is made of."""

    target: Target
    parts: BlockParts
    backend: Backend
    cycle: StepCycle


def choose_backend(options: AttachOptions, applier: PlanApplier) -> Backend:
    """Where the plans come from: the service at ``options.server``, else the planner on a thread of its own
    (``planner_thread``), else the planner on the training thread."""
    if options.server:
        return StreamBackend(options.server, applier.receive, options.stream)
    if options.planner_thread:
        return ThreadedBackend(applier.receive, applier.answered)
    return EmbeddedBackend(applier.receive)


def set_up(
    model: nn.Module,
    options: AttachOptions,
    *,
    blocks: Sequence[nn.Module] | nn.ModuleDict | None,
    optimizer: torch.optim.Optimizer | None,
) -> HandleSetUp:
    """A handle's parts for ``model`` (what ``attach`` was given: a model, DDP, an engine or a schedule)."""
    target = resolve(model)
    model = target.model
    found = find_stage_blocks(model, target.roots, blocks, stages=target.schedule is not None)
    check_blocks(model, found)  # sharded already; a model sharded after attach is checked at its first step
    parts = build_parts(
        model,
        found,
        hard_limit_bytes=options.hard_limit_bytes,
        compile_backend=options.compile_backend,
        compress=options.compress,
        offload=options.offload,
    )
    backend = choose_backend(options, parts.applier)
    parts.applier.price = backend.plan_of
    cycle = StepCycle(
        model,
        options,
        optimizer=optimizer,
        parts=parts,
        backend=backend,
        fingerprint=model_fingerprint(found),
        group=target.group,
    )
    return HandleSetUp(target, parts, backend, cycle)
