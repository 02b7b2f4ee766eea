"""Pipeline parallel: rematd's per-stage plans against the same static checkpointing on every stage.

``python -m bench.pipeline`` splits a stock Llama in two stages torchtitan's way (layers deleted per stage) and
trains it under ``Schedule1F1B`` on two ranks (gloo on the CPU, nccl with ``--device cuda``): the first stage
holds two microbatches at once, the last one. One budget for both stages, ``--between`` of the way from the
first stage's peak with every block recomputed to its peak with none. Contenders, taking turns in rounds:

- ``none``: no checkpointing (over the budget on the first stage);
- ``full``: every block recomputed on every stage (torchtitan's full activation checkpointing);
- ``static``: the same static plan on every stage, the first k blocks recomputed, with the least k that keeps
  every stage under the budget (torchtitan's way: one setting for all stages);
- ``rematd``: rematd's own plan on each stage, under the same budget.

It prints each contender's plans, its step time (median of the rounds' means), the throughput against
``static``, and each stage's measured peak (bytes saved for backward on the CPU, the allocator's peak on CUDA).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

MiB = 2**20
CONTENDERS = ("none", "full", "static", "rematd")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="layers in all, split evenly over the two stages")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--between", type=float, default=0.5, help="the budget, from all recomputed (0) to none (1)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    p.add_argument("--warmup", type=int, default=12, help="steps rematd plans before the rounds")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="bench/results/pipeline.json")
    p.add_argument("--quick", action="store_true", help="a small model and few steps (a smoke test)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq, args.rounds, args.steps, args.warmup = 4, 32, 32, 1, 1, 10
    args.ranks = 2
    return args


class Stage:
    """This rank's stage: the schedule, rematd's handle on it, and a step that measures what it asks."""

    def __init__(self, args: argparse.Namespace, rank: int, device: torch.device) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from bench.pipeline_models import llama, loss_fn, titan_stage
        from rematd import client

        counts = [args.layers // 2, args.layers - args.layers // 2]
        self.module = titan_stage(llama(args.layers, width=args.hidden, dropout=0.0), rank, counts).to(device)
        stage = PipelineStage(self.module, rank, 2, device)
        self.schedule = Schedule1F1B(stage, args.microbatches, loss_fn=loss_fn)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-4)
        self.h = client.attach(self.schedule, optimizer=self.opt, modes=["recompute"], job="bench-pipeline")
        self.rank, self.device = rank, device
        gen = torch.Generator().manual_seed(0)
        batch = args.microbatches * args.microbatch
        self.batch = torch.randint(0, 64, (batch, args.seq), generator=gen).to(device)

    def step(self) -> tuple[float, int]:
        """One training step: its seconds and this stage's peak."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        if self.rank == 0:
            self.schedule.step(self.batch)
        else:
            self.schedule.step(target=self.batch, losses=[])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        stats = self.h.last_stats
        assert stats is not None
        return seconds, stats.peak_allocated_bytes if cuda else stats.saved_peak_bytes


def _all(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from rematd.planner import Mode
    from rematd.planner.plan import entry_for

    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    stage = Stage(args, rank, device)
    h = stage.h
    n = len(h.blocks)
    stage.step()  # profiling
    first_k = [[Mode.RECOMPUTE] * k + [Mode.STORE] * (n - k) for k in range(n + 1)]
    peaks = []
    for modes in first_k:
        h.pin_modes(modes)
        peaks.append(stage.step()[1])
    everyone = _all(peaks)
    low, high = everyone[0][n], everyone[0][0]  # the first stage: all recomputed, none
    budget = int(low + args.between * (high - low))
    fits = [k for k in range(n + 1) if all(p[k] <= budget for p in everyone)]
    k = min(fits) if fits else n
    h.pin_modes(None)
    h.budget_bytes = int(budget / (1 - h.margin_ratio)) if device.type == "cpu" else budget
    for _ in range(args.warmup):
        stage.step()
    pins: dict[str, Any] = {"none": "store", "full": "recompute", "static": first_k[k], "rematd": None}
    seconds: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    stage_peaks: dict[str, int] = dict.fromkeys(CONTENDERS, 0)
    plans: dict[str, str] = {}
    predicted = 0
    for _ in range(args.rounds):
        for name in CONTENDERS:
            h.pin_modes(pins[name])
            stage.step()  # the switch
            times = []
            for _ in range(args.steps):
                t, peak = stage.step()
                times.append(t)
                stage_peaks[name] = max(stage_peaks[name], peak)
            seconds[name].append(statistics.mean(times))
            plans[name] = "".join("R" if m is Mode.RECOMPUTE else "." for m in h.modes)
            if name == "rematd":
                entry = entry_for(h.plan.shape_plans, h.last_shape)
                predicted = max(predicted, entry.predicted_peak_bytes if entry else h.plan.predicted_peak_bytes)
    result = {
        "rank": rank,
        "device": str(device),
        "blocks": n,
        "in_flight": list(h._cycle.setup.in_flight(n)),
        "first_k_peaks": peaks,
        "budget": budget,
        "static_k": k,
        "seconds": seconds,
        "peaks": stage_peaks,
        "plans": plans,
        "predicted": predicted,
    }
    h.close()
    dist.destroy_process_group()
    return result


def report(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> str:
    r0 = ranks[0]
    lines = [
        f"Pipeline, 2 stages x {args.layers // 2} Llama layers x {args.hidden} on {r0['device']}, Schedule1F1B, "
        f"{args.microbatches} microbatches of {args.microbatch} x {args.seq} (in flight: stage 0 "
        f"{r0['in_flight'][0]}, stage 1 {ranks[1]['in_flight'][0]}); budget {r0['budget'] / MiB:.2f} MiB a stage; "
        f"static: the first {r0['static_k']} blocks recomputed on every stage",
        "",
        "| contender | stage 0 | stage 1 | step ms | throughput / static | peak stage 0 MiB | peak stage 1 MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    # A pipeline step lasts as long as its slowest stage: the ranks' means, the larger, per round.
    per_round = {c: [max(r["seconds"][c][i] for r in ranks) for i in range(args.rounds)] for c in CONTENDERS}
    for name in CONTENDERS:
        ratio = statistics.median(s / t for s, t in zip(per_round["static"], per_round[name], strict=True))
        lines.append(
            f"| {name} | `{ranks[0]['plans'][name]}` | `{ranks[1]['plans'][name]}` | "
            f"{1000 * statistics.median(per_round[name]):.1f} | {ratio:.3f} | "
            f"{ranks[0]['peaks'][name] / MiB:.2f} | {ranks[1]['peaks'][name] / MiB:.2f} |"
        )
    over = [r["rank"] for r in ranks if r["peaks"]["rematd"] > r["budget"]]
    predicted = ", ".join(
        f"stage {r['rank']} {r['predicted'] / MiB:.2f} MiB predicted, {r['peaks']['rematd'] / MiB:.2f} measured "
        f"({r['predicted'] / max(1, r['peaks']['rematd']):.3f})"
        for r in ranks
    )
    lines += ["", f"rematd's peaks: {predicted}; stages over the budget: {over or 'none'}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from bench.fsdp import run_bench

    run_bench("bench.pipeline", argv, parse, worker, report)


if __name__ == "__main__":
    main()
