"""rematd against what GPU users run today, on Hugging Face models: step time and allocator peaks.

    python -m bench.gpu                  # on a GPU: GPT-2 (24 x 1024, batch 8 x 1024) and a Llama-style model
    python -m bench.gpu --quick          # tiny models on the CPU, about a minute: keeps the code working

Models are built from configs with random weights (nothing downloaded):
``GPT2LMHeadModel`` (SDPA attention) and ``LlamaForCausalLM``. Every
strategy runs in its own process (a fresh allocator and fresh caches):
no checkpointing, Hugging Face's own checkpointing of every block,
every 2nd and 3rd block checkpointed, torchtitan's per-op selective
checkpointing around every block (``titan-selective``, where torchtitan is
installed), and rematd at budgets of static
memory plus 10-90% of the activations (what a step adds over static memory
without checkpointing). More strategies (compiled ones) plug in through
:func:`register` from a module named with ``--plugin``.

Per run: the median step time (CUDA-synchronised), the largest per-step
``torch.cuda.max_memory_allocated()``, the steps over budget, and for
rematd the planner's predicted peak and overhead next to the measured ones.
Then an adaptive scenario: the sequence length drawn per step, the budget
enforced with ``torch.cuda.set_per_process_memory_fraction`` so that
crossing it is a real out-of-memory error; OOMs and tokens/s counted.

On the CPU (``--quick``) there is no allocator to read: peaks are rematd's
count of bytes saved for backward where rematd is attached, and budgets are
fractions of those bytes. JSON and a Markdown table go under ``artifacts/``.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import torch

from bench.gpu_measure import run_in_process, run_job, worker
from bench.gpu_models import FULL_MODELS, QUICK_MODELS, Job, ModelSpec, build, layers
from bench.gpu_report import adaptive, budgets_table, markdown
from bench.gpu_strategies import STRATEGIES, Context, register

__all__ = [
    "FULL_MODELS",
    "QUICK_MODELS",
    "STRATEGIES",
    "Context",
    "Job",
    "ModelSpec",
    "adaptive",
    "budgets_table",
    "build",
    "layers",
    "main",
    "markdown",
    "register",
    "run_in_process",
    "run_job",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models on the CPU (a smoke run, about a minute)")
    parser.add_argument("--out", default="artifacts/bench-gpu.json", help="the JSON; the Markdown table beside it")
    parser.add_argument("--models", default="", help="comma-separated model names (default: all)")
    parser.add_argument("--budgets", default="", help="comma-separated fractions of the activations")
    parser.add_argument("--margin", type=float, default=0.1, help="rematd's margin_ratio")
    parser.add_argument("--modes", default="", help="rematd's modes, comma-separated (default: rematd's default)")
    parser.add_argument("--steps", type=int, default=0, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=0, help="steps before measuring (rematd's plan settles)")
    parser.add_argument("--adaptive-steps", type=int, default=0)
    parser.add_argument("--no-adaptive", action="store_true")
    parser.add_argument("--plugin", action="append", default=[], help="a module that registers more strategies")
    parser.add_argument(
        "--strategies", default="", help="comma-separated static strategies (default: all; no checkpointing always)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a worker process may take")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for p in args.plugin:
        importlib.import_module(p)
    if args.worker:
        worker(args.worker)
        return
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"--strategies: {unknown} not among {sorted(STRATEGIES)}")
    cuda = torch.cuda.is_available() and not args.quick
    models: tuple[ModelSpec, ...] = QUICK_MODELS[:1] if args.quick else FULL_MODELS
    if args.models:
        models = QUICK_MODELS if args.quick else FULL_MODELS
        wanted = set(args.models.split(","))
        models = tuple(m for m in models if m.name in wanted)
        if not models:
            raise SystemExit(f"--models: none of {sorted(wanted)} is a model of this run")
    fracs = [float(f) for f in args.budgets.split(",")] if args.budgets else [0.1, 0.3, 0.5, 0.7, 0.9]
    if args.quick and not args.budgets:
        fracs = [0.3, 0.9]
    base = Job(
        model=models[0],
        strategy="none",
        steps=args.steps or (3 if args.quick else 20),
        warmup=args.warmup or (2 if args.quick else 10),
        margin=args.margin,
        modes=[m for m in args.modes.split(",") if m],
    )

    def run(jobs: list[Job]) -> list[dict[str, Any]]:
        return run_in_process(jobs, cpu=not cuda, plugins=args.plugin, timeout=args.timeout)

    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    report: dict[str, Any] = {"device": device, "torch": torch.__version__, "quick": args.quick, "models": []}
    for spec in models:
        print(f"{spec.name} ...", flush=True)
        report["models"].append(budgets_table(spec, fracs, run, base, cuda, strategies))
    if not args.no_adaptive:
        spec = models[0]
        steps = args.adaptive_steps or (6 if args.quick else 85)
        print(f"adaptive, {spec.name} ...", flush=True)
        report["adaptive"] = adaptive(spec, run, base, cuda, steps, 8 if args.quick else 256)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    table = markdown(report)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
