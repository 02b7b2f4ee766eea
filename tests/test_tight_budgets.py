"""Never over the budget: a job that fits only with checkpointing runs from its first step, and a budget just above
what the leanest plan needs runs no plan predicted over it and no step measured over it.

On the CPU the budget caps the bytes saved for backward, and ``hard_limit_bytes`` equal to it turns any step that
crosses it into an out-of-memory error, as the device would: a plain training loop (not ``run_step``, which
retries) then dies. The CUDA twin is in ``tests/test_cuda.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rematd import client
from rematd.planner import Mode, Shape
from rematd.planner.plan import entry_for

from .helpers import live_server, tiny_model, train_step

BLOCKS = 12
SEQ = 64
STEPS = 12
FACTORS = (1.01, 1.03, 1.06, 1.10)


def leanest_peak() -> tuple[int, int]:
    """The bytes a step of the 12-block GPT saves with every block recomputed, and with every block stored."""
    model = tiny_model(n_layer=BLOCKS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt)
    train_step(model, opt, SEQ)  # profiling
    peaks = {}
    for mode in ("recompute", "store"):
        h.pin_modes(mode)
        train_step(model, opt, SEQ)
        assert h.last_stats is not None
        peaks[mode] = h.last_stats.saved_peak_bytes
    h.close()
    return peaks["recompute"], peaks["store"]


@pytest.fixture(scope="module")
def peaks() -> tuple[int, int]:
    return leanest_peak()


def train(budget: int, server: str | None = None, job: str = "tight") -> tuple[list[int], list[int], client.Handle]:
    """A plain loop at ``budget`` with ``hard_limit_bytes`` at the budget: each step's measured peak and the
    predicted peak of the plan that ran it."""
    model = tiny_model(n_layer=BLOCKS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=budget, hard_limit_bytes=budget, server=server, job=job)
    measured, predicted = [], []
    shape = Shape(batch=2, seq_len=SEQ, tokens=2 * SEQ)
    for step in range(STEPS):
        train_step(model, opt, SEQ, seed=step)  # raises OutOfMemory past the budget
        if server is not None:
            assert h.flush(20.0), "the service did not answer in time"
        assert h.last_stats is not None
        measured.append(h.last_stats.saved_peak_bytes)
        entry = entry_for(h.plan.shape_plans, shape)
        predicted.append(entry.predicted_peak_bytes if entry is not None else h.plan.predicted_peak_bytes)
    h.close()
    return measured, predicted, h


def test_the_profiling_step_keeps_no_more_than_recomputing_every_block(peaks: tuple[int, int]) -> None:
    lean, store = peaks
    assert store > 5 * lean, "the model does not fit storing: only checkpointing makes it fit"
    budget = int(1.01 * lean)
    measured, _predicted, h = train(budget)
    assert measured[0] == lean, "the profiling step measured what recomputing every block measures"
    assert h.history[0].version == 1 and max(measured) <= budget
    assert h.oom_count == 0


@pytest.mark.parametrize("factor", FACTORS)
def test_a_budget_just_above_the_leanest_plan_is_never_crossed_in_process(
    factor: float, peaks: tuple[int, int]
) -> None:
    budget = int(factor * peaks[0])
    measured, predicted, h = train(budget)
    over = [(k, m) for k, m in enumerate(measured) if m > budget]
    assert not over, f"steps over the budget of {budget}: {over}"
    assert all(p <= budget for p in predicted[1:]), (predicted, budget)
    assert all(p.predicted_peak_bytes <= budget for p in h.history), [(p.version, p.reason) for p in h.history]
    if factor < 1.05:
        # Nothing fits the target (the budget less the margin): the fastest plan under the budget, said so.
        assert any("no plan fits the target" in p.reason for p in h.history), [p.reason for p in h.history]
    assert not any("no plan fits the budget" in p.reason for p in h.history), [p.reason for p in h.history]
    if factor >= 1.06:
        # Above what storing the last block needs (3.6% over recomputing it here), the plan uses the room: some
        # block keeps more than it would recomputing (stored, or one of its parts kept), at the steps' length.
        shape = Shape(batch=2, seq_len=SEQ, tokens=2 * SEQ)
        kept = [m for p in h.history for m in p.modes_for(shape, BLOCKS) if m is not Mode.RECOMPUTE]
        assert kept, [p.reason for p in h.history]


def test_a_budget_just_above_the_leanest_plan_is_never_crossed_served(tmp_path: Path, peaks: tuple[int, int]) -> None:
    with live_server(tmp_path) as srv:
        for factor in (FACTORS[0], FACTORS[-1]):
            budget = int(factor * peaks[0])
            measured, _predicted, h = train(budget, server=srv.grpc, job=f"tight-{factor}")
            over = [(k, m) for k, m in enumerate(measured) if m > budget]
            assert not over, f"x{factor}: steps over the budget of {budget}: {over}"
            assert all(p.predicted_peak_bytes <= budget for p in h.history), [p.reason for p in h.history]
            # Until the service's first plan arrives, every block keeps recomputing.
            assert measured[0] == measured[1] == peaks[0] or h.history[0].version == 1


def test_where_nothing_is_predicted_under_the_budget_the_leanest_runs_and_says_by_how_much(
    peaks: tuple[int, int],
) -> None:
    budget = int(0.9 * peaks[0])
    model = tiny_model(n_layer=BLOCKS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=budget)
    for step in range(3):
        train_step(model, opt, SEQ, seed=step)
    # The leanest plan: nothing stored (recomputing the last block's MLP alone may be leaner still).
    assert Mode.STORE not in h.modes and h.last_stats is not None and h.last_stats.saved_peak_bytes <= peaks[0]
    reason = h.plan.reason
    assert "no plan fits the budget of" in reason and "over it" in reason, reason
    h.close()
