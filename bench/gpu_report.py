"""bench/gpu.py's scenarios and tables: the budgets sweep against the static strategies, the adaptive
scenario, and the Markdown report."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch

from bench.common import MiB, median
from bench.gpu_models import Job, ModelSpec
from bench.gpu_strategies import STRATEGIES


def budgets_table(
    spec: ModelSpec,
    fracs: list[float],
    run: Callable[[list[Job]], list[dict[str, Any]]],
    base: Job,
    cuda: bool,
    strategies: list[str] | None = None,
) -> dict[str, Any]:
    """``strategies``: the static ones to run (default: every one registered); no checkpointing always runs
    first, as rematd's budgets are fractions of what it measured."""
    names = ["none", *(s for s in (strategies or STRATEGIES) if s not in ("none", "rematd"))]
    statics = [replace(base, model=spec, strategy=s) for s in names]
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
        # rematd's own pinned runs measure rematd, not what a user would run instead.
        fitting = [s for s in results if cuda and s["max_peak"] <= budget and not s["strategy"].startswith("rematd")]
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
                "planner_ms": _median_of(r, "planner_ms"),
                "thread_ms": _median_of(r, "thread_ms"),
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
                "planner_ms": _median_of(s, "planner_ms"),
                "thread_ms": _median_of(s, "thread_ms"),
                "modes": s.get("modes"),
            }
            for s in results
        ],
        "rows": rows,
        "runs": [*results, *ours],
    }


def _median_of(run: dict[str, Any], key: str) -> float | None:
    """The median per measured step of a rematd run's ``key`` (None where the run has none)."""
    xs = [row[key] for row in run.get("rows", []) if row.get(key) is not None]
    return median(xs) if xs else None


def _ms(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else ""


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
            "| strategy | step ms | x no-ckpt | peak MiB | rematd ms on the training thread |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {s['strategy']} | {s['step_ms']:.1f} | {s['x']:.3f} | {_mib(s['peak_mib'])} "
            f"| {_ms(s.get('thread_ms'))} |"
            for s in m["static"]
        ]
        lines += [
            "",
            "| budget | MiB | rematd x | peak MiB | over | predicted peak MiB | error | predicted x | modes "
            "| best static that fits | its x | rematd / best | rematd ms on the training thread |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            err = f"{r['peak_error']:+.1%}" if r["peak_error"] is not None else ""
            best_x = f"{r['best_static_x']:.3f}" if r["best_static_x"] is not None else ""
            vs = f"{r['vs_best']:.3f}" if r["vs_best"] is not None else ""
            px = f"{r['predicted_x']:.3f}" if r["predicted_x"] is not None else ""
            lines.append(
                f"| {r['budget']} | {r['budget_mib']:,.0f} | {r['rematd_x']:.3f} | {r['peak_mib']:,.0f} | {r['over']} "
                f"| {r['predicted_peak_mib']:,.0f} | {err} | {px} | `{r['modes']}` | {r['best_static']} | {best_x} "
                f"| {vs} | {_ms(r.get('thread_ms'))} |"
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
