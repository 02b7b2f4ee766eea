"""FSDP2 + rematd against FSDP2 with full checkpointing and with none, at a budget between them.

    python -m bench.fsdp                     # 2 CPU ranks (gloo), a stock Llama config, 8 layers, width 256
    python -m bench.fsdp --ranks 1           # one process: on a GPU, fully_shard with world size 1
    python -m bench.fsdp --quick             # a small model, for a smoke run

Each rank builds three copies of one model in torchtitan's order: plain FSDP2 (``none``), every block
wrapped in torch's ``checkpoint_wrapper`` before ``fully_shard`` (``full``: what torchtitan's full
activation checkpointing does), and rematd attached before sharding (``rematd``). rematd's budget is set
between the two: its own accounting measures a step with every block stored and one with every block
recomputed (pinned), and the budget is ``--between`` of the way from the second to the first, with the
rank's shards and FSDP's gathered parameters on top (on the CPU the budget stands for device memory;
on CUDA it is the allocator's). Then the contenders step in turn, round after round, on the same batches;
the step time of each is the median over rounds, and its ratio to ``none`` the median of the per-round
ratios. Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.launch import run_ranks

MiB = 2**20
CONTENDERS = ("none", "full", "rematd")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5, help="rounds of steps, contenders in turn (default 5)")
    p.add_argument("--steps", type=int, default=3, help="steps per contender per round (default 3)")
    p.add_argument("--warmup", type=int, default=4, help="steps of each contender before measuring")
    p.add_argument("--between", type=float, default=0.5, help="where the budget lies, 0 (full) to 1 (none)")
    p.add_argument("--quick", action="store_true", help="a small model and few rounds")
    p.add_argument("--out", default="artifacts/fsdp.json", help="where the JSON goes")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq, args.batch, args.rounds, args.steps, args.warmup = 4, 64, 64, 2, 2, 2, 2
    return args


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=max(4096, args.seq),
        use_cache=False,
    )
    with device:
        return LlamaForCausalLM(config)


def shard(model: torch.nn.Module, *, full_checkpointing: bool = False) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    layers = model.model.layers
    for i, layer in enumerate(layers):
        if full_checkpointing:  # torchtitan's order: checkpoint each block, then shard it
            layer = checkpoint_wrapper(layer)
            layers.register_module(str(i), layer)
        fully_shard(layer)
    fully_shard(model)


class Contender:
    def __init__(self, name: str, model: torch.nn.Module, cuda: bool) -> None:
        self.name, self.model, self.cuda = name, model, cuda
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.seconds: list[float] = []
        self.peaks: list[int] = []

    def step(self, ids: torch.Tensor) -> float:
        import torch.distributed as dist

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks.append(int(torch.cuda.max_memory_allocated()))
        return time.perf_counter() - start


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from rematd import client
    from rematd.planner import Mode, letters

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    data = torch.Generator(device=device).manual_seed(1000 + rank)

    def batch() -> torch.Tensor:
        return torch.randint(0, 4096, (args.batch, args.seq), device=device, generator=data)

    plain, full, ours = build(args, device), build(args, device), build(args, device)
    shard(plain)
    shard(full, full_checkpointing=True)
    h = client.attach(ours)
    shard(ours)
    contenders = [Contender("none", plain, cuda), Contender("full", full, cuda), Contender("rematd", ours, cuda)]
    h.optimizer = contenders[2].opt

    def peak() -> int:
        memory = h.last_memory
        assert memory is not None
        return memory.peak_allocated_bytes or memory.saved_peak_bytes

    # Calibration: rematd's own figures for every block stored and every block recomputed.
    measured = {}
    for mode in (Mode.STORE, Mode.RECOMPUTE):
        h.pin_modes([mode] * len(h.blocks))
        for _ in range(3):
            contenders[2].step(batch())
        measured[mode.name] = peak()
    h.pin_modes(None)
    budget = int(measured["RECOMPUTE"] + args.between * (measured["STORE"] - measured["RECOMPUTE"]))
    h.budget_bytes = budget
    # The plan for the budget is in on every rank before the warm-up: each planner's thread has taken it in.
    h.flush(60.0)
    for c in contenders:
        for _ in range(args.warmup):
            c.step(batch())
    rematd_peaks: list[int] = []
    for _ in range(args.rounds):
        batches = [batch() for _ in range(args.steps)]
        for c in contenders:
            for ids in batches:
                c.seconds.append(c.step(ids))
                if c.name == "rematd":
                    rematd_peaks.append(peak())
    plan = letters(h.modes)
    result = {
        "rank": rank,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "budget_bytes": budget,
        "store_peak_bytes": measured["STORE"],
        "recompute_peak_bytes": measured["RECOMPUTE"],
        "rematd_peaks": rematd_peaks,
        "plan": plan,
        "seconds": {c.name: c.seconds for c in contenders},
        "cuda_peaks": {c.name: max(c.peaks) if c.peaks else 0 for c in contenders},
    }
    h.close()
    dist.destroy_process_group()
    return result


def launch(args: argparse.Namespace, argv: list[str], module: str = "bench.fsdp") -> list[dict[str, Any]]:
    """Run ``args.ranks`` ranks of ``module`` (``--worker``) through :func:`bench.launch.run_ranks` (forked warm;
    a rank that fails stops the others, as torchrun does); their results, rank by rank. Their standard output is
    printed after them."""
    out = Path(args.out).with_suffix("")
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "REMATD_BENCH_RESULT": str(out)}
    try:
        said = run_ranks(args.ranks, module, [*argv, "--worker"], timeout=3600, env=env)
    except AssertionError as failed:  # which ranks failed, and the end of each one's standard error
        raise SystemExit(str(failed)) from None
    print(said, end="", file=sys.stderr)
    return [json.loads(Path(f"{out}-rank{r}.json").read_text()) for r in range(args.ranks)]


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    r0 = results[0]
    rounds = args.rounds
    lines = [
        f"FSDP2, {args.ranks} rank(s) on {r0['device']}: Llama {args.layers} layers x {args.hidden}, "
        f"batch {args.batch} x {args.seq} per rank; budget {r0['budget_bytes'] / MiB:.1f} MiB "
        f"(all stored {r0['store_peak_bytes'] / MiB:.1f}, all recomputed {r0['recompute_peak_bytes'] / MiB:.1f})",
        "",
        "| contender | step ms (median) | x none | peak MiB |",
        "|---|---|---|---|",
    ]
    base = r0["seconds"]["none"]
    per_round = len(base) // rounds
    for name in CONTENDERS:
        sec = r0["seconds"][name]
        rounds_mean = [statistics.mean(sec[k * per_round : (k + 1) * per_round]) for k in range(rounds)]
        base_mean = [statistics.mean(base[k * per_round : (k + 1) * per_round]) for k in range(rounds)]
        ratio = statistics.median(a / b for a, b in zip(rounds_mean, base_mean, strict=True))
        if name == "rematd":
            peak = max(max(r["rematd_peaks"]) for r in results) / MiB
        elif r0["cuda_peaks"][name]:
            peak = max(r["cuda_peaks"][name] for r in results) / MiB
        else:
            peak = {"none": r0["store_peak_bytes"], "full": r0["recompute_peak_bytes"]}[name] / MiB
        lines.append(f"| {name} | {1000 * statistics.median(rounds_mean):.1f} | {ratio:.3f} | {peak:.1f} |")
    over = sum(p > r["budget_bytes"] for r in results for p in r["rematd_peaks"])
    lines += ["", f"rematd's plan at the end: {r0['plan']}; measured steps over the budget: {over}"]
    return "\n".join(lines)


def run_bench(
    module: str,
    argv: list[str] | None,
    parse: Callable[[list[str]], argparse.Namespace],
    worker: Callable[[argparse.Namespace], Any],
    report: Callable[[argparse.Namespace, Any], str],
    ranks: Callable[[argparse.Namespace, list[str]], Any] | None = None,
) -> None:
    """A benchmark over ranks: as a worker (``--worker``) its rank's result; else it launches the ranks
    (``ranks``, by default :func:`launch` of ``module``), prints ``report`` and writes it with the results."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        result = Path(f"{os.environ['REMATD_BENCH_RESULT']}-rank{os.environ['RANK']}.json")
        result.write_text(json.dumps(worker(args)))
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rest = [a for a in argv if a != "--worker"]
    results = ranks(args, rest) if ranks is not None else launch(args, rest, module=module)
    text = report(args, results)
    print(text)
    Path(args.out).write_text(json.dumps({"args": vars(args), "ranks": results, "table": text}, indent=1))


def main(argv: list[str] | None = None) -> None:
    run_bench("bench.fsdp", argv, parse, worker, report)


if __name__ == "__main__":
    main()
