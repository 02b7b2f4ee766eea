"""What rematd prices against what it measures, mode by mode, on torchtitan's mixture of experts.

    python -m bench.torchtitan_moe                       # 1 rank, and 2 ranks with expert parallel 2
    python -m bench.torchtitan_moe --modes store,recompute --steps 3

torchtitan 0.3.0's ``qwen3_moe_debug`` (8 blocks, each an attention and a mixture of experts) trained by its own
trainer on CPU ranks (gloo, through ``bench.torchtitan_cpu``), every block pinned to one mode at a time through
``rematd.integrations.torchtitan``. For each mode and set-up it reports, per rank, the activations rematd
measured above the step's static memory (the most over the steps after the profiling one) and what its profile
priced them at (``h.plan`` of the pinned modes), and their ratio: 1.00 where the profile prices the mode as
it runs. Expert parallel moves tokens between the ranks with all-to-all, and each rank's experts receive as
many as the router sends them, so what storing an expert block keeps varies from step to step and rank to
rank. Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.launch import run_launcher
from bench.torchtitan_cpu import RECORD, make_assets

MiB = 2**20
SETUPS = {"1 rank": (1, ()), "2 ranks, expert parallel 2": (2, ("--parallelism.expert-parallel-degree", "2"))}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="store,attention,mlp,titan,recompute", help="modes pinned, one run each")
    p.add_argument("--steps", type=int, default=3, help="training steps a run (the first profiles)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", default="artifacts/torchtitan_moe.json", help="where the JSON goes")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2: the first step profiles")
    return args


def run(
    args: argparse.Namespace, assets: tuple[Path, Path], where: Path, ranks: int, extra: tuple[str, ...], mode: str
) -> list[Any]:
    """One training run with every block pinned to ``mode``; what each rank recorded."""
    record = where / f"run{len(list(where.iterdir()))}"
    record.mkdir()
    tokenizer, data = assets
    titan = [
        *("--module", "qwen3", "--config", "qwen3_moe_debug", "--hf-assets-path", str(tokenizer)),
        *("--dataloader.dataset-path", str(data), "--dump-folder", str(record / "out")),
        *("--training.steps", str(args.steps), "--training.seq-len", str(args.seq)),
        *("--training.local-batch-size", "2", "--debug.seed", "0", "--training.disable-cuda-graphs"),
        *("--parallelism.spmd-backend", "partial_dtensor", *extra),
        *("activation-checkpoint:rematd", "--activation-checkpoint.pin", mode),
    ]
    launcher = ["--standalone", "--nproc-per-node", str(ranks), "-m", "bench.torchtitan_cpu"]
    module = "rematd.integrations.torchtitan"
    env = {RECORD: str(record), "OMP_NUM_THREADS": "1"}
    run_launcher("torch.distributed.run", [*launcher, module, *titan], timeout=1200, env=env)
    return [torch.load(record / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def figures(record: Any) -> dict[str, float]:
    """A rank's measured and priced activations (MiB above the static memory), after the profiling step."""
    steps = [s[0] for s in record["steps"][1:]]
    measured = max(s["measured"] - s["static"] for s in steps)
    priced = max(s["in_force"] - s["static"] for s in steps)
    return {"measured_mib": measured / MiB, "priced_mib": priced / MiB, "ratio": measured / priced if priced else 0.0}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rematd-moe-") as tmp:
        where = Path(tmp)
        assets = make_assets(where / "assets")
        for setup, (ranks, extra) in SETUPS.items():
            for mode in args.modes.split(","):
                for rank, record in enumerate(run(args, assets, where, ranks, extra, mode)):
                    rows.append({"setup": setup, "mode": mode, "rank": rank, **figures(record)})
    print("qwen3_moe_debug in torchtitan's trainer, every block pinned to one mode; activations above the static")
    print(f"memory, MiB (the most over steps 2-{args.steps}):\n")
    print("| set-up | mode | rank | measured | priced by the profile | measured / priced |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setup']} | {r['mode']} | {r['rank']} | {r['measured_mib']:.1f} | {r['priced_mib']:.1f} | "
            f"{r['ratio']:.2f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
