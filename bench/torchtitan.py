"""rematd inside torchtitan's trainer against torchtitan's own checkpointing, on its debug Llama, at one budget.

    python -m bench.torchtitan                      # 1 CPU rank, sequence 512, batch 4, 8 steps per contender
    python -m bench.torchtitan --ranks 2            # 2 CPU ranks, FSDP (gloo)
    python -m bench.torchtitan --quick              # sequence 128, 5 steps: a smoke run

Each contender is a training run of its own, started as a user would, with torchtitan's arguments (on the CPU
through ``bench.torchtitan_cpu``, which adds the stand-ins torchtitan needs there): ``torchtitan.train``
with ``activation-checkpoint:none``, ``full``, ``selective`` and ``memory-budget`` (``--compile.enable``, its
``--activation-checkpoint.memory-budget``: the compiler's partitioner chooses what to keep), and
``rematd.integrations.torchtitan`` with ``activation-checkpoint:rematd`` at a budget ``--between`` of the way
from its own measure of every block recomputed (a pinned run, first) to every block stored.

Reported per contender: the median step time after the first two steps (compiling, profiling), relative to
``none``; the peak of CPU memory above the step's start during one late step (``--profile-step``), read from
torch's memory profiler (every allocation, compiled code's included; that step is not timed); and for rematd
its plan and its own measured peak against the budget. Prints a table; writes JSON (``--out``).
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
from bench.torchtitan_cpu import PROFILE_STEP, RECORD, make_assets

MiB = 2**20


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1, help="processes (default 1; 2 shards with FSDP)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile-step", type=int, default=0, help="the step whose memory is profiled (default: last)")
    p.add_argument("--between", type=float, default=0.5, help="rematd's budget, 0 (recompute all) to 1 (store all)")
    p.add_argument("--memory-budget", type=float, default=0.5, help="torchtitan's memory-budget mode's setting")
    p.add_argument("--quick", action="store_true", help="sequence 128, 5 steps")
    p.add_argument("--out", default="artifacts/torchtitan.json", help="where the JSON goes")
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.steps = 128, 5
    args.profile_step = args.profile_step or args.steps
    return args


def run(args: argparse.Namespace, assets: tuple[Path, Path], where: Path, module: str, ac: list[str]) -> list[Any]:
    """One training run of ``args.steps`` steps; what each rank recorded."""
    record = where / f"run{len(list(where.iterdir()))}"
    record.mkdir()
    tokenizer, data = assets
    titan = [
        *("--module", "llama3", "--config", "llama3_debugmodel", "--hf-assets-path", str(tokenizer)),
        *("--dataloader.dataset-path", str(data), "--dump-folder", str(record / "out")),
        *("--training.steps", str(args.steps), "--training.seq-len", str(args.seq)),
        *("--training.local-batch-size", str(args.batch), "--debug.seed", "0"),
        *("--parallelism.spmd-backend", "partial_dtensor", "--metrics.log-freq", str(args.steps)),
    ]
    launcher = ["--standalone", "--nproc-per-node", str(args.ranks), "-m", "bench.torchtitan_cpu"]
    env = {RECORD: str(record), PROFILE_STEP: str(args.profile_step), "OMP_NUM_THREADS": "1"}
    run_launcher("torch.distributed.run", [*launcher, module, *titan, *ac], timeout=3600, env=env)
    return [torch.load(record / f"rank{r}.pt", weights_only=False) for r in range(args.ranks)]


def summary(name: str, records: list[Any], profile_step: int) -> dict[str, Any]:
    timed = [s for i, s in enumerate(records[0]["seconds"]) if i >= 2 and i + 1 != profile_step]
    row: dict[str, Any] = {
        "contender": name,
        "step_s": statistics.median(timed),
        "peak_mib": max(r["peaks"][0] for r in records) / MiB,
        "loss": float(records[0]["losses"][-1]),
    }
    steps = records[0]["steps"]
    if steps and steps[-1]:
        last = steps[-1][0]
        row["plan"] = "".join({"store": ".", "selective": "s", "recompute": "R"}.get(m, "?") for m in last["modes"])
        row["rematd_peak_mib"] = max(s[0]["measured"] for s in steps[1:]) / MiB
        row["budget_mib"] = last["budget"] / MiB
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        assets = make_assets(where / "assets")
        runs = where / "runs"
        runs.mkdir()
        titan, rematd = "torchtitan.train", "rematd.integrations.torchtitan"
        for mode in ("none", "full", "selective"):
            rows.append(summary(mode, run(args, assets, runs, titan, [f"activation-checkpoint:{mode}"]), args.steps))
        compiled = ["--compile.enable", "activation-checkpoint:memory-budget"]
        budget_ac = [*compiled, "--activation-checkpoint.memory-budget", str(args.memory_budget)]
        rows.append(summary(f"memory-budget {args.memory_budget}", run(args, assets, runs, titan, budget_ac), 0))
        ours = ["activation-checkpoint:rematd", "--activation-checkpoint.margin", "0.02"]
        pinned = run(args, assets, runs, rematd, [*ours, "--activation-checkpoint.pin", "recompute"])
        profiled, *later = pinned[0]["steps"]
        recomputing = max(s[0]["measured"] for s in later)
        storing = profiled[0]["measured"] - profiled[0]["static"] + later[0][0]["static"]
        budget = int(recomputing + args.between * (storing - recomputing))
        planned = run(args, assets, runs, rematd, [*ours, "--activation-checkpoint.budget-bytes", str(budget)])
        rows.append(summary(f"rematd {args.between:.0%}", planned, args.steps))
    base = rows[0]["step_s"]
    for row in rows:
        row["vs_none"] = row["step_s"] / base
    print(
        table(
            rows,
            [
                ("contender", "contender", "s"),
                ("step_s", "step (s)", ".3f"),
                ("vs_none", "/ none", ".2f"),
                ("peak_mib", "peak above step start (MiB)", ".1f"),
                ("plan", "plan", "s"),
                ("rematd_peak_mib", "rematd's peak (MiB)", ".1f"),
                ("budget_mib", "budget (MiB)", ".1f"),
            ],
        )
    )
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
