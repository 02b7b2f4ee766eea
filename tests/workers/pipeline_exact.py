"""One rank of the pipeline tests: the same model split into stages and trained by a plain schedule and by a
schedule rematd is attached to, side by side.

``REMATD_CONFIG``: a list of cases, run one after another in the same processes. Each says ``split``
(``titan``: Llama with layers deleted per stage; ``hand``: GPT-2 sliced by hand), ``schedule`` (``gpipe``,
``1f1b``, ``interleaved``: two stages per rank), ``counts`` (layers per stage), ``microbatches``, ``steps``, and
the parallelism inside a stage: ``inner`` (``tp`` or ``fsdp`` over 2 ranks a stage, or none). ``pinned``: each
step pins per-stage modes that switch; ``budgets``: a budget per rank of a stage instead, so that the ranks of a
stage plan differently. Written per step: this rank's modes and own plan, bitwise equality with the plain
pipeline, the collectives each issued, and which blocks ran again in backward.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor.parallel import parallelize_module

from bench.collectives import counting
from bench.pipeline_models import gpt2, hand_stage, llama, loss_fn, titan_stage
from rematd import client
from rematd.client import introspect
from rematd.planner import Mode
from tests.model_matrix import Rematerialised
from tests.workers.fsdp_exact import all_equal
from tests.workers.fsdp_tp import TP_PLAN
from tests.workers.rank import run_cases

VOCAB = 64
CYCLE = (Mode.RECOMPUTE, Mode.SELECTIVE, Mode.STORE)


def build_stages(config: dict[str, Any], indices: list[int], mesh: Any) -> list[nn.Module]:
    counts = config["counts"]
    if config.get("split", "titan") == "titan":
        whole: Any = llama(sum(counts))
        modules: list[nn.Module] = [titan_stage(whole, i, counts) for i in indices]
    else:
        whole = gpt2(sum(counts))
        modules = [hand_stage(whole, i, counts) for i in indices]
    for m in modules:
        blocks = list(m.layers.values()) if hasattr(m, "layers") else list(m.blocks)
        if config.get("inner") == "tp":
            for layer in blocks:
                parallelize_module(layer, mesh["in"], TP_PLAN)
        elif config.get("inner") == "fsdp":
            for layer in blocks:
                fully_shard(layer, mesh=mesh["in"])
            fully_shard(m, mesh=mesh["in"])
    return modules


def schedule_for(config: dict[str, Any], stages: list[PipelineStage]) -> Any:
    n = config.get("microbatches", 4)
    kind = config["schedule"]
    if kind == "interleaved":
        return ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn)
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return cls(stages[0], n, loss_fn=loss_fn)


def pins(step: int, stage_of: list[int]) -> list[Mode] | None:
    """Per-stage modes that switch every step (none at the profiling step)."""
    if step == 0:
        return None
    return [CYCLE[(step + i + 2 * stage) % len(CYCLE)] for i, stage in enumerate(stage_of)]


def run_step(schedule: Any, stages: list[PipelineStage], batch: torch.Tensor, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    losses: list[torch.Tensor] = []
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    kwargs: dict[str, Any] = {"target": batch, "losses": losses} if last else {}
    if first:
        schedule.step(batch, **kwargs)
    else:
        schedule.step(**kwargs)
    return [loss.detach() for loss in losses]


def run_case(config: dict[str, Any], rank: int) -> dict[str, Any]:
    world = torch.distributed.get_world_size()
    inner = 2 if config.get("inner") else 1
    pp = world // inner
    mesh = init_device_mesh("cpu", (pp, inner), mesh_dim_names=("pp", "in"))
    pp_rank, in_rank = mesh["pp"].get_local_rank(), mesh["in"].get_local_rank()
    per_rank = 2 if config["schedule"] == "interleaved" else 1
    indices = [pp_rank + k * pp for k in range(per_rank)]
    pp_group = mesh["pp"].get_group()
    num_stages = pp * per_rank
    pair = []
    for _ in ("plain", "rematd"):
        modules = build_stages(config, indices, mesh)
        stages = [
            PipelineStage(m, i, num_stages, torch.device("cpu"), group=pp_group)
            for m, i in zip(modules, indices, strict=True)
        ]
        opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-2)
        pair.append((modules, stages, schedule_for(config, stages), opt))
    (ref_modules, ref_stages, ref_schedule, ref_opt), (modules, stages, schedule, opt) = pair
    budget = config["budgets"][in_rank] if "budgets" in config else None
    h = client.attach(schedule, optimizer=opt, budget_bytes=budget, job="pipeline")
    named = dict(h.model.named_modules())
    blocks = [named[n] for n in h.blocks]
    stage_of = [
        next(i for i, m in zip(indices, modules, strict=True) if any(b is x for x in m.modules())) for b in blocks
    ]
    counter = Rematerialised(blocks)
    rows: list[dict[str, Any]] = []
    microbatch = config.get("microbatch", 2)
    for step in range(config.get("steps", 6)):
        if config.get("pinned"):
            pinned = pins(step, stage_of)
            if pinned is not None:
                h.pin_modes(pinned)
        gen = torch.Generator().manual_seed(1000 * (in_rank if config.get("inner") == "fsdp" else 0) + step)
        batch = torch.randint(0, VOCAB, (config.get("microbatches", 4) * microbatch, 16), generator=gen)
        comms, losses = [], []
        began = time.perf_counter()
        for sched, sts, _o in ((ref_schedule, ref_stages, ref_opt), (schedule, stages, opt)):
            with counting() as counts:
                losses.append(run_step(sched, sts, batch, 100 + step))
            comms.append(dict(counts))
        grads_equal = all_equal(
            (p.grad, q.grad)
            for a, b in zip(ref_modules, modules, strict=True)
            for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        params_equal = all_equal(
            (p, q)
            for a, b in zip(ref_modules, modules, strict=True)
            for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )
        rows.append(
            {
                "modes": [m.name for m in h.modes],
                "own": [m.name for m in h.plan.modes_for(h.last_shape, len(h.blocks))],
                "loss_equal": all(torch.equal(a, b) for a, b in zip(losses[0], losses[1], strict=True)),
                "losses": len(losses[1]),
                "grads_equal": grads_equal,
                "params_equal": params_equal,
                "plain_comms": comms[0],
                "rematd_comms": comms[1],
                "rerun": counter.take(),
                "seconds": time.perf_counter() - began,
            }
        )
    agreement = introspect.cycle(h).setup.agreement
    result = {
        "case": config,
        "rank": rank,
        "stages": indices,
        "stage_of": stage_of,
        "blocks": h.blocks,
        "steps": rows,
        "step_count": h.step_count,
        "errors": introspect.cycle(h).errors,
        "adopted": agreement.adopted if agreement is not None else -1,
        "agreement": agreement.describe() if agreement is not None else None,
        "in_flight": list(introspect.cycle(h).setup.in_flight(len(h.blocks))),
    }
    counter.remove()
    h.close()
    return result


if __name__ == "__main__":
    run_cases(run_case)
