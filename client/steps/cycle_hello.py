"""The hello a step cycle opens the planner with at the profiling step's end: this rank's profile and place among
the ranks, the step's memory figures, and the static memory the first plan is made for (what the profiling step
left behind for the steps after it)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from rematd.client.blocks.switchable import SwitchableBlock
from rematd.client.memory.sources import MemorySample
from rematd.client.parallel.base import SetUp
from rematd.client.parallel.ranks import dist_rank
from rematd.client.plans.sources import Backend
from rematd.client.steps.hello import Identity, Memory, build_hello
from rematd.client.steps.modes_run import ModesRun
from rematd.planner import Shape
from rematd.planner.messages import Hello

log = logging.getLogger("rematd.client")


class ProfiledCycle(Protocol):
    """What the hello is built from (:class:`rematd.client.steps.boundaries.StepCycle`, at the profiling step's
    end)."""

    memory: Memory | None
    budget_bytes: int | None
    ranks: tuple[int, int] | None
    job_given: bool
    backend: Backend
    who: Identity
    blocks: list[SwitchableBlock]
    shape: Shape
    static: int
    carried: int
    fresh_grads: int
    setup: SetUp
    run: ModesRun
    _hello_static: int | None

    def _on_cuda(self) -> bool: ...
    def _static_now(self) -> int: ...


def profiled_hello(cycle: ProfiledCycle, sample: MemorySample) -> Hello:
    """The hello the planner opens with at the profiling step's end: the profile, the memory figures of the
    step and the static memory the first plan is made for."""
    assert cycle.memory is not None and cycle.budget_bytes is not None
    # Read now, not at attach: the process group is often set up after the model is attached.
    rank, world_size = cycle.ranks = dist_rank()
    # In-process every rank plans alone and no service shows jobs: only a stream has a job to split.
    if world_size > 1 and not cycle.job_given and cycle.backend.served:
        log.warning(
            "rematd: rank %d of %d was attached without job=, so it streams as job %r and every rank "
            "appears as a separate job; pass the same job= on every rank",
            rank,
            world_size,
            cycle.who.job,
        )
    hello = build_hello(
        cycle.who,
        cycle.blocks,
        cycle.memory,
        sample,
        rank=rank,
        world_size=world_size,
        shape=cycle.shape,
        budget_bytes=cycle.budget_bytes,
        static=cycle.static,
        fresh_grads=cycle.fresh_grads,
        # On CUDA the gathered parameters are in the allocator's peak, beside the blocks; on the CPU they
        # are part of the static bytes already.
        gathered=cycle.setup.gathered_at_peak if cycle._on_cuda() else 0,
        in_flight=cycle.setup.in_flight(len(cycle.blocks)),
        other_in_flight=cycle.setup.other_in_flight,
        stages=cycle.setup.stages(len(cycle.blocks)),
        ran=cycle.run.ran or tuple(b.mode for b in cycle.blocks),
    )
    # The first plan is made for the steps after profiling, which start with what profiling left behind.
    static = hello.static_bytes + _persisted(cycle)
    cycle._hello_static = static
    return dataclasses.replace(hello, static_bytes=static)


def _persisted(cycle: ProfiledCycle) -> int:
    """Static memory the profiling step created and kept for the steps after it, read at its end: optimizer
    state made at the first ``optimizer.step()``, and gradients (kept by ``zero_grad(set_to_none=False)``,
    torchtitan's default; counted whatever the loop does, as it cannot be known yet). On CUDA the gradients
    the step created are priced as a constant beside the blocks already (:func:`other_activations`), so they
    are left out here. ``cycle.static`` holds what the step carried in from earlier steps by now."""
    grown = cycle._static_now() - (cycle.static - cycle.carried)
    return max(0, grown - cycle.fresh_grads if cycle._on_cuda() else grown)
