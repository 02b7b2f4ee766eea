"""One rank of the FSDP2 tight-budget test, on the CPU's saved-tensor accounting: for each case of
``REMATD_CONFIG``, a budget a little above what the leanest plan (every block recomputed) measures, the same on
every rank, and ``hard_limit_bytes`` at the budget's room for activations, so that a step over the budget raises as
a device would. A plain training loop from the first step: written, each step's measured and predicted peaks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rematd import client
from rematd.client import introspect
from tests.workers.fsdp_exact import build, shard
from tests.workers.fsdp_memory import step
from tests.workers.rank import run_cases


def sharded(budget: int | None = None, hard_limit: int | None = None) -> tuple[Any, Any, client.Handle]:
    model = build("llama")
    # Planned on the training thread: the plan for what the profiling step left behind (the first step after it
    # shows) is in force from that very step, so every step's prediction is of the memory it had.
    h = client.attach(model, budget_bytes=budget, hard_limit_bytes=hard_limit, planner_thread=False)
    shard(model, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    h.optimizer = opt
    return model, opt, h


def leanest(rank: int) -> tuple[int, int]:
    """Every block recomputed, sharded: the step's measured peak and its static bytes (optimizer state made)."""
    model, opt, h = sharded()
    for n in range(2):
        step(model, opt, rank, n)
    h.pin_modes("recompute")
    step(model, opt, rank, 2)
    stats = h.last_stats
    assert stats is not None
    h.close()
    return stats.saved_peak_bytes, stats.static_bytes


def run_case(config: dict[str, Any], rank: int) -> dict[str, Any]:
    peak, static = leanest(rank)
    # One budget for every rank (a rank's shards differ a little): the largest.
    both = torch.tensor([int(config["factor"] * peak), static])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    budget, static = (int(v) for v in both)
    model, opt, h = sharded(budget, budget - static)
    steps, raised = [], ""
    try:
        for n in range(config.get("steps", 10)):
            step(model, opt, rank, n)
            stats = h.last_stats
            assert stats is not None
            steps.append(
                {
                    "peak": stats.saved_peak_bytes,
                    "predicted": h.plan.predicted_peak_bytes,
                    "modes": [m.name for m in h.modes],
                    "reason": h.plan.reason,
                }
            )
    except torch.OutOfMemoryError as err:
        raised = str(err)
    result = {"case": config, "budget": budget, "leanest": peak, "steps": steps, "raised": raised}
    result["errors"] = introspect.cycle(h).errors
    h.close()
    return result


if __name__ == "__main__":
    run_cases(run_case)
