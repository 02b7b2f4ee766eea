"""What rematd costs the training thread per step: the demo GPT and a 32-block model, planned in-process and served.

Each step's figure is the one rematd measures and exports (``h.last_stats.thread_seconds``, the service's
``rematd_training_thread_seconds``): the time its own code ran on the training thread (hooks, block and part
wrappers, the step's start and end), the model's and torch's work left out. Beside it, as a cross-check that
needs no instrument of rematd's, the attached model's step against the same model unattached, the two
alternating so that machine noise hits both alike (median of the pairs' differences). Every block stores (a
budget that never changes the plan): what is measured is rematd's bookkeeping, not a plan's recomputation.

    .venv/bin/python -m bench.overhead [--steps 2000] [--accounting] [--out bench/overhead.json]

By default the blocks run as on CUDA (no saved-tensor hooks); ``--accounting`` adds rows with the CPU's
saved-tensor accounting, the CPU's stand-in for the allocator's statistics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.common import Timed
from bench.served import served
from rematd import client
from rematd.client.demo.tiny_gpt import GPTConfig, TinyGPT, lm_loss

MODELS = {"demo GPT (4 blocks)": 4, "32 blocks": 32}
TARGET_MEDIAN_US = 100.0
TARGET_TAIL_US = 1000.0


def make(seed: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(n_layer=layers, d_model=64, n_head=4, max_seq_len=128))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextmanager
def planner_time() -> Iterator[Timed]:
    with Timed() as timed:
        yield timed


def run(layers: int, steps: int, *, server: str | None, accounting: bool) -> dict[str, Any]:
    data = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    plain, plain_opt = make(0, layers)
    model, opt = make(0, layers)
    job = f"overhead-{layers}-{int(accounting)}"
    h = client.attach(model, server=server, job=job if server else None, optimizer=opt, budget_bytes=2**40)
    if not accounting:
        h._cycle.saved_hooks = False  # as on CUDA: no saved-tensor hooks

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> float:
        start = time.perf_counter()
        lm_loss(m, data).backward()
        o.step()
        o.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for _ in range(20):  # warm up both, and let the first plan arrive
        step(plain, plain_opt)
        step(model, opt)
    assert h.flush(30.0), "the planner answered the warm-up"
    version = h.plan.version
    base, attached, inside, diffs = [], [], [], []
    with planner_time() as timed:
        for i in range(steps):
            if i % 2:
                b = step(plain, plain_opt)
                a = step(model, opt)
            else:
                a = step(model, opt)
                b = step(plain, plain_opt)
            stats = h.last_stats
            assert stats is not None
            inside.append(stats.thread_seconds)
            base.append(b)
            attached.append(a)
            diffs.append(a - b)
        h.flush(30.0)
    assert h.plan.version == version, "no plan change during the measurement"
    stream = h.stream
    if server is not None:
        assert stream is not None and stream.connected, "the bench must stream to the live service"
    h.close()
    mb, ma = statistics.median(base), statistics.median(attached)
    return {
        "layers": layers,
        "served": server is not None,
        "accounting": accounting,
        "steps": steps,
        "unattached_step_us": mb * 1e6,
        "attached_step_us": ma * 1e6,
        "difference_us": statistics.median(diffs) * 1e6,
        "thread_median_us": statistics.median(inside) * 1e6,
        "thread_p99_us": percentile(inside, 0.99) * 1e6,
        "thread_p999_us": percentile(inside, 0.999) * 1e6,
        "thread_max_us": max(inside) * 1e6,
        # In-process, the planner's looks at each step's figures run on its own thread; served, in the service.
        "planner_off_thread_us_per_step": sum(timed.seconds) / steps * 1e6,
        "dropped": stream.dropped if stream is not None else 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="measured steps per configuration")
    parser.add_argument("--accounting", action="store_true", help="also run with the CPU's saved-tensor accounting")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")), help="JSON results file")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error("--steps must be at least 10")
    torch.set_num_threads(1)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, served(Path(tmp) / "bench.db") as srv:
        for name, layers in MODELS.items():
            for where, server in (("in-process", None), ("served", srv.grpc)):
                for accounting in (False, True) if args.accounting else (False,):
                    key = f"{name}, {where}" + (", CPU accounting" if accounting else "")
                    rows[key] = run(layers, args.steps, server=server, accounting=accounting)
                    r = rows[key]
                    print(
                        f"{key}: rematd on the training thread median {r['thread_median_us']:.0f} us, "
                        f"p99.9 {r['thread_p999_us']:.0f} us",
                        flush=True,
                    )
    print()
    print(
        f"{'configuration':44s} {'plain µs':>9s} {'attached µs':>12s} {'diff µs':>8s} {'rematd median µs':>17s} "
        f"{'p99 µs':>7s} {'p99.9 µs':>9s} {'max µs':>7s} {'planner µs/step, off-thread':>28s}"
    )
    for key, r in rows.items():
        print(
            f"{key:44s} {r['unattached_step_us']:9.0f} {r['attached_step_us']:12.0f} {r['difference_us']:8.0f} "
            f"{r['thread_median_us']:17.0f} {r['thread_p99_us']:7.0f} {r['thread_p999_us']:9.0f} "
            f"{r['thread_max_us']:7.0f} {r['planner_off_thread_us_per_step']:28.0f}"
        )
    hooks = [r for r in rows.values() if not r["accounting"]]
    worst_median = max(r["thread_median_us"] for r in hooks)
    worst_tail = max(r["thread_p999_us"] for r in hooks)
    print(
        f"\nas on CUDA (no saved-tensor accounting): worst median {worst_median:.0f} us "
        f"(target {TARGET_MEDIAN_US:.0f}), "
        f"worst p99.9 {worst_tail:.0f} us (target {TARGET_TAIL_US:.0f})"
    )
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "target_median_us": TARGET_MEDIAN_US,
        "target_p999_us": TARGET_TAIL_US,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
