"""Shared pieces of the benchmarks: models, timed training steps, tables, JSON."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rematd.client.models import GPTConfig, TinyGPT, lm_loss

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


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


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
