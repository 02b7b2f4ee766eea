"""Training-thread overhead of rematd per step: an attached model against the same model unattached.

Streams to a live ``rematd serve`` subprocess on loopback, with a budget that never changes the plan.
Attached and unattached steps alternate so machine noise hits both alike; figures are medians.

    .venv/bin/python -m bench.overhead [--steps 400] [--out bench/overhead.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.served import served
from rematd import client
from rematd.client.demo.tiny_gpt import GPTConfig, TinyGPT, lm_loss


def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(n_layer=4, d_model=64, n_head=4, max_seq_len=128))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def timed_hooks() -> list[float]:
    """Wraps the handle's training-thread entry points to add up the time spent in them."""
    spent = [0.0]
    for name in ("_pre_forward", "_post_forward", "step"):
        original = getattr(client.Handle, name)

        def wrapper(self: client.Handle, *args: Any, _original: Callable[..., Any] = original) -> Any:
            start = time.perf_counter()
            try:
                return _original(self, *args)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(client.Handle, name, wrapper)
    return spent


def run(server: str, steps: int, accounting: bool, spent: list[float]) -> dict[str, float]:
    data = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    plain, plain_opt = make(0)
    model, opt = make(0)
    h = client.attach(model, server=server, job=f"bench-{int(accounting)}", optimizer=opt, budget_bytes=2**40)
    if not accounting:
        h._accounting_on = lambda: False  # type: ignore[method-assign]  # as on CUDA: no saved-tensor hooks

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> float:
        start = time.perf_counter()
        lm_loss(m, data).backward()
        o.step()
        o.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for _ in range(20):  # warm up both, and let the first plan arrive
        step(plain, plain_opt)
        step(model, opt)
    h.flush(10.0)
    versions = h.plan.version
    base, attached, inside, diffs = [], [], [], []
    for i in range(steps):
        if i % 2:
            b = step(plain, plain_opt)
            spent[0] = 0.0
            a = step(model, opt)
        else:
            spent[0] = 0.0
            a = step(model, opt)
            b = step(plain, plain_opt)
        inside.append(spent[0])
        base.append(b)
        attached.append(a)
        diffs.append(a - b)
    h.flush(10.0)
    stream = h.stream
    assert stream is not None and stream.connected, "the bench must stream to the live service"
    assert h.plan.version == versions, "no plan change during the measurement"
    h.close()
    mb, ma = statistics.median(base), statistics.median(attached)
    return {
        "steps": steps,
        "unattached_step_us": mb * 1e6,
        "attached_step_us": ma * 1e6,
        "overhead_us": statistics.median(diffs) * 1e6,
        "overhead_ratio": ma / mb - 1.0,
        "rematd_code_us": statistics.median(inside) * 1e6,
        "dropped": stream.dropped,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="measured steps per configuration")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")), help="JSON results file")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error("--steps must be at least 10")
    torch.set_num_threads(1)
    spent = timed_hooks()
    with tempfile.TemporaryDirectory() as tmp, served(Path(tmp) / "bench.db") as srv:
        rows = {
            "hooks only (as on CUDA)": run(srv.grpc, args.steps, False, spent),
            "CPU saved-tensor accounting": run(srv.grpc, args.steps, True, spent),
        }
    print(
        f"{'configuration':30s} {'plain µs':>10s} {'attached µs':>12s} {'overhead µs':>12s} {'ratio':>8s} "
        f"{'in rematd µs':>13s}"
    )
    for name, r in rows.items():
        print(
            f"{name:30s} {r['unattached_step_us']:10.0f} {r['attached_step_us']:12.0f} {r['overhead_us']:12.0f} "
            f"{r['overhead_ratio']:8.1%} {r['rematd_code_us']:13.0f}"
        )
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "target_us": 100, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
