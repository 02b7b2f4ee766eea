"""Compiled strategies against rematd with ``compile=True``, each with its compile time.

    python -m bench.compiled                          # CUDA: 24-block GPT, d_model 1024, batch 8 x 1024, bf16
    python -m bench.compiled --quick                  # CPU: 2 blocks, d_model 32, batch 2 x 16 (Inductor)
    python -m bench.compiled --quick --backend aot_eager   # a smoke run without Inductor's code generation

Strategies, each on a fresh model, one after another (``torch._dynamo.reset()``
between them):

- ``eager``: no checkpointing, not compiled (the reference for the ratios);
- ``block-none`` / ``block-full`` / ``block-every-2nd`` / ``block-selective``:
  every block compiled with its checkpoint inside the compiled region
  (torchtitan's order), one compiled function per kind shared by the blocks;
- ``whole-1.0`` / ``whole-0.5`` / ``whole-0.2``: ``torch.compile(model)`` with
  ``activation_memory_budget`` at that ratio (Inductor's min-cut partitioner;
  other backends ignore it);
- ``rematd``: ``attach(model, compile=...)``, one handle taken through every
  budget in turn (its variants compile once), the budgets being the peaks
  the other compiled strategies measured (each the budget at which that one
  just fits) and 90% of the smallest.

Peaks: on CUDA ``max_memory_allocated`` (what rematd's budget caps there); on
the CPU the bytes saved for backward (saved-tensor hooks; rematd adds what its
checkpoints rematerialise in backward, the static strategies do not).
Compile seconds: the first steps' wall time less as many steady steps (for
rematd also its own count, ``compile_stats``). ``--adaptive`` adds a run with a
sequence length drawn per step under a fixed budget: rematd against every block
compiled with full recomputation, tokens/s, out-of-memory errors, graphs compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.common import MiB, median, table, write_json
from bench.compiled_budget import at_report
from bench.compiled_setup import ADAPTIVE_LENGTHS, Meter, Setup, batch_of, build_model, setup_of, size_arguments, step
from rematd import client
from rematd.client.blocks.selective import compiled_selective_context
from rematd.client.demo.tiny_gpt import TinyGPT
from rematd.planner import letters

WHOLE_RATIOS = (1.0, 0.5, 0.2)


def _plain(m: nn.Module, x: torch.Tensor) -> Any:
    return type(m).forward(m, x)


def _full(m: nn.Module, x: torch.Tensor) -> Any:
    return checkpoint(type(m).forward, m, x, use_reentrant=False)


def _selective(m: nn.Module, x: torch.Tensor) -> Any:
    return checkpoint(type(m).forward, m, x, use_reentrant=False, context_fn=compiled_selective_context)


STATIC: dict[str, Callable[[int], Callable[..., Any]]] = {
    "block-none": lambda i: _plain,
    "block-full": lambda i: _full,
    "block-every-2nd": lambda i: _full if i % 2 == 0 else _plain,
    "block-selective": lambda i: _selective,
}


def compile_blocks(model: TinyGPT, kind: str, backend: str) -> None:
    """Each block's forward calls one compiled function per kind, shared by every block."""
    compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
    for i, block in enumerate(model.h):
        fn = STATIC[kind](i)
        if fn not in compiled:
            compiled[fn] = torch.compile(fn, backend=backend)
        block.forward = functools.partial(compiled[fn], block)  # type: ignore[method-assign]


def graphs_compiled() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def measure(setup: Setup, name: str) -> dict[str, Any]:
    """One static or whole-model strategy: steady step seconds, peak, compile seconds, graphs."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    model = build_model(setup)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    run: nn.Module = model
    patch: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if name in STATIC:
        compile_blocks(model, name, setup.backend)
    elif name.startswith("whole-"):
        patch = functorch_config.patch(activation_memory_budget=float(name.removeprefix("whole-")))
        run = torch.compile(model, backend=setup.backend)  # type: ignore[assignment]
    meter = Meter(setup, model)
    data = batch_of(setup)
    graphs = graphs_compiled()
    first: list[float] = []
    times: list[float] = []
    peaks: list[int] = []
    with patch:  # the partitioner reads the budget when it compiles: the first forward and backward
        for i in range(setup.warmup + setup.steps):
            seconds, peak = step(setup, run, opt, data, meter)
            (first if i < setup.warmup else times).append(seconds)
            if i >= setup.warmup:
                peaks.append(peak)
    steady = median(times)
    return {
        "strategy": name,
        "step_s": steady,
        "peak_mib": max(peaks) / MiB,
        "compile_s": max(0.0, sum(first) - steady * len(first)),
        "graphs": graphs_compiled() - graphs,
    }


def rematd_through(setup: Setup, budgets: list[int]) -> list[dict[str, Any]]:
    """One handle with compiled variants, taken through every budget in turn (tightest last)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build_model(setup)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    h = client.attach(model, compile=setup.backend, budget_bytes=max(budgets))
    meter = Meter(setup, model, h)
    data = batch_of(setup)
    rows = []
    start = time.perf_counter()
    for _ in range(2):  # profiling (eager), then every offered mode compiled ahead
        step(setup, model, opt, data, meter)
    first = time.perf_counter() - start
    for budget in sorted(budgets, reverse=True):
        h.budget_bytes = budget
        times, peaks = [], []
        for i in range(setup.warmup + setup.steps):
            seconds, peak = step(setup, model, opt, data, meter)
            if i >= setup.warmup:
                times.append(seconds)
                peaks.append(peak)
        stats = h.compile_stats
        assert stats is not None
        rows.append(
            {
                "strategy": "rematd",
                "budget_mib": budget / MiB,
                "step_s": median(times),
                "peak_mib": max(peaks) / MiB,
                "modes": letters(h.modes),
                "graphs": stats.graphs,
                "compile_s": stats.seconds,
                "first_steps_s": first,
            }
        )
    h.close()
    return rows


def adaptive(setup: Setup, budget: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """A length drawn per step under ``budget``: rematd with compiled variants against every block
    compiled with full recomputation."""
    import torch._dynamo

    lengths = [random.Random(seed + i).choice(ADAPTIVE_LENGTHS) for i in range(steps)]
    if setup.device != "cuda":
        lengths = [max(4, n * setup.seq // max(ADAPTIVE_LENGTHS)) for n in lengths]
    out: dict[str, Any] = {"budget_mib": budget / MiB, "lengths": sorted(set(lengths))}
    for name in ("block-full", "rematd"):
        torch._dynamo.reset()
        model = build_model(setup)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        h = None
        if name == "rematd":
            h = client.attach(model, compile=setup.backend, budget_bytes=budget)
        else:
            compile_blocks(model, name, setup.backend)
        meter = Meter(setup, model, h)
        graphs = graphs_compiled()
        ooms = 0
        start = time.perf_counter()
        done = 0
        for i, seq in enumerate(lengths):
            data = batch_of(setup, seq, seed=i)
            try:
                if h is not None:
                    h.run_step(step, setup, model, opt, data, meter)
                else:
                    step(setup, model, opt, data, meter)
                done += setup.batch * seq
            except torch.OutOfMemoryError:
                ooms += 1
                opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        out[name] = {
            "tokens_per_s": done / seconds,
            "ooms": ooms + (h.oom_count if h is not None else 0),
            "graphs": graphs_compiled() - graphs,
        }
        if h is not None:
            h.close()
    return out


def run(setup: Setup, *, with_adaptive: bool = False, adaptive_steps: int = 30) -> dict[str, Any]:
    results = [measure(setup, "eager")]
    for name in STATIC:
        results.append(measure(setup, name))
    for ratio in WHOLE_RATIOS:
        results.append(measure(setup, f"whole-{ratio}"))
    base = results[0]["step_s"]
    compiled = results[1:]
    peaks = sorted({r["peak_mib"] for r in compiled})
    budgets = [int(p * MiB) for p in peaks] + [int(min(peaks) * 0.9 * MiB)]
    ours = rematd_through(setup, budgets)
    for r in [*results, *ours]:
        r["ratio"] = r["step_s"] / base
    for row in ours:
        fitting = [r for r in compiled if r["peak_mib"] <= row["budget_mib"]]
        best = min(fitting, key=lambda r: r["step_s"]) if fitting else None
        row["fits"] = row["peak_mib"] <= row["budget_mib"]
        row["best_compiled"] = best["strategy"] if best else "none fits"
        row["vs_best"] = row["step_s"] / best["step_s"] if best else None
    payload: dict[str, Any] = {"setup": asdict(setup), "strategies": results, "rematd": ours}
    if with_adaptive:
        payload["adaptive"] = adaptive(setup, budgets[len(budgets) // 2], adaptive_steps)
    return payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size_arguments(parser)
    parser.add_argument("--adaptive", action="store_true", help="also the adaptive-length scenario")
    parser.add_argument("--out", default="bench/compiled.json")
    parser.add_argument(
        "--at", type=float, default=0.0, help="only rematd against torch.compile's budget at this fraction of eager's"
    )
    args = parser.parse_args()
    setup = setup_of(args)
    if args.at:
        at_report(setup, args.at, args.out)
        return
    payload = run(setup, with_adaptive=args.adaptive, adaptive_steps=8 if args.quick else 40)
    print(f"{setup}")
    print(
        table(
            payload["strategies"],
            [
                ("strategy", "strategy", "s"),
                ("step_s", "step s", ".4f"),
                ("ratio", "x eager", ".3f"),
                ("peak_mib", "peak MiB", ",.3f"),
                ("compile_s", "compile s", ".1f"),
                ("graphs", "graphs", "d"),
            ],
        )
    )
    print()
    print(
        table(
            payload["rematd"],
            [
                ("budget_mib", "budget MiB", ",.3f"),
                ("step_s", "rematd s", ".4f"),
                ("peak_mib", "peak MiB", ",.3f"),
                ("fits", "fits", ""),
                ("modes", "modes (. store, s selective, R recompute, O offload)", "s"),
                ("best_compiled", "fastest compiled that fits", "s"),
                ("vs_best", "x it", ".3f"),
                ("graphs", "graphs", "d"),
                ("compile_s", "compile s", ".1f"),
            ],
        )
    )
    if "adaptive" in payload:
        print("\nadaptive:", payload["adaptive"])
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
