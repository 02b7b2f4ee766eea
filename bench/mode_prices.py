"""What each mode costs a step, as the profile prices it and as pinned steps measure it.

    python -m bench.mode_prices                 # the phases benchmark's GPT: 12 blocks, d_model 96, 2 x 256 tokens
    python -m bench.mode_prices --quick         # 2 blocks, d_model 32, 2 x 16 tokens (a smoke run)

The demo GPT is attached with an ample budget; its first step profiles every block, and the profile's price of
each mode (the seconds it adds to a step over storing), as the planner has it, is read: the blocks are alike, so
it is the median over them, of which the checkpoint's own work around the region is shown apart (on a CPU:
the share no measured scale moves). Then every block is pinned to one mode at a time, in ``--rounds`` rounds
each in the same order, two steps to settle and ``--steps`` timed:
what a mode adds per block is its median step less storing's, over the blocks. Both are also given as a share
of recomputing's, which is what the planner weighs modes by: a mode priced far below its measured share is one
the per-block prices choose too often until the steps show otherwise. The JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from bench.common import gpt, table, timed_step, tokens, write_json
from rematd import client
from rematd.client.introspect import hello
from rematd.planner import Mode

MODES = (Mode.STORE, Mode.SELECTIVE, Mode.TITAN, Mode.ATTENTION, Mode.MLP, Mode.RECOMPUTE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.mode_prices", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 blocks, d_model 32, 16 tokens, 1 round of 2 steps")
    p.add_argument("--layers", type=int, default=12, help="blocks (12)")
    p.add_argument("--d-model", type=int, default=96, help="model width (96)")
    p.add_argument("--batch", type=int, default=2, help="sequences a step (2)")
    p.add_argument("--seq", type=int, default=256, help="tokens a sequence (256)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the modes (3)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode and round (6)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--out", default="artifacts/mode-prices.json", help="JSON results file")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.seq, args.rounds, args.steps = 2, 32, 16, 1, 2
    for name in ("layers", "d_model", "batch", "seq", "rounds", "steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model = gpt(args.layers, args.d_model, 4, max_seq_len=args.seq)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = tokens(args.batch, args.seq, 0)

    with client.attach(model, optimizer=opt, budget_bytes=2**40) as h:

        def step() -> float:
            return timed_step(model, opt, data)

        step()  # profiles every block
        # As the planner has them: the blocks are alike, each mode priced at its median over them.
        measured = hello(h).blocks[0]
        priced = {c.mode: c.extra_seconds for c in measured.modes}
        fixed = {c.mode: c.fixed_seconds for c in measured.modes}
        modes = [m for m in MODES if m in priced]
        times: dict[Mode, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                h.pin_modes((mode,) * args.layers)
                step()
                step()
                times[mode].extend(step() for _ in range(args.steps))
    store = statistics.median(times[Mode.STORE])
    added = {m: (statistics.median(times[m]) - store) / args.layers for m in modes}
    recompute_priced, recompute_added = priced.get(Mode.RECOMPUTE) or 0.0, added.get(Mode.RECOMPUTE) or 0.0
    rows = [
        {
            "mode": m.name.lower(),
            "step_ms": statistics.median(times[m]) * 1e3,
            "measured_ms_per_block": added[m] * 1e3,
            "priced_ms_per_block": priced[m] * 1e3,
            "fixed_ms_per_block": fixed[m] * 1e3,
            "measured_share": added[m] / recompute_added if recompute_added > 0 else None,
            "priced_share": priced[m] / recompute_priced if recompute_priced > 0 else None,
        }
        for m in modes
    ]
    return {
        "torch": torch.__version__,
        "threads": args.threads,
        "setup": {k: getattr(args, k) for k in ("layers", "d_model", "batch", "seq", "rounds", "steps")},
        "profiled_forward_ms_per_block": measured.forward_seconds * 1e3,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args)
    print(
        f"{args.layers} blocks, d_model {args.d_model}, {args.batch} x {args.seq} tokens, {args.threads} thread(s); "
        f"the profile prices a block's forward at {report['profiled_forward_ms_per_block']:.3f} ms"
    )
    columns = [
        ("mode", "mode", ""),
        ("step_ms", "step ms", ".1f"),
        ("measured_ms_per_block", "measured ms a block", ".3f"),
        ("priced_ms_per_block", "priced ms a block", ".3f"),
        ("fixed_ms_per_block", "of it the checkpoint's own", ".3f"),
        ("measured_share", "measured / recompute", ".2f"),
        ("priced_share", "priced / recompute", ".2f"),
    ]
    print(table(report["rows"], columns))
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
