"""The seam between a training step and the way its training is parallel: one object per set-up.

A step asks its :class:`SetUp` what differs from plain PyTorch: the static bytes the plan must count, what
counts as weights rather than activations, the context a recomputation runs in, the group of ranks that must
run one plan, and the microbatches alive at once. This class is plain PyTorch (and DDP, whose gradient
all-reduce a recomputation never replays); each backend's module derives its own, and
:mod:`rematd.client.parallel.pick` picks one at the first step (a model may be sharded after ``attach``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from rematd.client.parallel.agreement import Agreement


def imported(module: str, name: str) -> type | None:
    """The class ``name`` of ``module`` where that module was imported, else None: an object of a class no one
    imported cannot exist, and importing torch's distributed packages to check costs every process a second or
    more of start-up (DTensor's and the pipelines' import Dynamo and SymPy)."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


class SetUp:
    """Plain training: every answer is the default a backend may override."""

    name = "plain"
    """What the set-up is, in the log and the docs' words."""

    def __init__(self) -> None:
        self.agreement: Agreement | None = None
        """The ranks that must run one plan, and how they agree on it (None: this rank plans alone)."""
        self.is_weight: Callable[[torch.Tensor], bool] | None = None
        """A test for saved tensors that are parameters the set-up gathered (weights, not activations), where
        their storage does not tell; None where it does."""

    @property
    def gathered_at_peak(self) -> int:
        """Parameter bytes held gathered at the step's peak, a constant of the set-up (0: none)."""
        return 0

    def static_bytes(self, optimizer: torch.optim.Optimizer | None, engine: nn.Module | None) -> int:
        """On the CPU, where the budget stands for a device: device memory the plan must count beside the
        activations (a rank's shards, the parameters gathered at the peak). ``engine``: the engine whose step
        ends a step, when there is one."""
        return 0

    def weight_storages(self) -> frozenset[int]:
        """Storages the set-up gathers parameters into: weights, not activations (read at each step's start)."""
        return frozenset()

    def block_weights(self, module: nn.Module) -> frozenset[int]:
        """Storages of ``module``'s parameters as it runs them, when they are gathered ones (else none)."""
        return frozenset()

    def recomputing(self, module: nn.Module) -> AbstractContextManager[None]:
        """The context a block's recomputation in backward runs in."""
        return contextlib.nullcontext()

    def step_begins(self, rerun: tuple[bool, ...]) -> None:
        """At a step's start, with whether each block runs its forward again in backward."""

    def in_flight(self, blocks: int) -> tuple[int, ...]:
        """Per block, the microbatches whose activations of it are alive at once at the peak."""
        return (1,) * blocks

    def stages(self, blocks: int) -> tuple[int, ...]:
        """Per block, which of the rank's pipeline stages it runs in (0: the first; all 0 without a pipeline)."""
        return (0,) * blocks

    @property
    def other_in_flight(self) -> int:
        """The microbatches whose memory outside the blocks is alive at once at the peak."""
        return 1

    def describe(self) -> str:
        """The set-up and its agreement, for the log."""
        agreed = f"; {self.agreement.describe()}" if self.agreement is not None else ""
        return f"{self.name}{agreed}"


PLAIN = SetUp()
"""The set-up of a block before the first step has picked one."""


def idle(setup: SetUp) -> bool:
    """Whether ``setup`` does nothing at a step's start: no hook there, no static memory, no gathered
    weights (a single process's set-up), so that a step's start need not call it."""
    kind = type(setup)
    return (
        kind.step_begins is SetUp.step_begins
        and kind.static_bytes is SetUp.static_bytes
        and kind.weight_storages is SetUp.weight_storages
    )
