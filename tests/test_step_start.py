"""What a step's start asks of the parallel set-up: nothing where the set-up does nothing there (a single
process's, tensor parallel's), every call where a backend does something there (its static memory, the weights
it gathers, a hook at the step's start)."""

from __future__ import annotations

import torch

from rematd.client.parallel.base import PLAIN, SetUp, idle
from rematd.client.parallel.fsdp import Fsdp
from rematd.client.parallel.pipeline import Pipeline
from rematd.client.parallel.tensor import TensorParallel
from rematd.client.parallel.zero import Zero3


class Counts(SetUp):
    """A set-up that holds static memory of its own, and nothing else."""

    def static_bytes(self, optimizer: torch.optim.Optimizer | None, engine: torch.nn.Module | None) -> int:
        return 1


def test_only_a_set_up_that_does_nothing_at_a_steps_start_is_skipped_there() -> None:
    assert idle(PLAIN) and idle(SetUp())
    assert idle(TensorParallel.__new__(TensorParallel)), "tensor parallel does nothing at a step's start"
    for kind in (Fsdp, Pipeline, Zero3, Counts):
        assert not idle(kind.__new__(kind)), kind
