"""What the compress mode costs in quality, bytes and time: exact training against every block compressed.

    python -m bench.compress              # a small GPT and a tiny transformers Llama, 300 steps each (CPU)
                                          # of 4 sequences of 64 tokens, one thread
    python -m bench.compress --quick      # smaller, 12 steps: a smoke run

Each model trains from the same initial weights on the same fixed synthetic
batches (a fixed random Markov chain: the loss falls smoothly towards its
entropy), once per mode, the runs stepping in turn so that a busy machine slows
them alike: every block storing (exact), every block recomputing, and every
block compressed in each format. Per format it prints the bytes saved for
backward at the step's peak against storing, the first step's gradient
error against storing (relative, ``|g_c - g| / |g|``, and cosine), the
relative difference of the final loss (mean of the last tenth of the steps),
and the median step time against storing and against recomputing. Writes
JSON (``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from bench.common import freed_memory_kept, gpt, malloc_argument, table, write_json
from rematd import client
from rematd.client.demo.tiny_gpt import lm_loss
from rematd.planner import Mode

VOCAB = 256
FORMATS = ("int8", "fp8", "bf16")
RUNS = ("store", "recompute", *FORMATS)
MODES = {"store": Mode.STORE, "recompute": Mode.RECOMPUTE}
WARMUP = 3
"""Steps left out of the timing table's medians."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """The workload of one model."""

    batch: int
    seq: int
    steps: int
    batches: int = 16
    """Distinct batches, cycled through (as many as the steps: the loss measures the chain, not a memorised
    set of batches)."""


def markov_batches(setup: Setup, seed: int = 0) -> list[torch.Tensor]:
    """Sequences of a fixed random Markov chain, each token followed by one of 8 (unevenly likely): the loss
    falls smoothly towards the chain's entropy instead of to zero, so runs can be compared where they end."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 8), generator=gen)
    weights = torch.rand(VOCAB, 8, generator=gen) ** 2
    out = []
    for _ in range(setup.batches):
        tokens = [torch.randint(0, VOCAB, (setup.batch,), generator=gen)]
        for _ in range(setup.seq):
            pick = torch.multinomial(weights[tokens[-1]], 1, generator=gen).squeeze(1)
            tokens.append(successors[tokens[-1], pick])
        out.append(torch.stack(tokens, dim=1))
    return out


def tiny_llama(quick: bool, width: int = 128) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64 if quick else width,
        intermediate_size=128 if quick else 3 * width,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def small_gpt(quick: bool, width: int = 128) -> nn.Module:
    return gpt(n_layer=2 if quick else 4, d_model=64 if quick else width, n_head=4, seed=0)


def gpt_loss(model: nn.Module, data: torch.Tensor) -> torch.Tensor:
    return lm_loss(model, data)


def hf_loss(model: nn.Module, data: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=data, labels=data).loss
    return loss


@dataclass(slots=True)
class Run:
    """One mode's copy of the model, trained step by step."""

    mode: str
    model: nn.Module
    handle: client.Handle
    opt: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)

    def step(self, loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor], data: torch.Tensor) -> None:
        began = time.perf_counter()
        loss = loss_fn(self.model, data)
        loss.backward()
        self.opt.step()  # the handle's step follows through its hook
        self.opt.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - began)
        self.losses.append(float(loss.detach()))
        stats = self.handle.last_stats
        self.peaks.append(stats.saved_peak_bytes if stats is not None else 0)


def start(mode: str, build: Callable[[], nn.Module], loss_fn: Callable[..., torch.Tensor], data: torch.Tensor) -> Run:
    """A fresh copy attached, profiled on ``data`` (every block stores there), then pinned to ``mode``."""
    model = build()
    fmt = mode if mode in FORMATS else "int8"
    h = client.attach(model, budget_bytes=2**50, modes=["store", "recompute", "compress"], compress=fmt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    h.optimizer = opt
    loss_fn(model, data).backward()
    h.step()
    model.zero_grad(set_to_none=True)
    h.pin_modes("compress" if mode in FORMATS else mode)
    return Run(mode, model, h, opt)


def first_gradients(run: Run, loss_fn: Callable[..., torch.Tensor], data: torch.Tensor) -> torch.Tensor:
    """The gradient of the first batch at the initial weights, flattened (no optimizer step)."""
    loss_fn(run.model, data).backward()
    run.handle.step()
    grads = torch.cat([p.grad.flatten() for p in run.model.parameters() if p.grad is not None])
    run.model.zero_grad(set_to_none=True)
    return grads


def block_bytes(run: Run) -> int:
    """What the blocks keep in the run's mode, as its profile measured it (the model's head and loss apart)."""
    mode = Mode.COMPRESS if run.mode in FORMATS else MODES[run.mode]
    return sum(next(c.kept.bytes for c in b.measure.modes if c.mode == mode) for b in run.handle._blocks if b.measure)


def summary(runs: dict[str, Run], grads: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    store, recompute = runs["store"], runs["recompute"]
    tail = max(1, len(store.losses) // 10)

    def final(r: Run) -> float:
        return statistics.fmean(r.losses[-tail:])

    rows = []
    for fmt in FORMATS:
        # In float64: a float32 cosine of vectors this long strays past 1 by rounding alone.
        r, g, g0 = runs[fmt], grads[fmt].double(), grads["store"].double()
        rows.append(
            {
                "format": fmt,
                "bytes_vs_store": max(r.peaks) / max(store.peaks),
                "block_bytes_vs_store": block_bytes(r) / block_bytes(store),
                "grad_rel_error": float((g - g0).norm() / g0.norm()),
                "grad_cosine": float(torch.nn.functional.cosine_similarity(g, g0, dim=0)),
                "final_loss": final(r),
                "exact_final_loss": final(store),
                "final_loss_rel_diff": abs(final(r) - final(store)) / final(store),
                "max_loss_diff": max(abs(a - b) for a, b in zip(r.losses, store.losses, strict=True)),
                "time_vs_store": statistics.median(r.times) / statistics.median(store.times),
                "time_vs_recompute": statistics.median(r.times) / statistics.median(recompute.times),
            }
        )
    return rows


def bench_time(
    build: Callable[[], nn.Module], loss_fn: Callable[..., torch.Tensor], setup: Setup
) -> list[dict[str, Any]]:
    """Step times only, per format against storing and recomputing: the runs step in turn; the first
    steps (the kernels' compiling among them) are left out of the medians."""
    data = markov_batches(setup)
    runs = {mode: start(mode, build, loss_fn, data[0]) for mode in RUNS}
    for step in range(setup.steps + WARMUP):
        order = list(runs.values())[:: -1 if step % 2 else 1]
        for r in order:
            r.step(loss_fn, data[step % len(data)])
    median = {m: statistics.median(r.times[WARMUP:]) for m, r in runs.items()}
    return [
        {
            "format": fmt,
            "step_ms": 1e3 * median[fmt],
            "store_ms": 1e3 * median["store"],
            "time_vs_store": median[fmt] / median["store"],
            "time_vs_recompute": median[fmt] / median["recompute"],
        }
        for fmt in FORMATS
    ]


def bench_model(
    name: str, build: Callable[[], nn.Module], loss_fn: Callable[..., torch.Tensor], setup: Setup
) -> dict[str, Any]:
    data = markov_batches(setup)
    runs = {mode: start(mode, build, loss_fn, data[0]) for mode in RUNS}
    grads = {mode: first_gradients(r, loss_fn, data[0]) for mode, r in runs.items()}
    for step in range(setup.steps):
        order = list(runs.values())
        if step % 2:
            order.reverse()  # neither end of the round is always the one a busy machine slows
        for r in order:
            r.step(loss_fn, data[step % len(data)])
    rows = summary(runs, grads)
    return {
        "model": name,
        "setup": asdict(setup),
        "rows": rows,
        "store_peak_bytes": max(runs["store"].peaks),
        "median_step_s": {m: statistics.median(r.times) for m, r in runs.items()},
        "losses": {m: r.losses for m, r in runs.items()},
    }


COLUMNS = [
    ("format", "format", ""),
    ("bytes_vs_store", "step bytes/store", ".3f"),
    ("block_bytes_vs_store", "block bytes/store", ".3f"),
    ("grad_rel_error", "grad rel err", ".4f"),
    ("grad_cosine", "grad cos", ".6f"),
    ("final_loss_rel_diff", "final loss diff", ".5f"),
    ("time_vs_store", "time/store", ".3f"),
    ("time_vs_recompute", "time/recompute", ".3f"),
]


TIME_COLUMNS = [
    ("format", "format", ""),
    ("store_ms", "store ms", ".1f"),
    ("step_ms", "step ms", ".1f"),
    ("time_vs_store", "time/store", ".3f"),
    ("time_vs_recompute", "time/recompute", ".3f"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, 12 steps (smoke run)")
    parser.add_argument("--steps", type=int, default=0, help="training steps per run (default 300; 12 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier timings)")
    parser.add_argument("--width", type=int, default=128, help="the models' width (default 128)")
    parser.add_argument("--models", default="gpt,llama", help="which models, comma-separated (default gpt,llama)")
    parser.add_argument(
        "--time-width", type=int, default=512, help="width of the models in the timing table (default 512; 0: none)"
    )
    parser.add_argument("--time-steps", type=int, default=0, help="timed steps per run (default 30; 4 with --quick)")
    parser.add_argument("--out", default="artifacts/bench-compress.json")
    malloc_argument(parser)
    args = parser.parse_args()
    malloc_kept = freed_memory_kept(args)
    torch.set_num_threads(args.threads)
    steps = args.steps or (12 if args.quick else 300)
    setup = Setup(batch=4, seq=64, steps=steps, batches=steps)
    builders = {
        "gpt": (lambda: small_gpt(args.quick, args.width), gpt_loss),
        "llama": (lambda: tiny_llama(args.quick, args.width), hf_loss),
    }
    models = [(name, *builders[name]) for name in args.models.split(",")]
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "freed_memory_kept": malloc_kept,
        "models": [],
    }
    for name, build, loss_fn in models:
        began = time.perf_counter()
        result = bench_model(name, build, loss_fn, setup)
        report["models"].append(result)
        took = time.perf_counter() - began
        print(f"\n{name}: width {args.width}, batch {setup.batch}, seq {setup.seq}, {steps} steps ({took:.0f} s)")
        print(table(result["rows"], COLUMNS), flush=True)
    if args.time_width:
        time_setup = Setup(batch=4, seq=64, steps=args.time_steps or (4 if args.quick else 30), batches=8)
        wide = {
            "gpt": (lambda: small_gpt(False, args.time_width), gpt_loss),
            "llama": (lambda: tiny_llama(False, args.time_width), hf_loss),
        }
        report["timing"] = {"width": args.time_width, "setup": asdict(time_setup), "models": {}}
        for name, _, _ in models:
            build, loss_fn = wide[name]
            rows = bench_time(build, loss_fn, time_setup)
            report["timing"]["models"][name] = rows
            print(f"\n{name}: step time at width {args.time_width}, batch {time_setup.batch}, seq {time_setup.seq}")
            print(table(rows, TIME_COLUMNS), flush=True)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
