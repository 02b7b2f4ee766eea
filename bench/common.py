"""Shared pieces of the benchmarks: models, timed training steps, tables, JSON."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rematd.client.demo.tiny_gpt import GPTConfig, TinyGPT, lm_loss
from rematd.planner.controller import Controller

MiB = 2**20


def gpt(n_layer: int, d_model: int, n_head: int, seed: int = 0, max_seq_len: int = 1024) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, max_seq_len=max_seq_len))


def tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def timed_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor, after: Callable[[], None] | None = None
) -> float:
    start = time.perf_counter()
    loss = lm_loss(model, data)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if after is not None:
        after()
    return time.perf_counter() - start


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks for reuse instead of handing them back to the system; whether it
    could (False off glibc).

    By default glibc maps blocks of more than a few MiB straight from the system and unmaps them when freed,
    so a step that stores 500 MiB of activations faults 500 MiB of fresh pages in again every step: on the
    12-block model of ``bench.strategies`` that made storing every block 10% slower than it is once the
    memory is reused, and recomputing look faster than storing. A GPU's caching allocator reuses its blocks,
    and CPU training is advised to use an allocator that does (jemalloc, tcmalloc): the benchmarks compare
    plans, not the system's page faults. ``--system-malloc`` keeps glibc's defaults.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # 32 MiB is the largest mmap threshold glibc takes; the trim threshold keeps the freed top of the heap.
    return bool(mallopt(m_mmap_threshold, 32 * 1024 * 1024)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def malloc_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--system-malloc`` flag of the benchmarks that call :func:`freed_memory_kept`."""
    parser.add_argument(
        "--system-malloc", action="store_true", help="keep glibc's malloc defaults (see keep_freed_memory)"
    )


def freed_memory_kept(args: argparse.Namespace) -> bool:
    """:func:`keep_freed_memory` unless ``--system-malloc``, said on the output; whether memory is kept."""
    kept = not args.system_malloc and keep_freed_memory()
    print(f"freed memory kept for reuse: {'yes' if kept else 'no (glibc defaults)'}", flush=True)
    return kept


class Timed:
    """The controller's ``observe``, timed (wall clock, on whichever thread plans)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._observe = Controller.observe

    def __enter__(self) -> Timed:
        timed = self

        def observe(controller: Controller, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return timed._observe(controller, *args, **kwargs)
            finally:
                timed.seconds.append(time.perf_counter() - start)

        Controller.observe = observe  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Controller.observe = self._observe  # type: ignore[method-assign]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_interval(xs: list[float], level: float = 0.9) -> tuple[float, float] | None:
    """A confidence interval of the median of ``xs`` at ``level``, from their order statistics alone (no
    assumption on their distribution): the k-th smallest and k-th largest, for the largest k that the
    binomial distribution of how many fall below the median covers at ``level``; None for too few values."""
    n = len(xs)
    tail = (1.0 - level) / 2
    below, k = 0.0, 0
    # P(fewer than k+1 of n values fall below the median) = sum of C(n, i) / 2^n for i <= k.
    while k < n // 2:
        below += math.comb(n, k) / 2**n  # exact integers: no overflow however many values
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(xs)
    return ordered[k - 1], ordered[n - k]


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Rows as a fixed-width text table; columns are (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str))


def profiled_peak(step: Callable[[], None]) -> int:
    """The most bytes the CPU allocator held during ``step`` beyond what it held when the step started, from
    torch's memory profiler (which sees every allocation, compiled code's too)."""
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
            step()
        timeline = Path(tmp) / "memory.json"
        with warnings.catch_warnings():
            # Deprecated for CUDA's snapshots, which do not cover the CPU; no other reader of the CPU's exists.
            warnings.filterwarnings("ignore", "`export_memory_timeline` is deprecated", FutureWarning)
            p.export_memory_timeline(str(timeline), device="cpu")
        _, sizes = json.loads(timeline.read_text())
    totals = [sum(at) for at in sizes]
    return max(totals) - totals[0] if totals else 0
