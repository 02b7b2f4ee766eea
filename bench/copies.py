"""How far apart copies of one model running the same plan measure, beside bench.phases' other contenders.

    python -m bench.copies --threads 1 --copies 3 --warmup 56 --steps 100
    python -m bench.copies --quick       # a small model, for a smoke run

bench.phases judges rematd against one copy of the fastest static plan. This
runs the first phase of its documented scenario (a 12-block GPT, d_model 96,
batch 2, 256 tokens, its two budgets, every static plan it would race) with
``--copies`` copies of two plans that place
the same blocks' recomputation differently (by default ``RRRR........`` and
``R..R..R..R..``, bench.phases' contenders at 70%), in rounds of their own
random order, and prints each contender's median step over no
checkpointing's, with its quartiles and the 90% confidence interval of the
median. How far the copies of each plan named in ``--plans`` land apart (the
static plans of other names that run the same modes are left out of that
figure, and listed beside) is what a single copy's median cannot tell from a
difference between plans.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

import torch

from bench.common import (
    freed_memory_kept,
    malloc_argument,
    median,
    median_interval,
    table,
    tokens,
    write_json,
)
from bench.phases import Setup, attach, baseline, families, interval_text, per_round, pin_statics, spread_of
from rematd.planner import Mode, Shape, letters

S, R = Mode.STORE, Mode.RECOMPUTE


def parse_plan(text: str, n: int) -> tuple[Mode, ...]:
    """``"RR.."`` as modes: ``R`` recompute, ``.`` store; a clear error for anything else."""
    if len(text) != n or set(text) - {"R", "."}:
        raise ValueError(f"a plan is {n} letters of 'R' (recompute) and '.' (store), got {text!r}")
    return tuple(R if c == "R" else S for c in text)


def run(setup: Setup, budgets: list[float], plans: list[tuple[Mode, ...]], copies: int) -> dict[str, Any]:
    n, seq = setup.n_layer, setup.lengths[0]
    none, none_peak, profile = baseline(setup, seq)
    ours = {f"rematd {b:.0%}": attach(setup, int(none_peak * b)) for b in budgets}
    shape = Shape(batch=setup.batch, seq_len=seq, tokens=setup.batch * seq)
    named: dict[str, tuple[Mode, ...]] = {}
    for b in budgets:
        named.update(families(n, profile, shape, int(none_peak * b)))
    for modes in plans:
        for c in range(copies):
            named[f"{letters(modes)} #{c + 1}"] = modes
    statics: dict[str, Any] = {}
    pin_statics(statics, named, setup, seq)
    runners = {"no checkpointing": none, **ours, **statics}
    everyone = list(runners.values())
    for i in range(setup.warmup + setup.steps):
        data = tokens(setup.batch, seq, i + 1)
        for r in random.Random(i).sample(everyone, len(everyone)):
            r.step(data, record=True)
    rows = []
    for name, r in runners.items():
        if r is none:
            continue
        ratios = per_round(r.times, none.times, setup.steps)
        modes = letters(named[name]) if name in named else letters(r.handle.modes)  # type: ignore[union-attr]
        rows.append(
            {
                "contender": name,
                "modes": modes,
                "ratio": median(ratios),
                "spread": spread_of(ratios),
                "interval": median_interval(ratios, 0.9),
            }
        )
    rows.sort(key=lambda row: row["ratio"])
    for r in everyone:
        r.handle.close()  # type: ignore[union-attr]
    gaps = {}
    for modes in plans:
        mine = [row["ratio"] for row in rows if row["contender"].startswith(letters(modes) + " #")]
        gaps[letters(modes)] = max(mine) / min(mine) - 1.0
    return {"rows": rows, "copy_gaps": gaps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model and few rounds (smoke run)")
    parser.add_argument("--out", default="artifacts/bench-copies.json")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--copies", type=int, default=3, help="copies of each plan (3)")
    parser.add_argument(
        "--plans", default=None, help="the plans run on several copies (RRRR........,R..R..R..R..; --quick: RR..,R.R.)"
    )
    parser.add_argument("--budgets", default="0.45,0.7", help="rematd's budgets, as in bench.phases")
    parser.add_argument("--warmup", type=int, default=56, help="rounds before measuring (56)")
    parser.add_argument("--steps", type=int, default=100, help="measured rounds (100)")
    malloc_argument(parser)
    args = parser.parse_args()
    if args.copies < 2:
        parser.error(f"--copies must be at least 2 (copies of one plan are compared), got {args.copies}")
    kept = freed_memory_kept(args)  # printed on the first line
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        setup = Setup(n_layer=4, d_model=32, n_head=2, batch=2, lengths=(64,), warmup=4, steps=6)
        default_plans = "RR..,R.R."
    else:
        setup = Setup(n_layer=12, d_model=96, n_head=4, batch=2, lengths=(256,), warmup=args.warmup, steps=args.steps)
        default_plans = "RRRR........,R..R..R..R.."
    text = args.plans if args.plans is not None else default_plans
    try:
        plans = [parse_plan(p, setup.n_layer) for p in text.split(",")]
    except ValueError as e:
        parser.error(f"--plans: {e}")
    load_before = os.getloadavg()
    report = {"torch": torch.__version__, "freed_memory_kept": kept, "load_before": load_before}
    report.update(run(setup, [float(x) for x in args.budgets.split(",")], plans, args.copies))
    report["load_after"] = os.getloadavg()
    cols = [
        ("contender", "contender", ""),
        ("modes", "plan", ""),
        ("ratio", "x none", ".3f"),
        ("spread", "(quartiles)", ""),
        ("interval_text", "(90% CI of the median)", ""),
    ]
    print(table([{**r, "interval_text": interval_text(r["interval"])} for r in report["rows"]], cols))
    for plan, gap in report["copy_gaps"].items():
        print(f"copies of {plan}: the slowest {gap:.1%} over the fastest")
    print(f"load average before {load_before}, after {report['load_after']}")
    write_json(args.out, report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
