"""rematd inside torchtitan's trainer against torchtitan's own checkpointing, on its debug Llama: the front.

    python -m bench.torchtitan                      # 1 CPU rank, sequence 256, batch 4, 40 steps, 2 rounds
    python -m bench.torchtitan --ranks 2            # 2 CPU ranks, FSDP (gloo)
    python -m bench.torchtitan --quick              # sequence 128, 6 steps: a smoke run

Each contender is a training run of its own, started as a user would, with torchtitan's arguments (on the CPU
through ``bench.torchtitan_cpu``, which adds the stand-ins torchtitan needs there): ``torchtitan.train`` with
``activation-checkpoint:none``, ``full`` and ``selective`` (and, with ``--memory-budget``, ``memory-budget``:
``--compile.enable``, the compiler's partitioner chooses what to keep); then
``rematd.integrations.torchtitan`` with ``activation-checkpoint:rematd``: pinned to ``recompute`` (what
``full`` keeps) and to ``titan`` (torchtitan's selective policy, op for op), whose peaks in rematd's own
measure are the budgets rematd then plans under, each as a run of its own ("rematd at full's peak", "at
selective's"), and a budget halfway from selective's peak to every block stored.

Each contender runs ``--rounds`` times (the later rounds in reverse order): on a shared machine two runs of
one computation differ by more than what sets the contenders apart. Reported per contender: the median step
time over the second half of each of its runs, pooled (the planner has settled; the
profiled step left out), relative to ``none``; one measure of peak for all, the CPU memory above the step's
start during the last step (``--profile-step``), read from torch's memory profiler (every allocation,
compiled code's included; that step is not timed); and for rematd its last plan, its own measured peak and
its budget. Prints a table; writes JSON (``--out``).
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
from rematd.planner import MODES_BY_LABEL

MiB = 2**20
PINNED_LIKE = (("recompute", "full"), ("titan", "selective"), ("store", "none"))
"""rematd pinned to a mode, and torchtitan's mode it stands for."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1, help="processes (default 1; 2 shards with FSDP)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile-step", type=int, default=0, help="the step whose memory is profiled (default: last)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each contender, in turn (default 2)")
    p.add_argument("--memory-budget", type=float, default=0.0, help="run torchtitan's memory-budget mode at this")
    p.add_argument("--quick", action="store_true", help="sequence 128, 6 steps")
    p.add_argument("--out", default="artifacts/torchtitan.json", help="where the JSON goes")
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.steps, args.rounds = 128, 6, 1
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
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


def summary(name: str, runs: list[list[Any]], args: argparse.Namespace) -> dict[str, Any]:
    """A contender's row over its ``runs`` (one per round): the median step over the second half of each run
    (the profiled step left out), its peak by torch's memory profiler, and for rematd its last plan, own peak
    and budget."""
    timed: list[float] = []
    for records in runs:
        seconds = records[0]["seconds"]
        half = max(2, len(seconds) // 2)
        timed += [s for i, s in enumerate(seconds) if i >= half and i + 1 != args.profile_step] or seconds[1:]
    records = runs[-1]
    row: dict[str, Any] = {
        "contender": name,
        "step_s": statistics.median(timed),
        "rounds": len(runs),
        "peak_mib": max(r["peaks"][0] for records in runs for r in records) / MiB,
        "loss": float(records[0]["losses"][-1]),
    }
    steps = records[0]["steps"]
    if steps and steps[-1]:
        last = steps[-1][0]
        row["plan"] = "".join(MODES_BY_LABEL[m].letter for m in last["modes"])
        row["rematd_peak_mib"] = max(s[0]["measured"] for records in runs for s in records[0]["steps"][1:]) / MiB
        row["budget_mib"] = last["budget"] / MiB
        row["over"] = sum(s[0]["measured"] > s[0]["budget"] for records in runs for s in records[0]["steps"])
    return row


def rematd_peak(records: list[Any]) -> int:
    """The largest peak in rematd's own measure over the ranks' steps after the profiling step."""
    return max(s[0]["measured"] for r in records for s in r["steps"][1:])


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        assets = make_assets(where / "assets")
        runs = where / "runs"
        runs.mkdir()
        titan, rematd = "torchtitan.train", "rematd.integrations.torchtitan"
        contenders: dict[str, tuple[str, list[str]]] = {
            mode: (titan, [f"activation-checkpoint:{mode}"]) for mode in ("none", "full", "selective")
        }
        if args.memory_budget:
            compiled = ["--compile.enable", "activation-checkpoint:memory-budget"]
            budget_ac = [*compiled, "--activation-checkpoint.memory-budget", str(args.memory_budget)]
            contenders[f"memory-budget {args.memory_budget}"] = (titan, budget_ac)
        ours = ["activation-checkpoint:rematd"]
        for pin in ("recompute", "titan", "store"):
            contenders[f"rematd pinned {pin}"] = (rematd, [*ours, "--activation-checkpoint.pin", pin])
        done: dict[str, list[list[Any]]] = {}
        for name, (module, ac) in contenders.items():
            done[name] = [run(args, assets, runs, module, ac)]
        # The budgets: the pinned runs' peaks in rematd's own measure.
        peaks = {like: rematd_peak(done[f"rematd pinned {pin}"][0]) for pin, like in PINNED_LIKE}
        budgets = {
            "full's peak": peaks["full"],
            "selective's peak": peaks["selective"],
            "halfway to none": (peaks["selective"] + peaks["none"]) // 2,
        }
        for label, budget in budgets.items():
            name = f"rematd at {label}"
            contenders[name] = (rematd, [*ours, "--activation-checkpoint.budget-bytes", str(budget)])
            done[name] = [run(args, assets, runs, rematd, contenders[name][1])]
        # Later rounds in reverse order: a machine that slows or speeds up over the run weighs on every
        # contender alike.
        for round_ in range(1, args.rounds):
            order = list(contenders.items())
            for name, (module, ac) in order[::-1] if round_ % 2 else order:
                done[name].append(run(args, assets, runs, module, ac))
        rows = [summary(name, done[name], args) for name in contenders]
    base = rows[0]["step_s"]
    by_name = {row["contender"]: row for row in rows}
    for row in rows:
        row["vs_none"] = row["step_s"] / base
    for name, like in (("rematd at full's peak", "full"), ("rematd at selective's peak", "selective")):
        by_name[name]["vs_mode"] = by_name[name]["step_s"] / by_name[like]["step_s"]
    print(
        table(
            rows,
            [
                ("contender", "contender", "s"),
                ("step_s", "step (s)", ".3f"),
                ("vs_none", "/ none", ".3f"),
                ("vs_mode", "/ the mode at that peak", ".3f"),
                ("peak_mib", "peak above step start (MiB)", ".1f"),
                ("plan", "last plan", "s"),
                ("rematd_peak_mib", "rematd's peak (MiB)", ".1f"),
                ("budget_mib", "budget (MiB)", ".1f"),
                ("over", "steps over", "d"),
            ],
        )
    )
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
