"""DeepSpeed ZeRO-3 with rematd: all-gathers per step, and step time, against plain ZeRO-3.

    python -m bench.deepspeed            # 2 CPU ranks (gloo, DS_ACCELERATOR=cpu), a stock Llama config
    python -m bench.deepspeed --quick    # a small model and three engines a configuration, for a smoke run

Each rank trains one model under two ZeRO-3 configurations: parameters released after every use (each use is
an all-gather) and DeepSpeed's defaults with no parameter persistent (prefetching along its recorded fetch
order, parameters kept while reused). Under each, four engines take the same batches: plain ZeRO-3, rematd
with every block recomputed, rematd switching from storing to recomputing at step ``--switch-at``, and the
same switch with ZeRO-3's trace left to notice the switch by itself. Counted per step: all-gathers in forward
and backward. Timed, without counting: plain and all-recompute, the median of ``--timed`` steps. Prints a
table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from typing import Any

import torch

from bench.fsdp import build, run_bench
from bench.zero3 import LIVE, RELEASED

CONFIGS = {"released": RELEASED, "live": LIVE}
CONTENDERS = ("plain", "recompute", "switch", "switch, trace left alone")
QUICK_CONTENDERS = CONTENDERS[:3]
"""``--quick`` leaves out the switch whose trace is left alone (the contrast the full run's table draws)."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="counted steps per engine (default 8)")
    p.add_argument("--switch-at", type=int, default=4, help="the step the switching engine starts recomputing")
    p.add_argument("--timed", type=int, default=6, help="timed steps of plain and all-recompute (default 6)")
    p.add_argument("--quick", action="store_true", help="a small model, few steps, three engines a configuration")
    p.add_argument("--out", default="artifacts/deepspeed.json", help="where the JSON goes")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq, args.steps, args.switch_at, args.timed = 2, 64, 32, 5, 2, 2
    return args


def engine(args: argparse.Namespace, zero: dict[str, Any], contender: str) -> tuple[Any, Any]:
    """A fresh engine for ``contender`` and rematd's handle on it (None for plain ZeRO-3)."""
    import deepspeed

    from rematd import client

    model = build(args, torch.device("cpu"))
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": 3, **zero},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    eng, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if contender == "plain":
        return eng, None
    h = client.attach(eng, job="bench-deepspeed")
    h.pin_modes("recompute" if contender == "recompute" else "store")
    return eng, h


def step(eng: Any, ids: torch.Tensor) -> None:
    eng.backward(eng(input_ids=ids, labels=ids).loss)
    eng.step()


class Run:
    """One engine of a configuration: its all-gathers per counted step and its timed steps."""

    def __init__(self, args: argparse.Namespace, zero: dict[str, Any], contender: str) -> None:
        self.args, self.contender = args, contender
        self.engine, self.handle = engine(args, zero, contender)
        self.gathers: list[int] = []
        self.seconds: list[float] = []

    def count(self, batches: list[Any]) -> None:
        from bench.collectives import counting
        from rematd.client.parallel.zero import Zero3

        own = Zero3.switched
        if self.contender.endswith("left alone"):
            Zero3.switched = lambda self, rerun: None  # type: ignore[method-assign]
        try:
            for k, ids in enumerate(batches):
                if self.handle is not None and self.contender.startswith("switch") and k == self.args.switch_at:
                    self.handle.pin_modes("recompute")
                with counting() as counts:
                    step(self.engine, ids)
                self.gathers.append(counts.get("all_gather", 0))
        finally:
            Zero3.switched = own  # type: ignore[method-assign]

    def time(self, ids: Any) -> None:
        start = time.perf_counter()
        step(self.engine, ids)
        self.seconds.append(time.perf_counter() - start)

    def result(self) -> dict[str, Any]:
        if self.handle is not None:
            self.handle.close()
        return {"gathers": self.gathers, "step_seconds": statistics.median(self.seconds) if self.seconds else None}


def configuration(args: argparse.Namespace, zero: dict[str, Any], batches: list[Any]) -> dict[str, Any]:
    """Every contender's counted steps, then plain and all-recompute timed in turn, step by step (the
    machine's load drifts alike for both)."""
    runs = {c: Run(args, zero, c) for c in (QUICK_CONTENDERS if args.quick else CONTENDERS)}
    for run in runs.values():
        run.count(batches[: args.steps])
    for ids in batches[args.steps :]:
        for c in ("plain", "recompute"):
            runs[c].time(ids)
    return {c: run.result() for c, run in runs.items()}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    data = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, 4096, (args.batch, args.seq), generator=data) for _ in range(args.steps + args.timed)]
    result = {name: configuration(args, zero, batches) for name, zero in CONFIGS.items()}
    torch.distributed.destroy_process_group()
    return {"rank": rank, "configs": result}


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    lines = [
        f"ZeRO-3, {args.ranks} CPU rank(s): Llama {args.layers} layers x {args.hidden}, batch {args.batch} x "
        f"{args.seq} per rank; the switching engines go from storing to recomputing at step {args.switch_at}",
        "",
        "| ZeRO-3 parameters | engine | all-gathers per step (rank 0) | step ms | x plain |",
        "|---|---|---|---|---|",
    ]
    for name, contenders in results[0]["configs"].items():
        base = contenders["plain"]["step_seconds"]
        for c, row in contenders.items():
            sec = row["step_seconds"]
            timing = f"{1000 * sec:.1f} | {sec / base:.2f}" if sec and base else "- | -"
            lines.append(f"| {name} | {c} | {' '.join(map(str, row['gathers']))} | {timing} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_bench("bench.deepspeed", argv, parse, worker, report)
    if "--worker" in (sys.argv[1:] if argv is None else argv):
        # A rank's result is written. DeepSpeed keeps its gloo groups' threads alive past
        # destroy_process_group, and one still releasing a collective's tensors when Python finalises
        # aborts the rank: end it without finalising.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
