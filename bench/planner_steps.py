"""What the in-process planner costs the training thread, step by step, in the phases benchmark's job.

    python -m bench.planner_steps                 # 12-block GPT, d_model 96, batch 2, 45% budget, 256/160/96

Without ``server=`` the planner runs in the training process, on the step's own thread: each step's
``observe`` (learning, re-planning, and every few steps a look for a plan worth a trial, which solves a
few dozen plans) adds to the step. Printed per phase: the planner's mean and largest milliseconds per
step, against the step's own mean, and the share of the step it is.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.common import Timed, freed_memory_kept, malloc_argument, table, timed_step, tokens, write_json
from bench.phases import Setup, attach
from rematd.planner import Mode


def run(setup: Setup, ratio: float) -> list[dict[str, Any]]:
    none = attach(setup, 2**50)
    none.handle.pin_modes((Mode.STORE,) * setup.n_layer)  # type: ignore[union-attr]
    timed_step(none.model, none.opt, tokens(setup.batch, max(setup.lengths), 0), none.handle.step)  # type: ignore[union-attr]
    budget = int(none.handle.last_stats.saved_peak_bytes * ratio)  # type: ignore[union-attr]
    ours = attach(setup, budget)
    rows = []
    with Timed() as timed:
        for phase, seq in enumerate(setup.lengths):
            timed.seconds.clear()
            steps = []
            for i in range(setup.steps):
                start = time.perf_counter()
                timed_step(ours.model, ours.opt, tokens(setup.batch, seq, 1000 * phase + i), ours.handle.step)  # type: ignore[union-attr]
                steps.append(time.perf_counter() - start)
            planner = sum(timed.seconds) / len(timed.seconds)
            step = sum(steps) / len(steps)
            rows.append(
                {
                    "seq": seq,
                    "planner_ms": planner * 1e3,
                    "planner_max_ms": max(timed.seconds) * 1e3,
                    "step_ms": step * 1e3,
                    "share": planner / step,
                }
            )
    for r in (none, ours):
        r.handle.close()  # type: ignore[union-attr]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per phase (60)")
    parser.add_argument("--budget", type=float, default=0.45, help="budget, a fraction of no checkpointing's peak")
    parser.add_argument("--out", default="artifacts/bench-planner-steps.json")
    malloc_argument(parser)
    args = parser.parse_args()
    malloc_kept = freed_memory_kept(args)
    torch.set_num_threads(1)
    setup = Setup(n_layer=12, d_model=96, n_head=4, batch=2, lengths=(256, 160, 96), warmup=0, steps=args.steps)
    rows = run(setup, args.budget)
    cols = [
        ("seq", "length", "d"),
        ("planner_ms", "planner ms/step", ".2f"),
        ("planner_max_ms", "largest ms", ".1f"),
        ("step_ms", "step ms", ".1f"),
        ("share", "planner / step", ".1%"),
    ]
    print(table(rows, cols))
    write_json(args.out, {"torch": torch.__version__, "freed_memory_kept": malloc_kept, "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
