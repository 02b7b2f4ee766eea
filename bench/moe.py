"""A mixture of experts under a budget whose router is skewed on some steps: plans that follow the router.

    python -m bench.moe                     # deepseek_v3_debugmodel, 2 CPU ranks, expert parallel 2, 16 steps
    python -m bench.moe --steps 12 --skew 8,10,11 --no-titan

torchtitan 0.3.0's ``deepseek_v3_debugmodel`` (6 blocks: a dense one, then five of attention, two shared experts
and 8 routed experts, 3 picked per token) trained by its own trainer on two CPU ranks (gloo) with expert parallel
2: each rank holds 4 routed experts, and on a balanced step receives about 3 rows per token of its batch. On the
skewed steps (``--skew``) every router sends every token to experts 0-2 (``bench.torchtitan_cpu``'s
``REMATD_TITAN_SKEW``), all on rank 0, which then receives twice its usual rows while rank 1 receives none: a
batch all of one kind of token. Parameters and the experts' matmuls are float32 (``--training.mixed-precision-param
float32``, ``REMATD_TITAN_FLOAT_EXPERTS``): bfloat16's are several times slower on CPUs without its instructions.

The static plan is one a user would pick: the first blocks recomputed and the last ``--stored`` (default half)
stored, pinned through rematd. Its run, skewed like the others, sets the budget: its most on balanced steps
(rematd's measure, either rank) and ``--headroom`` (default 2%) above it, a budget sized to the static plan as a
user sizes one to the steps they have seen. rematd plans to a target ``--margin`` (default 1%) under the budget,
less than the headroom, so the static plan itself is among the plans that meet it. Then, each a run of its own
under that budget and the same skew:

- rematd pinned to the static plan (a pin is left as it is): over the budget where the skew adds more than
  the headroom;
- rematd planning, its plans following the router (``rematd.client.steps.router_guard``);
- with ``--titan`` (the default), torchtitan's ``none``, ``full`` and ``selective``, for their step times (rematd
  measures no memory there; its pinned modes hold what torchtitan's do, docs/torchtitan.md).

Per contender: steps over the budget (rematd's measure, either rank), the most a step held, blocks recomputing on
balanced and on skewed steps (their median over the steps after the profiling one), and the median step's
seconds on each. Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import table, write_json
from bench.launch import run_launcher
from bench.torchtitan_cpu import DIGESTS, FLOAT_EXPERTS, RECORD, SKEW, make_assets
from rematd.planner import MODES_BY_LABEL

MiB = 2**20
RANKS = 2
BLOCKS = 6
"""deepseek_v3_debugmodel's blocks."""
RECOMPUTING = set("RsmatO")
"""Modes (by letter) that run some of a block's forward again in backward."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="training steps a run (the first profiles)")
    p.add_argument("--skew", default="8,11,12,15", help="steps (from 1) whose routers are skewed")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--stored", type=int, default=3, help="the static plan's last blocks stored (of 6)")
    p.add_argument("--headroom", type=float, default=0.02, help="the budget above the static plan's balanced most")
    p.add_argument("--margin", type=float, default=0.01, help="rematd's margin under the budget (its flag's)")
    p.add_argument("--titan", action=argparse.BooleanOptionalAction, default=True, help="torchtitan's modes too")
    p.add_argument("--out", default="artifacts/moe.json", help="where the JSON goes")
    args = p.parse_args(argv)
    if not 0 < args.stored < BLOCKS:
        p.error(f"--stored must lie between 1 and {BLOCKS - 1}: a static plan that stores some blocks, not all")
    if not 0 <= args.headroom < 1:
        p.error("--headroom must lie in [0, 1): the budget's fraction above the static plan's balanced most")
    args.skewed = sorted({int(k) for k in args.skew.split(",") if k})
    if not args.skewed or min(args.skewed) < 4 or max(args.skewed) > args.steps:
        p.error(f"--skew must name steps from 4 to --steps ({args.steps}): a plan must settle before the first")
    return args


def run(args: argparse.Namespace, assets: tuple[Path, Path], where: Path, module: str, ac: list[str]) -> list[Any]:
    """One training run on two ranks with expert parallel 2, skewed on ``args.skewed``; what each rank recorded."""
    record = where / f"run{len(list(where.iterdir()))}"
    record.mkdir()
    tokenizer, data = assets
    titan = [
        *("--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--hf-assets-path", str(tokenizer)),
        *("--dataloader.dataset-path", str(data), "--dump-folder", str(record / "out")),
        *("--training.steps", str(args.steps), "--training.seq-len", str(args.seq)),
        *("--training.local-batch-size", "2", "--debug.seed", "0", "--training.disable-cuda-graphs"),
        *("--parallelism.spmd-backend", "partial_dtensor", "--parallelism.expert-parallel-degree", "2"),
        *("--metrics.log-freq", str(args.steps), "--training.mixed-precision-param", "float32"),
    ]
    launcher = ["--standalone", "--nproc-per-node", str(RANKS), "-m", "bench.torchtitan_cpu"]
    skew = ",".join(map(str, args.skewed))
    env = {RECORD: str(record), DIGESTS: "1", SKEW: skew, FLOAT_EXPERTS: "1", "OMP_NUM_THREADS": "1"}
    run_launcher("torch.distributed.run", [*launcher, module, *titan, *ac], timeout=3600, env=env)
    return [torch.load(record / f"rank{r}.pt", weights_only=False) for r in range(RANKS)]


def measured(records: list[Any], *, skewed: bool, args: argparse.Namespace) -> int:
    """The most rematd measured on either rank over the balanced (or skewed) steps after the profiling one."""
    return max(
        s[0]["measured"] for r in records for k, s in enumerate(r["steps"][1:], start=2) if (k in args.skewed) == skewed
    )


def summary(name: str, records: list[Any], args: argparse.Namespace, budget: int) -> dict[str, Any]:
    seconds = records[0]["seconds"]
    row: dict[str, Any] = {"contender": name}
    for label, skewed in (("balanced", False), ("skewed", True)):
        steps = [k for k in range(2, args.steps + 1) if (k in args.skewed) == skewed and k != args.skewed[0]]
        row[f"{label}_s"] = statistics.median(seconds[k - 1] for k in steps) if steps else 0.0
    stats = records[0]["steps"]
    if stats and stats[-1]:
        row["over"] = sum(  # steps over on either rank
            any(r["steps"][k][0]["measured"] > budget for r in records) for k in range(1, len(stats)) if stats[k]
        )
        row["held_mib"] = max(measured(records, skewed=False, args=args), measured(records, skewed=True, args=args))
        row["held_mib"] /= MiB
        for label, skewed in (("balanced", False), ("skewed", True)):
            ran = [
                sum(c in RECOMPUTING for c in _ran(s[0]))
                for k, s in enumerate(stats[1:], start=2)
                if (k in args.skewed) == skewed
            ]
            row[f"{label}_recomputing"] = statistics.median(ran)
        row["last_plan"] = "".join(_plan_letters(stats[-1][0]))
        row["steps"] = [
            {
                "step": k,
                "skewed": k in args.skewed,
                **{f"rank{r}": _step_detail(record["steps"][k - 1][0]) for r, record in enumerate(records)},
            }
            for k in range(1, args.steps + 1)
        ]
    return row


def _step_detail(step: dict[str, Any]) -> dict[str, Any]:
    """A step as one rank saw it: the plan's modes and the modes run, the prediction, the measure, the reason."""
    return {
        "plan": "".join(_plan_letters(step)),
        "ran": _ran(step),
        "predicted_mib": round(step["predicted"] / MiB, 1),
        "measured_mib": round(step["measured"] / MiB, 1),
        "routed_mib": round(step["routed"] / MiB, 1),
        "reason": step["ran_reason"],
    }


def _ran(step: dict[str, Any]) -> str:
    """The modes a step ran, a letter a block (its report names them where a step has them; else its plan's)."""
    return step["ran"] or "".join(_plan_letters(step))


def _plan_letters(step: dict[str, Any]) -> list[str]:
    """The modes of the plan in force after a step, a letter a block."""
    return [MODES_BY_LABEL[m].letter for m in step["modes"]]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    titan, rematd = "torchtitan.train", "rematd.integrations.torchtitan"
    ours = ["activation-checkpoint:rematd", "--activation-checkpoint.margin", str(args.margin)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rematd-moe-") as tmp:
        where = Path(tmp)
        assets = make_assets(where / "assets")
        runs = where / "runs"
        runs.mkdir()
        pin = ["recompute"] * (BLOCKS - args.stored) + ["store"] * args.stored
        static = "".join(MODES_BY_LABEL[label].letter for label in pin)
        fixed = run(args, assets, runs, rematd, [*ours, "--activation-checkpoint.pin", ",".join(pin)])
        fits = measured(fixed, skewed=False, args=args)
        budget = int(fits * (1 + args.headroom))
        planned = run(args, assets, runs, rematd, [*ours, "--activation-checkpoint.budget-bytes", str(budget)])
        rows.append(summary(f"rematd pinned to {static}", fixed, args, budget))
        rows.append(summary("rematd planning", planned, args, budget))
        if args.titan:
            for mode in ("none", "full", "selective"):
                records = run(args, assets, runs, titan, [f"activation-checkpoint:{mode}"])
                rows.append(summary(f"torchtitan {mode}", records, args, budget))
    print(
        f"deepseek_v3_debugmodel, 2 CPU ranks, expert parallel 2; skewed steps {args.skew}; "
        f"budget {budget / MiB:.1f} MiB: {args.headroom:.0%} above the static plan {static}'s most on balanced "
        f"steps, {fits / MiB:.1f} MiB (rematd's measure)\n"
    )
    print(
        table(
            rows,
            [
                ("contender", "contender", "s"),
                ("over", "steps over the budget", "d"),
                ("held_mib", "most held (MiB)", ".1f"),
                ("balanced_recomputing", "blocks recomputing, balanced", ".1f"),
                ("skewed_recomputing", "skewed", ".1f"),
                ("balanced_s", "step (s), balanced", ".3f"),
                ("skewed_s", "skewed", ".3f"),
                ("last_plan", "last plan", "s"),
            ],
        )
    )
    write_json(args.out, {"args": vars(args), "budget_bytes": budget, "rows": rows})


if __name__ == "__main__":
    main()
