"""rematd with ``compile=True`` against ``torch.compile``'s own activation memory budget, at the same bytes.

    python -m bench.compiled_budget --mid --at 0.5 --warmup 24   # CPU: 4 blocks, d_model 128, batch 4 x 128
    python -m bench.compiled --mid --at 0.5 --warmup 24          # the same, from the strategies' benchmark

Eager without checkpointing, ``torch.compile(model)`` with ``activation_memory_budget`` at the ratio, and
rematd with ``compile=True`` at that ratio of the bytes eager saves for backward, stepped in turn round
after round (each round in its own order), so that the machine's drift falls on each alike.
"""

from __future__ import annotations

import argparse
import contextlib
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from bench.common import MiB, median, table, write_json
from bench.compiled_setup import Meter, Setup, batch_of, build_model, setup_of, size_arguments, step
from rematd import client
from rematd.planner import letters


@dataclass
class Contender:
    """One model stepped in turn with the others: its runner, meter, the patch it compiles under, its record."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    meter: Meter
    patch: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)

    def step(self, setup: Setup, data: torch.Tensor, record: bool) -> None:
        with self.patch():  # the partitioner reads the budget whenever it compiles
            seconds, peak = step(setup, self.model, self.opt, data, self.meter)
        if record:
            self.times.append(seconds)
            self.peaks.append(peak)


def at_budget_contenders(setup: Setup, ratio: float) -> tuple[list[Contender], int]:
    """Eager without checkpointing, ``torch.compile`` at ``activation_memory_budget = ratio``, and rematd
    with ``compile=True`` at ``ratio`` of the bytes eager saves; and that budget."""
    import torch._functorch.config as functorch_config

    eager_model = build_model(setup)
    eager = Contender(
        "eager", eager_model, torch.optim.SGD(eager_model.parameters(), lr=1e-4), Meter(setup, eager_model)
    )
    eager.step(setup, batch_of(setup), record=True)
    budget = int(eager.peaks.pop() * ratio)
    eager.times.clear()
    whole_model = build_model(setup)
    compiled: Any = torch.compile(whole_model, backend=setup.backend)
    whole = Contender(
        f"whole-{ratio}",
        compiled,
        torch.optim.SGD(whole_model.parameters(), lr=1e-4),
        Meter(setup, whole_model),
        patch=lambda: functorch_config.patch(activation_memory_budget=ratio),
    )
    ours_model = build_model(setup)
    h = client.attach(ours_model, compile=setup.backend, budget_bytes=budget)
    ours = Contender(
        "rematd", ours_model, torch.optim.SGD(ours_model.parameters(), lr=1e-4), Meter(setup, ours_model, h)
    )
    return [eager, whole, ours], budget


def at_budget(setup: Setup, ratio: float) -> dict[str, Any]:
    """rematd with ``compile=True`` against ``torch.compile``'s own activation memory budget at the same
    bytes, stepped in turn round after round (each round in its own order): each ratio is the median over
    the measured rounds of each round's step time over eager's."""
    contenders, budget = at_budget_contenders(setup, ratio)
    for i in range(setup.warmup + setup.steps):
        data = batch_of(setup, seed=i + 1)
        for c in random.Random(i).sample(contenders, len(contenders)):
            c.step(setup, data, record=i >= setup.warmup)
    eager = contenders[0]
    rows = []
    for c in contenders:
        row: dict[str, Any] = {"strategy": c.name, "step_s": median(c.times), "peak_mib": max(c.peaks) / MiB}
        row["ratio"] = median([t / e for t, e in zip(c.times, eager.times, strict=True)])
        row["budget_mib"] = budget / MiB
        row["fits"] = max(c.peaks) <= budget
        if c.meter.handle is not None:
            row["modes"] = letters(c.meter.handle.modes)
            c.meter.handle.close()
        rows.append(row)
    return {"setup": asdict(setup), "ratio": ratio, "rows": rows}


def at_report(setup: Setup, ratio: float, out: str) -> None:
    payload = at_budget(setup, ratio)
    print(f"{setup}")
    columns = [
        ("strategy", "strategy", "s"),
        ("step_s", "step s", ".4f"),
        ("ratio", "x eager", ".3f"),
        ("peak_mib", "peak MiB", ",.2f"),
        ("budget_mib", "budget MiB", ",.2f"),
        ("fits", "fits", ""),
        ("modes", "rematd's modes", "s"),
    ]
    print(table(payload["rows"], columns))
    write_json(out, payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size_arguments(parser)
    parser.add_argument("--at", type=float, default=0.5, help="the budget, a fraction of eager's saved bytes")
    parser.add_argument("--out", default="bench/compiled_budget.json")
    args = parser.parse_args()
    if not 0 < args.at <= 1:
        raise SystemExit(f"--at {args.at}: the budget is a fraction of eager's saved bytes, in (0, 1]")
    at_report(setup_of(args), args.at, args.out)


if __name__ == "__main__":
    main()
