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
- rematd pinned to the next leaner static plan, one block more recomputed: the plan a user who had seen the
  skewed steps would pick, the one rematd's recomputation on balanced steps is weighed against;
- rematd planning, its plans following the router (``rematd.client.steps.router_guard``);
- with ``--titan`` (the default), torchtitan's ``none``, ``full`` and ``selective``, for their step times (rematd
  measures no memory there; its pinned modes hold what torchtitan's do, docs/torchtitan.md).

Per contender: steps over the budget (rematd's measure, either rank), the most a step held, blocks recomputing
whole and in part on balanced steps, what the modes run recompute as the ranks' planners price them from their
profiles (a fraction of a forward: a part recomputed costs less than a block), on balanced and on skewed steps
(medians over the steps after the profiling one), and the median step's seconds on each. Prints a table and
rematd planning's standing against the two static plans; writes JSON (``--out``).
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
from bench.torchtitan_cpu import DIGESTS, FLOAT_EXPERTS, PRICE, RECORD, SKEW, make_assets
from rematd.planner import MODES_BY_LABEL, Mode, letters

MiB = 2**20
RANKS = 2
BLOCKS = 6
"""deepseek_v3_debugmodel's blocks."""
WHOLE = set("R")
"""Modes (by letter) that run a block's whole forward again in backward."""
PART = set("smat")
"""Modes (by letter) that run part of a block's forward again in backward (its pointwise ops, its MLP or experts,
its attention, torchtitan's policy)."""


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
    if not 1 < args.stored < BLOCKS:
        # The static plan stores some blocks, not all, and the leaner one compared stores one fewer.
        p.error(f"--stored must lie between 2 and {BLOCKS - 1}: the static plan's stored blocks, of {BLOCKS}")
    if not 0 <= args.headroom < 1:
        p.error("--headroom must lie in [0, 1): the budget's fraction above the static plan's balanced most")
    args.skewed = sorted({int(k) for k in args.skew.split(",") if k})
    if not args.skewed or min(args.skewed) < 4 or max(args.skewed) > args.steps:
        p.error(f"--skew must name steps from 4 to --steps ({args.steps}): a plan must settle before the first")
    return args


def run(
    args: argparse.Namespace, assets: tuple[Path, Path], where: Path, module: str, ac: list[str], price: str = ""
) -> list[Any]:
    """One training run on two ranks with expert parallel 2, skewed on ``args.skewed``; what each rank recorded
    (with the plans ``price`` names, comma-separated, priced by its planner at each step)."""
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
    env = {RECORD: str(record), DIGESTS: "1", SKEW: skew, FLOAT_EXPERTS: "1", "OMP_NUM_THREADS": "1", PRICE: price}
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
            later = [s[0] for k, s in enumerate(stats[1:], start=2) if (k in args.skewed) == skewed]
            whole = statistics.median(sum(c in WHOLE for c in _ran(s)) for s in later)
            part = statistics.median(sum(c in PART for c in _ran(s)) for s in later)
            row[f"{label}_recomputing"] = f"{whole:g} + {part:g}"
            # Priced by either rank's planner from its profile, the larger: the ranks run the same modes.
            ks = [k for k in range(2, len(stats) + 1) if (k in args.skewed) == skewed]
            row[f"{label}_recompute"] = max(
                statistics.median(r["steps"][k - 1][0]["overhead"] for k in ks) for r in records
            )
            # The plans the run was asked to price, by the same planners: a comparison free of profiles' noise.
            row[f"{label}_priced"] = {
                plan: max(statistics.median(r["steps"][k - 1][0]["priced"][plan] for k in ks) for r in records)
                for plan in stats[-1][0].get("priced", {})
            }
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


def static_plan(stored: int) -> tuple[Mode, ...]:
    """The static plan a user would pick: the first blocks recomputed, the last ``stored`` stored."""
    return (Mode.RECOMPUTE,) * (BLOCKS - stored) + (Mode.STORE,) * stored


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

        def pinned(stored: int) -> tuple[str, list[Any]]:
            plan = static_plan(stored)
            ac = [*ours, "--activation-checkpoint.pin", ",".join(m.label for m in plan)]
            return letters(plan), run(args, assets, runs, rematd, ac, price)

        price = ",".join(letters(static_plan(k)) for k in (args.stored, args.stored - 1))
        static, fixed = pinned(args.stored)
        fits = measured(fixed, skewed=False, args=args)
        budget = int(fits * (1 + args.headroom))
        rows.append(summary(f"rematd pinned to {static}", fixed, args, budget))
        # The static plan a user would need for the skewed steps too: one block more recomputed.
        leaner, records = pinned(args.stored - 1)
        rows.append(summary(f"rematd pinned to {leaner}", records, args, budget))
        planning = [*ours, "--activation-checkpoint.budget-bytes", str(budget)]
        planned = run(args, assets, runs, rematd, planning, price)
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
                ("balanced_recomputing", "blocks recomputing whole + in part, balanced", "s"),
                ("balanced_recompute", "recompute (of a forward), balanced", ".1%"),
                ("skewed_recompute", "skewed", ".1%"),
                ("balanced_s", "step (s), balanced", ".3f"),
                ("skewed_s", "skewed", ".3f"),
                ("last_plan", "last plan", "s"),
            ],
        )
    )
    print(verdict(rows))
    write_json(args.out, {"args": vars(args), "budget_bytes": budget, "rows": rows})


def verdict(rows: list[dict[str, Any]]) -> str:
    """rematd planning against the static plans: the first fitting on balanced steps only, the second on all."""
    made, fitting, planning = rows[0], rows[1], rows[2]
    leaner = fitting["contender"].removeprefix("rematd pinned to ")
    same = planning["balanced_priced"].get(leaner)
    priced = f" ({leaner} {same:.1%} as the same planners price it)" if same is not None else ""
    lines = [
        f"steps over the budget: {made['contender']} {made['over']}, {fitting['contender']} {fitting['over']}, "
        f"rematd planning {planning['over']}",
        f"recompute on balanced steps, as the planners price it: rematd planning "
        f"{planning['balanced_recompute']:.1%} of a forward{priced}, {fitting['contender']} "
        f"{fitting['balanced_recompute']:.1%}; balanced step {planning['balanced_s'] / fitting['balanced_s']:.3f}x "
        f"{fitting['contender']}'s",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
