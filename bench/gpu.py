"""rematd against what GPU users run today, on Hugging Face models: step time and allocator peaks.

    python -m bench.gpu                  # on a GPU: GPT-2 (24 x 1024, batch 8 x 1024) and a Llama-style model
    python -m bench.gpu --quick          # tiny models on the CPU, about a minute: keeps the code working

Models are built from configs with random weights (nothing downloaded):
``GPT2LMHeadModel`` (SDPA attention) and ``LlamaForCausalLM``. Every
strategy runs in its own process (a fresh allocator and fresh caches):
no checkpointing, Hugging Face's own checkpointing of every block,
every 2nd and 3rd block checkpointed, and rematd at budgets of static
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
import os
import random
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import MiB, median
from rematd import client
from rematd.planner import Mode

LETTERS = {Mode.STORE: ".", Mode.SELECTIVE: "s", Mode.RECOMPUTE: "R", Mode.OFFLOAD: "O"}


# -- models -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model of the benchmark and its workload."""

    name: str
    kind: str
    """``gpt2`` or ``llama``."""
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    batch: int
    seq: int
    max_seq: int
    ffn: int = 0
    """Llama's intermediate size (0: 8/3 of d_model, rounded to 64)."""
    dropout: float = 0.0


FULL_MODELS = (
    ModelSpec(
        name="gpt2-24x1024",
        kind="gpt2",
        n_layer=24,
        d_model=1024,
        n_head=16,
        vocab=50257,
        batch=8,
        seq=1024,
        max_seq=2048,
        dropout=0.1,
    ),
    ModelSpec(
        name="llama-16x2048",
        kind="llama",
        n_layer=16,
        d_model=2048,
        n_head=16,
        vocab=32000,
        batch=4,
        seq=1024,
        max_seq=2048,
        ffn=5504,
    ),
)
QUICK_MODELS = (
    ModelSpec(name="gpt2-tiny", kind="gpt2", n_layer=4, d_model=64, n_head=4, vocab=256, batch=2, seq=24, max_seq=32),
    ModelSpec(name="llama-tiny", kind="llama", n_layer=4, d_model=64, n_head=4, vocab=256, batch=2, seq=24, max_seq=32),
)


def _import_transformers() -> Any:
    """transformers, importing torchvision first where its compiled ops do not load next to torch's CPU
    build (the models need none of them: their two schemas are declared so the import goes through)."""
    try:
        import torchvision  # type: ignore[import-untyped]
    except ImportError:
        pass
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBS.append(lib)
        import torchvision  # type: ignore[import-untyped]  # noqa: F401
    import transformers

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    return transformers


_LIBS: list[object] = []


def build(spec: ModelSpec, device: torch.device, seed: int = 0) -> nn.Module:
    tf = _import_transformers()
    torch.manual_seed(seed)
    if spec.kind == "gpt2":
        cfg = tf.GPT2Config(
            n_layer=spec.n_layer,
            n_embd=spec.d_model,
            n_head=spec.n_head,
            vocab_size=spec.vocab,
            n_positions=spec.max_seq,
            resid_pdrop=spec.dropout,
            embd_pdrop=spec.dropout,
            attn_pdrop=spec.dropout,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = tf.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    elif spec.kind == "llama":
        ffn = spec.ffn or 64 * round(spec.d_model * 8 / 3 / 64)
        cfg = tf.LlamaConfig(
            hidden_size=spec.d_model,
            intermediate_size=ffn,
            num_hidden_layers=spec.n_layer,
            num_attention_heads=spec.n_head,
            num_key_value_heads=spec.n_head,
            vocab_size=spec.vocab,
            max_position_embeddings=spec.max_seq,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    else:
        raise ValueError(f"model kind must be gpt2 or llama, got {spec.kind!r}")
    return model.to(device).train()  # type: ignore[no-any-return]


def layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "transformer", None) or getattr(model, "model", None)
    found = getattr(inner, "h", None) or getattr(inner, "layers", None)
    if found is None:
        raise ValueError(f"no block list in {type(model).__name__}")
    return list(found)


# -- strategies ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Context:
    """What a strategy's set-up gets: the model, its optimizer, the job."""

    model: nn.Module
    opt: torch.optim.Optimizer
    job: Job
    handle: client.Handle | None = None
    """Set by rematd's strategy."""
    step_fn: Callable[[torch.Tensor], None] | None = None
    """Replaces the plain forward, backward and optimizer step, given the step's token ids, where the
    strategy needs to (a compiled model)."""


Setup = Callable[[Context], None]
STRATEGIES: dict[str, Setup] = {}


def register(name: str) -> Callable[[Setup], Setup]:
    """Add a strategy: ``setup(ctx)`` prepares ``ctx.model`` (or sets ``ctx.step_fn``) before the first step.
    Compiled strategies register from their own module, named with ``--plugin``."""

    def add(fn: Setup) -> Setup:
        STRATEGIES[name] = fn
        return fn

    return add


def _hf_checkpointing(model: nn.Module, every: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed in transformers 5; the old name still works
        enable: Callable[..., None] = getattr(model, "gradient_checkpointing_enable")  # noqa: B009
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(layers(model)):
        setattr(layer, "gradient_checkpointing", i % every == 0)  # noqa: B010 (a flag each HF layer reads)


@register("none")
def _none(ctx: Context) -> None:
    return None


@register("hf-full")
def _hf_full(ctx: Context) -> None:
    _hf_checkpointing(ctx.model, 1)


@register("every-2nd")
def _every2(ctx: Context) -> None:
    _hf_checkpointing(ctx.model, 2)


@register("every-3rd")
def _every3(ctx: Context) -> None:
    _hf_checkpointing(ctx.model, 3)


@register("rematd")
def _rematd(ctx: Context) -> None:
    job = ctx.job
    ctx.handle = client.attach(
        ctx.model,
        budget_bytes=job.budget_bytes or 2**50,
        optimizer=ctx.opt,
        margin_ratio=job.margin,
        modes=job.modes or None,
    )


# -- one job, in its own process ----------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Job:
    """One strategy on one model: what a worker process runs."""

    model: ModelSpec
    strategy: str
    steps: int
    warmup: int
    budget_bytes: int = 0
    """rematd's budget (0: none)."""
    budget_frac: float = 0.0
    """Where ``budget_bytes`` is 0 and this is not: on the CPU, this fraction of the bytes the profiling step
    saved for backward."""
    margin: float = 0.1
    modes: list[str] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    """Per measured step, a sequence length (the adaptive scenario); empty: the model's own, every step."""
    memory_fraction: float = 0.0
    """Enforce this fraction of device memory (CUDA); 0: not enforced."""


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _step(ctx: Context, data: torch.Tensor, device: torch.device) -> None:
    if ctx.step_fn is not None:
        ctx.step_fn(data)
        return
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_cuda(device)):
        loss = ctx.model(input_ids=data, labels=data).loss
    loss.backward()
    ctx.opt.step()
    ctx.opt.zero_grad(set_to_none=True)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err)


def run_job(job: Job, device: torch.device) -> dict[str, Any]:
    if job.strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {job.strategy!r}")
    cuda = _cuda(device)
    spec = job.model
    model = build(spec, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ctx = Context(model=model, opt=opt, job=job)
    if cuda and job.memory_fraction:
        torch.cuda.set_per_process_memory_fraction(job.memory_fraction, device)
    gen = torch.Generator().manual_seed(0)

    def data(seq: int) -> torch.Tensor:
        return torch.randint(0, spec.vocab, (spec.batch, seq), generator=gen).to(device)

    STRATEGIES[job.strategy](ctx)
    h = ctx.handle
    if h is not None and not job.budget_bytes and job.budget_frac and not cuda:
        _step(ctx, data(spec.seq), device)  # the profiling step: what a step saves, all blocks stored
        saved = h.last_stats.saved_peak_bytes if h.last_stats else 0
        h.budget_bytes = max(1, int(job.budget_frac * saved))
    seqs = job.seqs or [spec.seq] * (job.warmup + job.steps)
    rows: list[dict[str, Any]] = []
    static = int(torch.cuda.memory_allocated(device)) if cuda else 0
    started = time.perf_counter()
    for i, seq in enumerate(seqs):
        x = data(seq)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            static = int(torch.cuda.memory_allocated(device))
        began = time.perf_counter()
        ok = True
        try:
            if h is not None:
                h.run_step(_step, ctx, x, device)
            else:
                _step(ctx, x, device)
            if cuda:
                torch.cuda.synchronize(device)
        except Exception as err:
            if not _is_oom(err):
                raise
            ok = False
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.empty_cache()
        seconds = time.perf_counter() - began
        if cuda:
            peak = int(torch.cuda.max_memory_allocated(device))
        else:
            peak = h.last_stats.saved_peak_bytes if h is not None and h.last_stats else 0
        row: dict[str, Any] = {"seq": seq, "s": seconds, "peak": peak, "static": static, "ok": ok}
        if h is not None:
            row["modes"] = "".join(LETTERS[m] for m in h.modes)
            row["predicted_peak"] = h.plan.predicted_peak_bytes
            row["predicted_overhead"] = h.plan.predicted_overhead_ratio
        if job.seqs or i >= job.warmup:
            rows.append(row)
    wall = time.perf_counter() - started
    good = [r for r in rows if r["ok"]]
    budget = h.budget_bytes if h is not None else job.budget_bytes
    out: dict[str, Any] = {
        "strategy": job.strategy,
        "model": spec.name,
        "budget_frac": job.budget_frac,
        "budget_bytes": budget or 0,
        "median_s": median([r["s"] for r in good]),
        "max_peak": max((r["peak"] for r in rows), default=0),
        "static_bytes": min((r["static"] for r in rows), default=0),
        "steps_over_budget": sum(1 for r in rows if budget and r["peak"] > budget),
        "ooms": sum(1 for r in rows if not r["ok"]),
        "tokens_per_s": sum(spec.batch * r["seq"] for r in good) / wall if wall else 0.0,
        "wall_s": wall,
        "rows": rows,
    }
    if h is not None:
        out["modes"] = "".join(LETTERS[m] for m in h.modes)
        out["predicted_peak"] = h.plan.predicted_peak_bytes
        out["predicted_overhead"] = h.plan.predicted_overhead_ratio
        out["reason"] = h.plan.reason
        out["recovered_ooms"] = h.oom_count
        h.close()
    return out


def _worker(path: str) -> None:
    jobs = json.loads(Path(path).read_text())
    device = torch.device("cuda" if torch.cuda.is_available() and not jobs["cpu"] else "cpu")
    results = []
    for raw in jobs["jobs"]:
        raw["model"] = ModelSpec(**raw["model"])
        results.append(run_job(Job(**raw), device))
    Path(jobs["out"]).write_text(json.dumps(results))


def run_in_process(jobs: list[Job], *, cpu: bool, plugins: list[str], timeout: float) -> list[dict[str, Any]]:
    """Run ``jobs`` one after another in a fresh Python process; their results."""
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"rematd-bench-gpu-{os.getpid()}-{time.monotonic_ns()}"
    spec, out = tmp.with_suffix(".jobs.json"), tmp.with_suffix(".out.json")
    spec.write_text(json.dumps({"cpu": cpu, "out": str(out), "jobs": [asdict(j) for j in jobs]}))
    cmd = [sys.executable, "-m", "bench.gpu", "--worker", str(spec)]
    for p in plugins:
        cmd += ["--plugin", p]
    try:
        subprocess.run(cmd, check=True, timeout=timeout, cwd=Path(__file__).resolve().parent.parent)
        results: list[dict[str, Any]] = json.loads(out.read_text())
        return results
    finally:
        spec.unlink(missing_ok=True)
        out.unlink(missing_ok=True)


# -- the benchmark ------------------------------------------------------------------------------------


STATIC_STRATEGIES = ("none", "hf-full", "every-2nd", "every-3rd")


def budgets_table(
    spec: ModelSpec, fracs: list[float], run: Callable[[list[Job]], list[dict[str, Any]]], base: Job, cuda: bool
) -> dict[str, Any]:
    statics = [replace(base, model=spec, strategy=s) for s in STRATEGIES if s != "rematd"]
    rematd_jobs = [replace(base, model=spec, strategy="rematd", budget_frac=frac) for frac in fracs]
    if cuda:
        # Each in its own process; rematd's budgets from what no checkpointing measured.
        results = [run([j])[0] for j in statics]
        none = next(r for r in results if r["strategy"] == "none")
        for j in rematd_jobs:
            j.budget_bytes = none["static_bytes"] + int(j.budget_frac * max(0, none["max_peak"] - none["static_bytes"]))
        ours = [run([j])[0] for j in rematd_jobs]
    else:
        # A smoke run: one process for them all.
        found = run([*statics, *rematd_jobs])
        results, ours = found[: len(statics)], found[len(statics) :]
        none = results[0]
    static = none["static_bytes"]
    act = max(0, none["max_peak"] - static)
    plain = none["median_s"]
    rows = []
    for r in ours:
        budget = r["budget_bytes"]
        fitting = [s for s in results if cuda and s["max_peak"] <= budget]
        best = min(fitting, key=lambda s: s["median_s"]) if fitting else None
        predicted_overhead = r.get("predicted_overhead")
        rows.append(
            {
                "budget": f"{r['budget_frac']:.0%}",
                "budget_mib": budget / MiB,
                "rematd_x": r["median_s"] / plain,
                "peak_mib": r["max_peak"] / MiB,
                "over": r["steps_over_budget"],
                "predicted_peak_mib": (r.get("predicted_peak") or 0) / MiB,
                "peak_error": (r["predicted_peak"] - r["max_peak"]) / r["max_peak"] if r["max_peak"] else None,
                "predicted_x": 1 + predicted_overhead if predicted_overhead is not None else None,
                "modes": r.get("modes", ""),
                "best_static": best["strategy"] if best else ("none fits" if cuda else "n/a on the CPU"),
                "best_static_x": best["median_s"] / plain if best else None,
                "vs_best": r["median_s"] / best["median_s"] if best else None,
                "reason": r.get("reason", ""),
            }
        )
    return {
        "model": asdict(spec),
        "static_bytes": static,
        "activation_bytes": act,
        "static": [
            {
                "strategy": s["strategy"],
                "step_ms": 1000 * s["median_s"],
                "x": s["median_s"] / plain,
                "peak_mib": s["max_peak"] / MiB,
            }
            for s in results
        ],
        "rows": rows,
        "runs": [*results, *ours],
    }


def adaptive(
    spec: ModelSpec, run: Callable[[list[Job]], list[dict[str, Any]]], base: Job, cuda: bool, steps: int, lo: int
) -> dict[str, Any]:
    """Sequence length drawn per step from ``lo``-``spec.max_seq``; the budget (static + 50% of the activations
    at the longest length) enforced on CUDA; OOMs and tokens/s per strategy."""
    rng = random.Random(0)
    seqs = [rng.randint(lo, spec.max_seq) for _ in range(steps)]
    budget, fraction = 0, 0.0
    if cuda:
        probe = run([replace(base, model=replace(spec, seq=spec.max_seq), strategy="none", steps=2, warmup=1)])[0]
        static = probe["static_bytes"]
        budget = static + (probe["max_peak"] - static) // 2
        fraction = min(1.0, budget / torch.cuda.get_device_properties(0).total_memory)
    out: dict[str, Any] = {"budget_bytes": budget, "seqs": [lo, spec.max_seq], "steps": steps, "runs": []}
    jobs = [
        replace(
            base,
            model=spec,
            strategy=strategy,
            seqs=seqs,
            memory_fraction=fraction,
            budget_bytes=budget if cuda else 0,
            budget_frac=0.0 if cuda else 0.5,
        )
        for strategy in ("none", "hf-full", "every-2nd", "rematd")
    ]
    for r in [run([j])[0] for j in jobs] if cuda else run(jobs):
        out["runs"].append(
            {
                "strategy": r["strategy"],
                "ooms": r["ooms"],
                "recovered_ooms": r.get("recovered_ooms", 0),
                "median_ms": 1000 * r["median_s"],
                "tokens_per_s": r["tokens_per_s"],
                "max_peak_mib": r["max_peak"] / MiB,
            }
        )
    full = next(r for r in out["runs"] if r["strategy"] == "hf-full")
    ours = next(r for r in out["runs"] if r["strategy"] == "rematd")
    out["rematd_vs_full_tokens"] = ours["tokens_per_s"] / full["tokens_per_s"] if full["tokens_per_s"] else None
    return out


def _mib(x: float) -> str:
    # Without an allocator to read (the CPU), only rematd counts bytes: the others have no peak.
    return f"{x:,.1f}" if x else "n/a"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# bench/gpu.py on {report['device']} (torch {report['torch']})", ""]
    for m in report["models"]:
        spec = m["model"]
        lines += [
            f"## {spec['name']}: {spec['n_layer']} blocks x {spec['d_model']}, batch {spec['batch']} x {spec['seq']}",
            "",
            f"static {m['static_bytes'] / MiB:,.0f} MiB, activations {m['activation_bytes'] / MiB:,.0f} MiB",
            "",
            "| strategy | step ms | x no-ckpt | peak MiB |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {s['strategy']} | {s['step_ms']:.1f} | {s['x']:.3f} | {_mib(s['peak_mib'])} |" for s in m["static"]
        ]
        lines += [
            "",
            "| budget | MiB | rematd x | peak MiB | over | predicted peak MiB | error | predicted x | modes "
            "| best static that fits | its x | rematd / best |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            err = f"{r['peak_error']:+.1%}" if r["peak_error"] is not None else ""
            best_x = f"{r['best_static_x']:.3f}" if r["best_static_x"] is not None else ""
            vs = f"{r['vs_best']:.3f}" if r["vs_best"] is not None else ""
            px = f"{r['predicted_x']:.3f}" if r["predicted_x"] is not None else ""
            lines.append(
                f"| {r['budget']} | {r['budget_mib']:,.0f} | {r['rematd_x']:.3f} | {r['peak_mib']:,.0f} | {r['over']} "
                f"| {r['predicted_peak_mib']:,.0f} | {err} | {px} | `{r['modes']}` | {r['best_static']} | {best_x} "
                f"| {vs} |"
            )
        lines.append("")
    a = report.get("adaptive")
    if a:
        enforced = f"budget {a['budget_bytes'] / MiB:,.0f} MiB enforced" if a["budget_bytes"] else "no budget enforced"
        lines += [
            f"## Adaptive: sequence length drawn per step from {a['seqs'][0]}-{a['seqs'][1]}, {enforced}",
            "",
            "| strategy | OOM errors | recovered | median step ms | tokens/s | max peak MiB |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['strategy']} | {r['ooms']} | {r['recovered_ooms']} | {r['median_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {_mib(r['max_peak_mib'])} |"
            for r in a["runs"]
        ]
        if a["rematd_vs_full_tokens"] is not None:
            lines += ["", f"rematd's tokens/s: {a['rematd_vs_full_tokens']:.2f}x recomputing every block."]
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a worker process may take")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for p in args.plugin:
        importlib.import_module(p)
    if args.worker:
        _worker(args.worker)
        return
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
        report["models"].append(budgets_table(spec, fracs, run, base, cuda))
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
