"""rematd on a real GPU: device memory held under a budget, against static checkpointing.

    python -m bench.gpu                      # GPT, 16 blocks, d_model 1024, batch 4, seq up to 2048
    python -m bench.gpu --layers 4 --quick   # a smoke run

Needs a CUDA device. Peaks are the caching allocator's peak allocated bytes of
each step (weights, gradients and optimizer state included), read by rematd's
own CUDA memory source; the budget is set on that same quantity. Strategies
run one after another on a fresh model (they would otherwise share the
device's allocated bytes); step times are medians of each strategy's steps.

1. One length: for budgets between the peak of full recomputation and that of
   none, each strategy's median step time as a ratio to no checkpointing, its
   largest peak and whether it fits; rematd's plan.
2. Lengths drawn per step: rematd against full recomputation and against a
   static plan sized for the longest length, at one budget; steps over it.
3. What rematd's memory sample costs per step (CUDA calls only).

Prints tables; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import MiB, gpt, table, write_json
from rematd import client
from rematd.client.memory import CudaMemory
from rematd.client.models import lm_loss
from rematd.planner import Mode

LETTERS = {Mode.STORE: ".", Mode.SELECTIVE: "s", Mode.RECOMPUTE: "R", Mode.OFFLOAD: "O"}


@dataclass(slots=True)
class Run:
    """One strategy's measured steps."""

    name: str
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    modes: str = ""
    plans: int = 0


def tokens(batch: int, seq: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq + 1), generator=g).to(device)


def train(
    name: str,
    args: argparse.Namespace,
    seqs: list[int],
    budget: int,
    pinned: list[Mode] | str | None,
    device: torch.device,
) -> Run:
    """Fresh model and optimizer; the first step is rematd's profiling step and is not measured."""
    model = gpt(args.layers, args.d_model, args.heads, max_seq_len=args.max_seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    h = client.attach(model, budget_bytes=budget, optimizer=opt)
    run = Run(name)
    for i, seq in enumerate([seqs[0], *seqs]):
        if i == 1 and pinned is not None:
            h.pin_modes(pinned if isinstance(pinned, list) else [Mode[pinned.upper()]] * len(h.modes))
        data = tokens(args.batch, seq, i, device)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        lm_loss(model, data).backward()
        opt.step()  # h.step() runs after it, reading and resetting the allocator's peak
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        if i and h.last_memory is not None:
            run.times.append(time.perf_counter() - start)
            run.peaks.append(h.last_memory.peak_allocated_bytes)
    run.modes = "".join(LETTERS[m] for m in h.modes)
    run.plans = len(h.history)
    h.close()
    del model, opt
    torch.cuda.empty_cache()
    return run


def one_length(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    seqs = [args.max_seq] * args.steps
    roomy = 2**50
    static = {name: train(name, args, seqs, roomy, name, device) for name in ("store", "recompute")}
    every2 = [Mode.RECOMPUTE if i % 2 == 0 else Mode.STORE for i in range(args.layers)]
    static["every-2nd"] = train("every-2nd", args, seqs, roomy, every2, device)
    none_peak, full_peak = max(static["store"].peaks), max(static["recompute"].peaks)
    base = statistics.median(static["store"].times)
    rows = []
    for frac in args.fractions:
        budget = int(full_peak + frac * (none_peak - full_peak))
        ours = train("rematd", args, seqs, budget, None, device)
        fitting = {k: v for k, v in static.items() if max(v.peaks) <= budget}
        best = min(fitting.items(), key=lambda kv: statistics.median(kv[1].times)) if fitting else None
        rows.append(
            {
                "budget_frac": frac,
                "budget_mib": budget / MiB,
                "rematd_ratio": statistics.median(ours.times) / base,
                "rematd_peak_mib": max(ours.peaks) / MiB,
                "rematd_over": sum(p > budget for p in ours.peaks),
                "rematd_modes": ours.modes,
                "full_ratio": statistics.median(static["recompute"].times) / base,
                "every2_ratio": statistics.median(static["every-2nd"].times) / base,
                "every2_fits": max(static["every-2nd"].peaks) <= budget,
                "best_static": (best[0] if best else "none fits"),
                "best_static_ratio": statistics.median(best[1].times) / base if best else None,
            }
        )
        print(f"  budget {frac:.0%} of the way from full to none: rematd {rows[-1]['rematd_ratio']:.3f}x", flush=True)
    return {
        "none_peak_mib": none_peak / MiB,
        "full_peak_mib": full_peak / MiB,
        "every2_peak_mib": max(static["every-2nd"].peaks) / MiB,
        "none_step_s": base,
        "rows": rows,
    }


def lengths(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rng = random.Random(0)
    seqs = [rng.choice(range(args.max_seq // 8, args.max_seq + 1, args.max_seq // 16)) for _ in range(args.steps * 3)]
    longest = [args.max_seq] * 4
    none_long = max(train("store", args, longest, 2**50, "store", device).peaks)
    full_long = max(train("recompute", args, longest, 2**50, "recompute", device).peaks)
    budget = int(full_long + 0.4 * (none_long - full_long))
    # The static plan for the longest length: what rematd settles on when every step is that long.
    sized = train("rematd", args, [args.max_seq] * 12, budget, None, device)
    modes = [next(m for m, letter in LETTERS.items() if letter == c) for c in sized.modes]
    runs = {
        "rematd": train("rematd", args, seqs, budget, None, device),
        "full": train("full", args, seqs, budget, "recompute", device),
        "static-longest": train("static-longest", args, seqs, budget, modes, device),
    }
    out: dict[str, Any] = {"budget_mib": budget / MiB, "steps": len(seqs), "static_longest_modes": sized.modes}
    for name, r in runs.items():
        over = sum(p > budget for p in r.peaks)
        out[name] = {"seconds": sum(r.times), "over": over, "max_peak_mib": max(r.peaks) / MiB, "plans": r.plans}
        print(
            f"  lengths {name:15s} {sum(r.times):7.2f} s, {over} steps over budget, peak {max(r.peaks) / MiB:.0f} MiB"
        )
    out["vs_full"] = out["full"]["seconds"] / out["rematd"]["seconds"]
    out["vs_static_longest"] = out["static-longest"]["seconds"] / out["rematd"]["seconds"]
    return out


def sample_cost(device: torch.device, n: int = 2000) -> float:
    source = CudaMemory(device)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        source.sample()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per strategy")
    parser.add_argument("--quick", action="store_true", help="few budgets and steps (smoke run)")
    parser.add_argument("--out", default="artifacts/bench-gpu.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the CPU benchmark is bench.strategies)")
    args.fractions = [0.1, 0.5] if args.quick else [0.0, 0.1, 0.25, 0.5, 0.75]
    if args.quick:
        args.steps = min(args.steps, 6)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    report: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device)}
    report["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    print(f"{report['device']}: {args.layers} blocks, d_model {args.d_model}, batch {args.batch}", flush=True)
    report["sample_us"] = sample_cost(device)
    print(f"rematd's CUDA memory sample: {report['sample_us']:.1f} µs per step (median)", flush=True)
    print(f"\none length ({args.max_seq}):", flush=True)
    report["one_length"] = one_length(args, device)
    r = report["one_length"]
    print(
        f"peaks: none {r['none_peak_mib']:.0f} MiB, every-2nd {r['every2_peak_mib']:.0f} MiB, "
        f"full {r['full_peak_mib']:.0f} MiB; no-checkpoint step {r['none_step_s'] * 1e3:.1f} ms\n"
    )
    cols = [
        ("budget_frac", "budget (full→none)", ".0%"),
        ("budget_mib", "MiB", ".0f"),
        ("rematd_ratio", "rematd", ".3f"),
        ("rematd_peak_mib", "peak MiB", ".0f"),
        ("rematd_over", "steps over", "d"),
        ("rematd_modes", "modes", ""),
        ("full_ratio", "full", ".3f"),
        ("every2_ratio", "every-2", ".3f"),
        ("best_static", "best static that fits", ""),
        ("best_static_ratio", "its ratio", ".3f"),
    ]
    print(table(r["rows"], cols))
    print(f"\nlengths drawn per step from {args.max_seq // 8}-{args.max_seq}:", flush=True)
    report["lengths"] = lengths(args, device)
    a = report["lengths"]
    print(
        f"throughput vs full recomputation {a['vs_full']:.3f}x; "
        + f"vs the plan for the longest {a['vs_static_longest']:.3f}x"
    )
    write_json(args.out, report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
