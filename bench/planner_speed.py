"""How long the planner takes: one solve, and one observed step of a session.

    python -m bench.planner_speed

Targets: < 1 ms per solve for 128 blocks, < 20 ms for 1,000 blocks. Costs are
those of GPT blocks (d_model 256), either identical ("uniform", as measured
profiles of a transformer are) or each block jittered to 0.5-1.5x ("jittered",
the worst case: no two blocks alike, thousands of distinct caps). The gap
column is the solution's extra seconds over those of the same rounded greedy
with every cap scanned, the largest over five budgets.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable

from bench.common import median, table, write_json
from rematd.planner import (
    BlockCost,
    Mode,
    ModeCost,
    PlannerSession,
    Profile,
    Shape,
    Size,
    StepObservation,
    Term,
    solve,
)
from rematd.planner.knapsack import Knapsack
from rematd.planner.solvers import solve_prepared

REF = Shape(batch=8, seq_len=256, tokens=2048)


def block(rng: random.Random | None) -> BlockCost:
    """A transformer block's costs (bytes from a d_model 256 GPT block); jittered when ``rng`` is given."""
    j = (lambda: rng.uniform(0.5, 1.5)) if rng else (lambda: 1.0)
    lin, quad, x = int(20e6 * j()), int(48e6 * j()), int(2e6 * j())
    t = 0.02 * j()
    return BlockCost(
        saved_bytes=lin + quad,
        input_bytes=x,
        forward_seconds=t,
        modes=(
            ModeCost(mode=Mode.STORE, kept=Size((Term(lin, 1, 1), Term(quad, 1, 2)))),
            ModeCost(
                mode=Mode.SELECTIVE,
                kept=Size((Term(lin // 2, 1, 1), Term(quad // 3, 1, 2))),
                transient=Size((Term(lin // 2, 1, 1), Term(2 * quad // 3, 1, 2))),
                extra_seconds=t * 0.3,
            ),
            ModeCost(
                mode=Mode.RECOMPUTE,
                kept=Size((Term(x, 1, 1),)),
                transient=Size((Term(lin, 1, 1), Term(quad, 1, 2))),
                extra_seconds=t,
            ),
            ModeCost(mode=Mode.OFFLOAD, kept=Size(), transient=Size((Term(lin + quad, 1, 1),)), extra_seconds=t * 2),
        ),
    )


CLOCK = time.perf_counter
"""The clock ``timeit`` reads: wall-clock, or with ``--cpu-time`` this process's CPU seconds (on a shared
machine, what other processes take does not count)."""


def timeit(fn: Callable[[int], object], repeat: int) -> float:
    """Median seconds of ``fn(i)`` over ``repeat`` calls."""
    times = []
    for i in range(repeat):
        start = CLOCK()
        fn(i)
        times.append(CLOCK() - start)
    return median(times)


def every_cap(knapsack: Knapsack, budget: int) -> float:
    """The rounded greedy's seconds with every cap scanned: what the solver's cap search must match."""
    values = [
        knapsack._scan(j, budget - cap)
        for j, cap in enumerate(knapsack.caps)
        if cap <= budget and knapsack._lean[j] + cap <= budget
    ]
    return min(values, default=math.inf)


def observed_step_seconds(profile: Profile, store_all: int, repeat: int) -> float:
    """A session's whole step: observation, correction, table lookups, re-plans where due."""
    session = PlannerSession(profile, budget_bytes=int(store_all * 0.6))
    seqs = [128, 256, 384, 512]
    jitter = random.Random(1)

    def observe(step: int) -> None:
        seq = seqs[step % len(seqs)]
        session.observe(
            StepObservation(
                step=step,
                # Measured peaks wander, as real ones do, so the correction (and the plans) move.
                peak_bytes=int(store_all * 0.5 * jitter.uniform(0.9, 1.1)),
                budget_bytes=int(store_all * 0.6),
                shape=Shape(batch=8, seq_len=seq, tokens=8 * seq),
                plan_version=session.plan.version,
            )
        )

    for step in range(8):
        observe(step)  # every shape of the table prepared once
    return timeit(lambda i: observe(8 + i), repeat)


def measure(n: int, kind: str) -> dict[str, object]:
    rng = random.Random(n) if kind == "jittered" else None
    profile = Profile(blocks=tuple(block(rng) for _ in range(n)), shape=REF)
    options = profile.options_at()
    store_all = sum(o[0].kept for o in options)
    targets = [int(store_all * f) for f in (0.2, 0.35, 0.5, 0.65, 0.8)]
    repeat = 20 if n < 1000 else 5
    # A new shape each time, so that nothing is reused.
    shapes = [Shape(batch=8, seq_len=257 + i, tokens=8 * (257 + i)) for i in range(repeat)]
    cold_s = timeit(lambda i: solve(profile.options_at(shapes[i]), targets[2]), repeat)
    knapsack = Knapsack(options)
    solve_s = timeit(lambda i: solve_prepared(knapsack, options, targets[i % len(targets)]), repeat * 5)
    gaps = []
    for target in targets:
        got = solve_prepared(knapsack, options, target, exact=False).extra_seconds
        best = every_cap(knapsack, target)
        gaps.append(got / best - 1.0 if best > 0 else 0.0)
    observe_s = observed_step_seconds(profile, store_all, 50 if n < 1000 else 20)
    print(
        f"  {n:5d} blocks {kind:9s} cold {cold_s * 1e3:8.3f} ms  solve {solve_s * 1e3:8.3f} ms  "
        f"observe {observe_s * 1e3:8.3f} ms  gap {max(gaps):.2%}",
        flush=True,
    )
    return {
        "blocks": n,
        "kind": kind,
        "caps": len(knapsack.caps),
        "cold_ms": cold_s * 1e3,
        "solve_ms": solve_s * 1e3,
        "observe_ms": observe_s * 1e3,
        "gap_max": max(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="artifacts/bench-planner.json")
    parser.add_argument("--cpu-time", action="store_true", help="time by this process's CPU seconds, not wall-clock")
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    rows = [measure(n, kind) for n in (32, 128, 1000) for kind in ("uniform", "jittered")]
    print()
    print(
        table(
            rows,
            [
                ("blocks", "blocks", "d"),
                ("kind", "costs", ""),
                ("caps", "caps", "d"),
                ("cold_ms", "cold ms", ".3f"),
                ("solve_ms", "solve ms", ".3f"),
                ("observe_ms", "observed step ms", ".3f"),
                ("gap_max", "gap vs every cap", ".2%"),
            ],
        )
    )
    print(
        "\ncold: options at a new shape, preparing them and one solve; solve: a new target at a "
        "prepared shape (a re-plan); observed step: a session's whole step, table lookups included"
    )
    write_json(args.out, {"rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
