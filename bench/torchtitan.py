"""rematd inside torchtitan's trainer against torchtitan's own checkpointing, on its debug Llama: the front.

    python -m bench.torchtitan                      # 1 CPU rank, sequence 256, batch 4, 40 steps, in turns
    python -m bench.torchtitan --ranks 2            # 2 CPU ranks, FSDP (gloo)
    python -m bench.torchtitan --separate           # each contender a process of its own, 2 rounds
    python -m bench.torchtitan --quick              # sequence 128, 6 steps: a smoke run

The contenders are torchtitan's trainer, started from torchtitan's arguments (on the CPU with the stand-ins of
``bench.torchtitan_cpu``): ``torchtitan.train`` with ``activation-checkpoint:none``, ``full`` and ``selective``
(and, with ``--memory-budget``, ``memory-budget``: ``--compile.enable``, the compiler's partitioner chooses what
to keep); ``rematd.integrations.torchtitan`` with ``activation-checkpoint:rematd`` pinned to ``recompute`` (what
``full`` keeps), ``titan`` (torchtitan's selective policy, op for op) and ``store``, whose peaks in rematd's own
measure are the budgets rematd then plans under ("rematd at full's peak", "at selective's"), and a budget
halfway from selective's peak to every block stored. The budgets come from a first, 3-step run of the pinned
contenders.

By default every contender's trainer lives in one process (a rank), and their steps are taken in turn
(:mod:`bench.torchtitan_turns`): on a shared machine two runs of one computation one after another differed by
up to 28%, more than what sets the contenders apart, while steps taken in turn meet the same machine. The
ratios ("/ none", "/ the mode at that peak") are then the median of step-by-step ratios, each of two steps of
the same round. With ``--separate`` each contender is a process of its own, ``--rounds`` times (the later rounds
in reverse order), and the ratios are of the medians.

Reported per contender: the median step time over the second half of each of its runs, pooled (the planner
has settled; the profiled step left out); one measure of peak for all, the CPU memory above the step's start
during the last step (``--profile-step``), read from torch's memory profiler (every allocation, compiled code's
included; that step is not timed); and for rematd its last plan, its own measured peak and its budget. Prints a
table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
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
REMATD = "rematd.integrations.torchtitan"
Contenders = dict[str, tuple[str, list[str]]]
"""By name: the module run (``torchtitan.train`` or rematd's) and its checkpointing arguments."""
Done = dict[str, list[list[Any]]]
"""By contender: each round's records, one a rank."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1, help="processes (default 1; 2 shards with FSDP)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile-step", type=int, default=0, help="the step whose memory is profiled (default: last)")
    p.add_argument("--separate", action="store_true", help="each contender a process of its own, one after another")
    p.add_argument("--rounds", type=int, default=0, help="runs of every contender (default 1 in turns, 2 separate)")
    p.add_argument("--memory-budget", type=float, default=0.0, help="run torchtitan's memory-budget mode at this")
    p.add_argument("--quick", action="store_true", help="sequence 128, 6 steps")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each launch may run before it is stopped")
    p.add_argument("--out", default="artifacts/torchtitan.json", help="where the JSON goes")
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.steps, args.rounds = 128, 6, 1
    args.rounds = args.rounds or (2 if args.separate else 1)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.steps < 3:
        p.error("--steps must be at least 3: the first profiles, the last is profiled for memory")
    if not args.timeout > 0:
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    args.profile_step = args.profile_step or args.steps
    return args


def titan_args(args: argparse.Namespace, assets: tuple[Path, Path], steps: int) -> list[str]:
    """torchtitan's arguments every contender shares."""
    tokenizer, data = assets
    return [
        *("--module", "llama3", "--config", "llama3_debugmodel", "--hf-assets-path", str(tokenizer)),
        *("--dataloader.dataset-path", str(data)),
        *("--training.steps", str(steps), "--training.seq-len", str(args.seq)),
        *("--training.local-batch-size", str(args.batch), "--debug.seed", "0"),
        *("--parallelism.spmd-backend", "partial_dtensor", "--metrics.log-freq", str(steps)),
    ]


def launch(args: argparse.Namespace, module: str, argv: list[str], env: dict[str, str]) -> None:
    launcher = ["--standalone", "--nproc-per-node", str(args.ranks), "-m", module]
    run_launcher("torch.distributed.run", [*launcher, *argv], timeout=args.timeout, env={"OMP_NUM_THREADS": "1", **env})


def run(args: argparse.Namespace, assets: tuple[Path, Path], where: Path, module: str, ac: list[str]) -> list[Any]:
    """One training run of ``args.steps`` steps, a process of its own; what each rank recorded."""
    record = where / f"run{len(list(where.iterdir()))}"
    record.mkdir()
    titan = [*titan_args(args, assets, args.steps), "--dump-folder", str(record / "out")]
    env = {RECORD: str(record), PROFILE_STEP: str(args.profile_step)}
    launch(args, "bench.torchtitan_cpu", [module, *titan, *ac], env)
    return [torch.load(record / f"rank{r}.pt", weights_only=False) for r in range(args.ranks)]


def in_turns(
    args: argparse.Namespace, assets: tuple[Path, Path], where: Path, contenders: Contenders, steps: int
) -> dict[str, list[Any]]:
    """One process a rank for every contender, their steps taken in turn (:mod:`bench.torchtitan_turns`); what
    each rank recorded, by contender."""
    out = where / f"turns{len(list(where.iterdir()))}"
    out.mkdir()
    plan = {
        "common": titan_args(args, assets, steps),
        "contenders": [{"name": name, "module": m, "args": ac} for name, (m, ac) in contenders.items()],
        "steps": steps,
        "profile_step": args.profile_step if steps == args.steps else 0,  # the budgets' short run needs no profile
        "out": str(out),
    }
    (out / "plan.json").write_text(json.dumps(plan))
    launch(args, "bench.torchtitan_turns", [str(out / "plan.json")], {})
    return {
        name: [torch.load(out / f"{i}.rank{r}.pt", weights_only=False) for r in range(args.ranks)]
        for i, name in enumerate(contenders)
    }


def settled(seconds: list[float], args: argparse.Namespace) -> list[float]:
    """A run's step times once the planner has settled: its second half, the profiled step left out (the
    profiler slows it)."""
    half = max(2, len(seconds) // 2)
    return [s for i, s in enumerate(seconds) if i >= half and i + 1 != args.profile_step] or seconds[1:]


def paired(a: list[list[Any]], b: list[list[Any]], args: argparse.Namespace) -> float:
    """The median over the settled steps of every round of ``a``'s step over ``b``'s of the same round and step:
    taken in turn, the two met the same machine."""
    return statistics.median(
        x / y
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(settled(ra[0]["seconds"], args), settled(rb[0]["seconds"], args), strict=True)
    )


def summary(name: str, runs: list[list[Any]], args: argparse.Namespace) -> dict[str, Any]:
    """A contender's row over its ``runs`` (one per round): the median step over the second half of each run
    (the profiled step left out), its peak by torch's memory profiler, and for rematd its last plan, own peak
    and budget."""
    timed = [s for records in runs for s in settled(records[0]["seconds"], args)]
    peaks = [p for records in runs for r in records for p in r["peaks"]]
    records = runs[-1]
    row: dict[str, Any] = {
        "contender": name,
        "step_s": statistics.median(timed),
        "rounds": len(runs),
        "peak_mib": max(peaks) / MiB if peaks else None,  # none where torch's profiler could not read the step
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


def pinned(pin: str) -> tuple[str, list[str]]:
    """rematd pinned to ``pin`` on every block."""
    return REMATD, ["activation-checkpoint:rematd", "--activation-checkpoint.pin", pin]


def titan_contenders(args: argparse.Namespace) -> Contenders:
    """torchtitan's modes, then rematd pinned to each's counterpart."""
    titan = "torchtitan.train"
    contenders: Contenders = {
        mode: (titan, [f"activation-checkpoint:{mode}"]) for mode in ("none", "full", "selective")
    }
    if args.memory_budget:
        compiled = ["--compile.enable", "activation-checkpoint:memory-budget"]
        budget_ac = [*compiled, "--activation-checkpoint.memory-budget", str(args.memory_budget)]
        contenders[f"memory-budget {args.memory_budget}"] = (titan, budget_ac)
    for pin, _ in PINNED_LIKE:
        contenders[f"rematd pinned {pin}"] = pinned(pin)
    return contenders


def at_peaks(peaks: dict[str, int]) -> Contenders:
    """rematd planning at the budgets the pinned runs' peaks (in rematd's own measure) give."""
    budgets = {
        "full's peak": peaks["full"],
        "selective's peak": peaks["selective"],
        "halfway to none": (peaks["selective"] + peaks["none"]) // 2,
    }
    ours = ["activation-checkpoint:rematd", "--activation-checkpoint.budget-bytes"]
    return {f"rematd at {label}": (REMATD, [*ours, str(budget)]) for label, budget in budgets.items()}


def separately(args: argparse.Namespace, assets: tuple[Path, Path], runs: Path) -> tuple[Contenders, Done]:
    """Every contender a run of its own, one after another; the later rounds in reverse order (a machine that
    slows or speeds up over the run weighs on every contender alike)."""
    contenders = titan_contenders(args)
    done: Done = {name: [run(args, assets, runs, module, ac)] for name, (module, ac) in contenders.items()}
    more = at_peaks({like: rematd_peak(done[f"rematd pinned {pin}"][0]) for pin, like in PINNED_LIKE})
    contenders.update(more)
    done.update({name: [run(args, assets, runs, module, ac)] for name, (module, ac) in more.items()})
    for round_ in range(1, args.rounds):
        order = list(contenders.items())
        for name, (module, ac) in order[::-1] if round_ % 2 else order:
            done[name].append(run(args, assets, runs, module, ac))
    return contenders, done


def turns(args: argparse.Namespace, assets: tuple[Path, Path], runs: Path) -> tuple[Contenders, Done]:
    """The budgets from a short run of rematd pinned (their peaks after the profiling step), then every
    contender in one process, step by step in turn, ``args.rounds`` times."""
    first = in_turns(args, assets, runs, {f"rematd pinned {pin}": pinned(pin) for pin, _ in PINNED_LIKE}, 3)
    peaks = {like: rematd_peak(first[f"rematd pinned {pin}"]) for pin, like in PINNED_LIKE}
    contenders = {**titan_contenders(args), **at_peaks(peaks)}
    done: Done = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, records in in_turns(args, assets, runs, contenders, args.steps).items():
            done[name].append(records)
    return contenders, done


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        assets = make_assets(where / "assets")
        runs = where / "runs"
        runs.mkdir()
        contenders, done = (separately if args.separate else turns)(args, assets, runs)
        rows = [summary(name, done[name], args) for name in contenders]
    by_name = {row["contender"]: row for row in rows}

    def ratio(a: str, b: str) -> float:
        if args.separate:
            return float(by_name[a]["step_s"] / by_name[b]["step_s"])
        return paired(done[a], done[b], args)

    for row in rows:
        row["vs_none"] = ratio(row["contender"], "none")
    for name, like in (("rematd at full's peak", "full"), ("rematd at selective's peak", "selective")):
        by_name[name]["vs_mode"] = ratio(name, like)
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
