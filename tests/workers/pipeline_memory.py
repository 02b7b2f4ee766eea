"""One rank of the pipeline memory test, for each case of ``REMATD_CONFIG``: a Llama split in stages of alike
layers, two stages under ``Schedule1F1B`` (the first stage holds two microbatches at once, the last one) or
``ScheduleGPipe``, or four under ``ScheduleInterleaved1F1B``, two a rank.

First every stage runs the static plans "the first k blocks recomputed", k = 0 .. all, and measures each one's
peak. Then one budget for both stages, between the last stage's peak when it stores everything and the first
stage's, and rematd plans each stage. Written: the static plans' peaks, and per planned step the modes, the
predicted and the measured peak, and the learned correction.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from bench.pipeline_models import llama, loss_fn, titan_stage
from rematd import client
from rematd.client import introspect
from rematd.planner import Mode
from rematd.planner.plan import entry_for
from tests.workers.rank import run_cases


def run_case(config: dict[str, Any], rank: int) -> dict[str, Any]:
    counts = config.get("counts", [4, 4])
    whole = llama(sum(counts), width=config.get("width", 64))
    world = dist.get_world_size()
    indices = list(range(rank, len(counts), world))  # two stages a rank when interleaved
    modules = [titan_stage(whole, i, counts) for i in indices]
    stages = [PipelineStage(m, i, len(counts), torch.device("cpu")) for m, i in zip(modules, indices, strict=True)]
    kind = config.get("schedule", "1f1b")
    n_micro = config.get("microbatches", 4)
    if kind == "interleaved":
        schedule: Any = ScheduleInterleaved1F1B(stages, n_micro, loss_fn=loss_fn)
    else:
        schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stages[0], n_micro, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=1e-3)
    # Attached to the schedule, or to the rank's (first) stage module with nothing said of the schedule: rematd
    # finds the schedule running it at the first step.
    attached = modules[0] if config.get("attach") == "module" else schedule
    # Planned on the training thread: each stage's predictions are checked step by step against its plan.
    h = client.attach(attached, optimizer=opt, modes=["recompute"], job="pipeline-memory", planner_thread=False)
    n = len(h.blocks)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 64, (4 * config.get("microbatch", 2), config.get("seq", 64)), generator=gen)

    def step() -> None:
        if 0 in indices:
            schedule.step(batch, **({"target": batch, "losses": []} if len(counts) - 1 in indices else {}))
        else:
            schedule.step(target=batch, losses=[])
        opt.step()
        opt.zero_grad(set_to_none=True)

    if config.get("refused"):
        # The rank runs several stages and rematd is attached to one: the first step stops, saying what to set.
        try:
            step()
        except ValueError as err:
            said = f"{type(err).__name__}: {err}"
        else:
            said = ""
        h.close()
        return {"case": config, "rank": rank, "said": said}
    step()  # profiling
    found = h.pipeline is schedule
    static_peaks = []
    for k in range(n + 1):
        h.pin_modes([Mode.RECOMPUTE] * k + [Mode.STORE] * (n - k))
        step()
        assert h.last_stats is not None
        static_peaks.append(h.last_stats.saved_peak_bytes)
    peaks: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(peaks, static_peaks)
    # One budget whose target the first stage fits by recomputing half its blocks and the last stage, which holds
    # one microbatch, fits storing them all.
    h.pin_modes(None)
    h.budget_bytes = int(max(peaks[0][n // 2], peaks[-1][0]) * 1.01 / (1 - h.margin_ratio))
    planned = []
    for _ in range(config.get("steps", 8)):
        step()
        stats = h.last_stats
        assert stats is not None
        entry = entry_for(h.plan.shape_plans, h.last_shape)
        session = introspect.session(h)
        planned.append(
            {
                "modes": [m.name for m in h.modes],
                "own": h.modes == h.plan.modes_for(h.last_shape, n),
                "predicted": entry.predicted_peak_bytes if entry is not None else h.plan.predicted_peak_bytes,
                "peak": stats.saved_peak_bytes,
                "correction": session.controller.correction(h.last_shape.seq_len) if session else None,
            }
        )
    result = {
        "case": config,
        "rank": rank,
        "blocks": n,
        "in_flight": list(introspect.cycle(h).setup.in_flight(n)),
        "found_schedule": found,
        "static_peaks": static_peaks,
        "budget": h.budget_bytes,
        "planned": planned,
        "errors": introspect.cycle(h).errors,
    }
    h.close()
    return result


if __name__ == "__main__":
    run_cases(run_case)
