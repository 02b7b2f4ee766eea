"""bench/gpu.py's measurement: one job's steps (time, allocator peaks, rematd's predictions), each job list
run in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.common import Timed, median
from bench.gpu_models import Job, ModelSpec, build
from bench.gpu_strategies import STRATEGIES, Context
from rematd.planner import letters


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
        # The profiling step recomputes every block; with no budget yet, the first plan stores them all: what a
        # step saves (the planner's thread has made it once flushed).
        _step(ctx, data(spec.seq), device)
        h.flush(30.0)
        _step(ctx, data(spec.seq), device)
        saved = h.last_stats.saved_peak_bytes if h.last_stats else 0
        h.budget_bytes = max(1, int(job.budget_frac * saved))
    seqs = job.seqs or [spec.seq] * (job.warmup + job.steps)
    rows: list[dict[str, Any]] = []
    static = int(torch.cuda.memory_allocated(device)) if cuda else 0
    started = time.perf_counter()
    with Timed() as timed:
        for i, seq in enumerate(seqs):
            x = data(seq)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                static = int(torch.cuda.memory_allocated(device))
            planned = len(timed.seconds)
            reported = h.last_stats if h is not None else None
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
                if h is not None and h.last_stats is not None and h.last_stats is not reported:
                    # rematd reads and resets the allocator's peak at the step's end, before this read (a step
                    # that ran out of memory reports nothing: the last report is an earlier step's).
                    peak = max(peak, h.last_stats.peak_allocated_bytes)
            else:
                peak = h.last_stats.saved_peak_bytes if h is not None and h.last_stats else 0
            row: dict[str, Any] = {"seq": seq, "s": seconds, "peak": peak, "static": static, "ok": ok}
            if h is not None:
                # The planner's time during the step, on its own thread; and rematd's on the training thread (host
                # time, which a GPU step hides only while the device is behind).
                row["planner_ms"] = 1000 * sum(timed.seconds[planned:])
                stats = h.last_stats
                row["thread_ms"] = 1000 * stats.thread_seconds if stats is not None and stats is not reported else 0.0
                row["modes"] = letters(h.modes)
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
        out["modes"] = letters(h.modes)
        out["predicted_peak"] = h.plan.predicted_peak_bytes
        out["predicted_overhead"] = h.plan.predicted_overhead_ratio
        out["reason"] = h.plan.reason
        out["recovered_ooms"] = h.oom_count
        h.close()
    return out


def worker(path: str) -> None:
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
