"""How long the planner takes: one solve, and one observed step of a session.

    python -m bench.planner_speed

Targets: < 1 ms per solve for 128 blocks, < 20 ms for 1,000 blocks.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

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


def timeit(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="artifacts/bench-planner.json")
    args = parser.parse_args()
    rows = []
    for n in (32, 128, 1000):
        for kind in ("uniform", "jittered"):
            rng = random.Random(n) if kind == "jittered" else None
            profile = Profile(blocks=tuple(block(rng) for _ in range(n)), shape=REF)
            options = profile.options_at()
            store_all = sum(o[0].kept for o in options)
            target = store_all // 2
            solve_s = timeit(lambda options=options, target=target: solve(options, target), 20 if n < 1000 else 5)
            session = PlannerSession(profile, budget_bytes=int(store_all * 0.6))
            seqs = [128, 256, 384, 512]
            steps = iter(range(10**9))

            def observe(
                session: PlannerSession = session,
                steps: Any = steps,
                seqs: list[int] = seqs,
                store_all: int = store_all,
            ) -> None:
                step = next(steps)
                seq = seqs[step % len(seqs)]
                session.observe(
                    StepObservation(
                        step=step,
                        peak_bytes=int(store_all * 0.5),
                        budget_bytes=int(store_all * 0.6),
                        shape=Shape(batch=8, seq_len=seq, tokens=8 * seq),
                        plan_version=session.plan.version,
                    )
                )

            for _ in range(8):
                observe()  # the table settles; later steps hit its memo
            observe_s = timeit(observe, 50 if n < 1000 else 10)
            rows.append({"blocks": n, "kind": kind, "solve_ms": solve_s * 1e3, "observe_ms": observe_s * 1e3})
            print(
                f"  {n:5d} blocks {kind:9s} solve {solve_s * 1e3:8.3f} ms  observe {observe_s * 1e3:8.3f} ms",
                flush=True,
            )
    print()
    print(
        table(
            rows,
            [
                ("blocks", "blocks", "d"),
                ("kind", "costs", ""),
                ("solve_ms", "solve ms", ".3f"),
                ("observe_ms", "observed step ms", ".3f"),
            ],
        )
    )
    write_json(args.out, {"rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
