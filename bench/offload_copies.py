"""The copies offload makes, timed: out to the host and back, into a fresh host tensor per copy or into the reused
pool offload keeps (``rematd.client.blocks.host_pool``).

    python -m bench.offload_copies                  # 24 tensors of 16 MiB a step (a GPT-2 medium block's size)
    python -m bench.offload_copies --quick          # 8 tensors of 1 MiB (a smoke run)

A step copies ``--tensors`` tensors of ``--mib`` MiB out, waits for the copies, then copies them back, as
offload does between a block's forward and its backward; ``--steps`` steps after one warm-up step, each
way timed as a whole step (median). The ways:

- ``fresh``: a new host tensor per copy (on a device, pinned: what offload did before its pool, and what a
  ``save_on_cpu(pin_memory=True)`` does);
- ``pool``: buffers taken from offload's pool and given back once the copy back is done, reused step after
  step;
- ``pageable`` (on a device only): a new host tensor per copy, not pinned (synchronous copies).

On a device the copies run on a side stream, as offload's do. Without one, host memory is copied to host
memory: what the pool saves there is the allocation alone (figures of no link). The JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import table, write_json
from rematd.client.blocks.host_pool import HostPool

MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.offload_copies", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 tensors of 1 MiB, 3 steps")
    p.add_argument("--tensors", type=int, default=24, help="tensors copied out and back a step (24)")
    p.add_argument("--mib", type=float, default=16.0, help="MiB per tensor (16)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per way (10)")
    p.add_argument("--out", default="artifacts/bench-offload-copies.json")
    args = p.parse_args(argv)
    if args.quick:
        args.tensors, args.mib, args.steps = 8, 1.0, 3
    if args.tensors < 1 or args.mib <= 0 or args.steps < 1:
        p.error("--tensors and --steps must be at least 1, --mib above 0")
    return args


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(sources: list[torch.Tensor], host: Callable[[torch.Tensor], tuple[torch.Tensor, Any]], give: Any) -> float:
    """One step's copies out and back; seconds."""
    device = sources[0].device
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    _synchronize(device)
    began = time.perf_counter()
    held = []
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for t in sources:
            dst, lease = host(t)
            dst.copy_(t, non_blocking=side is not None)
            held.append((dst, lease))
        backs = []
        for dst, lease in held:
            back = torch.empty_like(dst, device=device)
            back.copy_(dst, non_blocking=side is not None)
            backs.append(back)
            give(lease, side)
    _synchronize(device)
    return time.perf_counter() - began


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    nbytes = int(args.mib * MiB) // 4 * 4
    sources = [torch.randn(nbytes // 4, device=device) for _ in range(args.tensors)]
    pinned = device.type == "cuda"
    pool = HostPool()

    def fresh(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned), None

    def pageable(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return torch.empty(t.shape, dtype=t.dtype), None

    def pooled(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        lease = pool.take(t.numel() * t.element_size(), pinned=pinned)
        return lease.view(t), lease

    def give_back(lease: Any, side: torch.cuda.Stream | None) -> None:
        if lease is None:
            return
        done = None
        if side is not None:
            done = torch.cuda.Event()
            done.record(side)
        pool.give_back(lease, done)

    ways: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, Any]]] = {"fresh": fresh, "pool": pooled}
    if pinned:
        ways["pageable"] = pageable
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for host in ways.values():
        _step(sources, host, give_back)  # warm-up: the pool fills, the allocator settles
    for _ in range(args.steps):
        for name, host in ways.items():  # interleaved: the machine's drift falls on every way alike
            seconds[name].append(_step(sources, host, give_back))
        pool.end_step()
    step_bytes = 2 * nbytes * args.tensors
    rows = []
    for name, times in seconds.items():
        median = statistics.median(times)
        rows.append(
            {
                "way": name,
                "step_ms": median * 1e3,
                "gb_per_s": step_bytes / median / 1e9,
                "x_pool": median / statistics.median(seconds["pool"]),
            }
        )
    return {
        "device": torch.cuda.get_device_name(device) if pinned else "cpu (host to host: no link)",
        "torch": torch.__version__,
        "tensors": args.tensors,
        "bytes_per_tensor": nbytes,
        "steps": args.steps,
        "pool": {"fresh": pool.fresh, "reused": pool.reused, "owned_bytes": pool.owned_bytes},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = measure(args)
    print(
        f"offload's copies on {report['device']}: {report['tensors']} x {report['bytes_per_tensor'] / MiB:.1f} MiB "
        f"out and back a step, median of {report['steps']} steps"
    )
    columns = [("way", "way", "s"), ("step_ms", "step ms", ".2f"), ("gb_per_s", "GB/s", ".2f")]
    print(table(report["rows"], [*columns, ("x_pool", "x pool", ".2f")]))
    pool = report["pool"]
    print(f"pool: {pool['fresh']} buffers allocated, {pool['reused']} leases of them reused")
    write_json(args.out, report)


if __name__ == "__main__":
    main()
