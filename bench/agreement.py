"""What the ranks' plan agreement costs per step, at several world sizes: collectives and bytes per rank.

``python -m bench.agreement`` runs the agreement of ``rematd.client.parallel.agreement`` on 2, 4 and 8 CPU
ranks (gloo) over the default group, as a device mesh's group or ZeRO-3's data-parallel group would run it, for a
model of ``--blocks`` blocks, each rank putting forward modes of its own. It counts, at the dispatcher, the
collectives each step issues and the bytes each rank hands them, checks that every rank runs, per block, the
leanest mode any rank put forward and shows the newest plan version any put forward, and prints a table. The
figures do not grow with the world: one all-reduce a step of a 32-bit integer per block and one for the version
(and, at the first step only, one of two integers that checks the ranks' block counts).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


class _Collectives(TorchDispatchMode):
    """Collectives issued, and the bytes of the tensors this rank hands them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            self.count += 1
            for a in args:
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, torch.Tensor):
                        self.bytes += t.numel() * t.element_size()
        return func(*args, **(kwargs or {}))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=str, default="2,4,8", help="world sizes, comma-separated")
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="bench/results/agreement.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from rematd.client.parallel.agreement import Agreement

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agreement = Agreement([None], "every rank")
    steps = []
    for step in range(args.steps):
        rng = random.Random(1000 * step + rank)
        codes = [rng.choice((0, 2, 4)) for _ in range(args.blocks)]
        version = rng.randrange(1, 100)
        counted = _Collectives()
        began = time.perf_counter()
        with counted:
            agreed, shown = agreement.agree(codes, version)
        seconds = time.perf_counter() - began
        everyone: list[tuple[list[int], int]] = [([], 0) for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, (codes, version))
        leanest = [max(column) for column in zip(*(c for c, _ in everyone), strict=True)]
        newest = max(v for _, v in everyone)
        steps.append(
            {
                "collectives": counted.count,
                "bytes": counted.bytes,
                "seconds": seconds,
                "ok": agreed == leanest and shown == newest,
            }
        )
    dist.destroy_process_group()
    return {"rank": rank, "world": dist.get_world_size() if dist.is_initialized() else 0, "steps": steps}


def report(args: argparse.Namespace, runs: dict[int, list[dict[str, Any]]]) -> str:
    lines = [
        f"The plan agreement over every rank (gloo, CPU), {args.blocks} blocks, {args.steps} steps:",
        "",
        "| ranks | collectives, first step | bytes per rank, first step | collectives per step after | "
        "bytes per rank per step after | every rank runs the leanest modes |",
        "|---|---|---|---|---|---|",
    ]
    for world, ranks in sorted(runs.items()):
        first = {(r["steps"][0]["collectives"], r["steps"][0]["bytes"]) for r in ranks}
        later = {(s["collectives"], s["bytes"]) for r in ranks for s in r["steps"][1:]}
        ok = all(s["ok"] for r in ranks for s in r["steps"])
        ((c0, b0),) = first if len(first) == 1 else [(-1, -1)]
        ((c1, b1),) = later if len(later) == 1 else [(-1, -1)]
        lines.append(f"| {world} | {c0} | {b0} | {c1} | {b1} | {'yes' if ok else 'NO'} |")
    return "\n".join(lines)


def each_world(args: argparse.Namespace, argv: list[str]) -> dict[int, list[dict[str, Any]]]:
    """The ranks' results at each world size of ``--ranks``."""
    from bench.fsdp import launch

    return {
        world: launch(argparse.Namespace(ranks=world, out=args.out), argv, "bench.agreement")
        for world in (int(w) for w in args.ranks.split(","))
    }


def main(argv: list[str] | None = None) -> None:
    from bench.fsdp import run_bench

    run_bench("bench.agreement", argv, parse, worker, report, ranks=each_world)


if __name__ == "__main__":
    main()
