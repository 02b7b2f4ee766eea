"""rematd against the static checkpointing strategies it replaces, on real CPU training steps.

    python -m bench.strategies                 # 12- and 32-block GPTs, d_model 256, seq 256, batch 8
    python -m bench.strategies --quick         # a small model, for a smoke run

For each budget (a fraction of the bytes a step saves for backward without
checkpointing) and each strategy: the step time as a ratio to no
checkpointing (strategies step in turn, round after round; the median over
rounds of each round's ratio), and the measured peak of bytes saved
for backward (saved-tensor hooks, de-duplicated by storage, including what
checkpoints keep and the activations they rematerialise in backward).
Then the adaptive scenario: a sequence length drawn per step, a fixed budget.
Prints tables; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from bench.common import MiB, freed_memory_kept, gpt, malloc_argument, median, table, timed_step, tokens, write_json
from rematd import client
from rematd.client.demo.tiny_gpt import TinyGPT
from rematd.client.memory.accounting import tensors_in
from rematd.planner import Mode, Shape, letters, solve


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """One model and workload of the benchmark."""

    n_layer: int
    d_model: int
    n_head: int
    seq: int
    batch: int
    steps: int
    """Measured steps per strategy (after warm-up)."""
    warmup: int = 8
    """Steps before measuring: rematd's plan settles in them (its first plans come from the profile
    alone; it learns the measured cost of each mode within a few steps)."""


class SegmentedGPT(TinyGPT):
    """TinyGPT whose blocks run as sqrt(n) checkpointed segments (``checkpoint_sequential``'s scheme),
    with the segments' kept inputs and rematerialised activations counted like rematd's own."""

    def setup_segments(self, segments: int, handle: client.Handle, block_bytes: list[int]) -> None:
        self.segments = segments
        self.handle = handle
        self.block_bytes = block_bytes

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "segments", 0):  # the profiling step runs the blocks one by one
            return super().forward(idx)
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        n = len(self.h)
        size = math.ceil(n / self.segments)
        acct = self.handle._accounting  # measuring only: the same accounting rematd's blocks use
        for start in range(0, n, size):
            blocks = list(self.h)[start : start + size]

            def run(x: torch.Tensor, blocks: list[torch.nn.Module] = blocks) -> torch.Tensor:
                for b in blocks:
                    x = b(x)
                return x

            out = checkpoint(run, x, use_reentrant=False)
            if acct.active:
                acct.hold([x], until_grad_of=[x])
                acct.rematerialise(sum(self.block_bytes[start : start + size]), tensors_in([out]), [x])
            x = out
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


@dataclass(slots=True)
class Runner:
    """One strategy's model, optimizer and handle, stepped in turn with the others."""

    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    handle: client.Handle | None
    times: list[float]
    peaks: list[int]

    def pin(self, modes: tuple[Mode, ...], data: torch.Tensor) -> None:
        """Pinned to ``modes`` from now, its measurements started afresh (one unrecorded step on ``data``:
        a pin applies at a step's boundary)."""
        assert self.handle is not None
        self.times, self.peaks = [], []
        self.handle.pin_modes(modes)
        self.step(data, record=False)

    def step(self, data: torch.Tensor, record: bool) -> None:
        h = self.handle
        t = timed_step(self.model, self.opt, data, h.step if h is not None else None)
        if record:
            self.times.append(t)
            if h is not None and h.last_stats is not None:
                self.peaks.append(h.last_stats.saved_peak_bytes)


def static_modes(name: str, n: int) -> tuple[Mode, ...]:
    if name in ("none", "sqrt-n"):
        return (Mode.STORE,) * n
    if name == "full":
        return (Mode.RECOMPUTE,) * n
    if name == "every-2nd":
        return tuple(Mode.RECOMPUTE if i % 2 == 0 else Mode.STORE for i in range(n))
    raise ValueError(name)


def runner(setup: Setup, name: str, budget: int, data: torch.Tensor) -> Runner:
    model = gpt(setup.n_layer, setup.d_model, setup.n_head)
    if name == "sqrt-n":
        model.__class__ = SegmentedGPT
    h = client.attach(model, budget_bytes=budget, modes=["recompute", "selective"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    timed_step(model, opt, data, h.step)  # rematd's profiling step (every block recomputed)
    if name != "rematd":
        h.pin_modes(static_modes(name, setup.n_layer))
    if isinstance(model, SegmentedGPT):
        hello = h._backend.hello  # type: ignore[attr-defined]
        model.setup_segments(max(1, round(math.sqrt(setup.n_layer))), h, [b.saved_bytes for b in hello.blocks])
    return Runner(name, model, opt, h, [], [])


def compiled_runner(setup: Setup, ratio: float, data: torch.Tensor) -> tuple[Runner, float]:
    """torch.compile with activation_memory_budget = ratio; returns the runner and its compile seconds."""
    import torch._functorch.config as functorch_config

    model = gpt(setup.n_layer, setup.d_model, setup.n_head)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with functorch_config.patch(activation_memory_budget=ratio):
        compiled = torch.compile(model)
        start = time.perf_counter()
        timed_step(compiled, opt, data)  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
    return Runner(f"compile-{ratio:.0%}", compiled, opt, None, [], []), seconds  # type: ignore[arg-type]


def budgets_table(setup: Setup, ratios: list[float], compile_ratios: list[float]) -> dict[str, Any]:
    data = tokens(setup.batch, setup.seq, 0)
    statics = {name: runner(setup, name, 2**50, data) for name in ("none", "full", "every-2nd", "sqrt-n")}
    none_peak = statics["none"].handle.last_stats.saved_peak_bytes  # type: ignore[union-attr]
    budgets = {ratio: int(none_peak * ratio) for ratio in ratios}
    ours = {ratio: runner(setup, "rematd", budget, data) for ratio, budget in budgets.items()}
    compiled: dict[float, tuple[Runner, float]] = {}
    errors: dict[float, str] = {}
    for ratio in compile_ratios:
        try:
            compiled[ratio] = compiled_runner(setup, ratio, data)
        except Exception as err:  # report, don't hide: compile may fail on a machine
            errors[ratio] = f"{type(err).__name__}: {str(err)[:200]}"
    everyone = [*statics.values(), *ours.values(), *(r for r, _ in compiled.values())]
    # rematd's plan at the end of the warm-up, pinned on a copy of its own: what adapting costs apart.
    pinned = {ratio: runner(setup, "none", 2**50, data) for ratio in ratios}
    # Rounds in turn, each in its own order, so that load on the machine and the place in the round
    # (after which model's memory was freed) fall on every strategy alike.
    for i in range(setup.warmup + setup.steps):
        if i == setup.warmup:
            for ratio, p in pinned.items():
                p.pin(ours[ratio].handle.modes, data)  # type: ignore[union-attr]
            everyone += pinned.values()
        for r in random.Random(i).sample(everyone, len(everyone)):
            r.step(data, record=i >= setup.warmup)
    base = median(statics["none"].times)
    plain = statics["none"].times

    def ratio_of(r: Runner) -> float:
        # Each round's step against no checkpointing's in the same round: the machine's drift cancels.
        return median([t / p for t, p in zip(r.times, plain, strict=True)])

    static = {k: {"step_s": median(v.times), "ratio": ratio_of(v), "peak": max(v.peaks)} for k, v in statics.items()}
    for k, v in static.items():
        print(f"  {k:10s} {v['step_s']:7.3f} s/step  ratio {v['ratio']:6.3f}  peak {v['peak'] / MiB:8.1f} MiB")
    rows = []
    for ratio, r in ours.items():
        budget = budgets[ratio]
        fitting = {k: v for k, v in static.items() if v["peak"] <= budget}
        best = min(fitting.items(), key=lambda kv: kv[1]["ratio"]) if fitting else None
        assert r.handle is not None
        row: dict[str, Any] = {
            "budget_ratio": ratio,
            "budget_mib": budget / MiB,
            "rematd_ratio": ratio_of(r),
            "rematd_peak_mib": max(r.peaks) / MiB,
            "rematd_fits": max(r.peaks) <= budget,
            "rematd_modes": letters(r.handle.modes),
            "best_static": best[0] if best else "none fits",
            "best_static_ratio": best[1]["ratio"] if best else None,
            "vs_best_static": ratio_of(r) / best[1]["ratio"] if best else None,
            "same_plan_modes": letters(pinned[ratio].handle.modes),  # type: ignore[union-attr]
            "vs_same_plan": ratio_of(r) / ratio_of(pinned[ratio]),
        }
        for name, v in static.items():
            row[f"{name}_ratio"] = v["ratio"]
            row[f"{name}_fits"] = v["peak"] <= budget
        if ratio in compiled:
            row["compile_ratio"] = ratio_of(compiled[ratio][0])
            row["compile_s"] = compiled[ratio][1]
        if ratio in errors:
            row["compile_error"] = errors[ratio]
        rows.append(row)
        r.handle.close()
    for r in (*statics.values(), *pinned.values()):
        if r.handle is not None:
            r.handle.close()
    return {
        "setup": asdict(setup),
        "static": static,
        "rows": rows,
        "none_peak_mib": none_peak / MiB,
        "none_step_s": base,
    }


def adaptive(n_layer: int, d_model: int, n_head: int, batch: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Sequence length drawn per step from 128-1024 under a fixed budget, three ways, step by step in turn."""
    rng = random.Random(seed)
    seqs = [rng.choice(range(128, 1025, 64)) for _ in range(steps)]
    first = 200  # the profiling step's length: no feature width of the model equals it
    probe = gpt(n_layer, d_model, n_head)
    hp = client.attach(probe, budget_bytes=2**50, modes=["recompute", "selective"])
    timed_step(probe, torch.optim.SGD(probe.parameters(), lr=1e-4), tokens(batch, first, 0), hp.step)
    profile = hp._backend.hello.profile()  # type: ignore[attr-defined]
    hp.close()
    longest = Shape(batch=batch, seq_len=1024, tokens=batch * 1024)
    floor = solve(profile.options_at(longest), 0).predicted_peak_bytes  # the least any plan needs at 1024
    budget = int(floor * 1.6)

    def best_modes(seq: int) -> tuple[Mode, ...]:
        shape = Shape(batch=batch, seq_len=seq, tokens=batch * seq)
        return solve(profile.options_at(shape), int(budget * 0.95)).modes

    runners = {}
    for name in ("rematd", "oracle", "static-longest"):
        model = gpt(n_layer, d_model, n_head)
        h = client.attach(model, budget_bytes=budget, modes=["recompute", "selective"])
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        timed_step(model, opt, tokens(batch, first, 0), h.step)  # the profiling step
        if name == "static-longest":
            h.pin_modes(best_modes(1024))
        runners[name] = Runner(name, model, opt, h, [], [])
    for i, seq in enumerate(seqs):
        data = tokens(batch, seq, i + 1)
        runners["oracle"].handle.pin_modes(best_modes(seq))  # type: ignore[union-attr]
        for r in runners.values():
            r.step(data, record=True)
    results: dict[str, Any] = {"budget_mib": budget / MiB, "steps": steps, "profile_seq": first}
    for name, r in runners.items():
        over = sum(p > budget for p in r.peaks)
        results[name] = {"seconds": sum(r.times), "steps_over_budget": over, "max_peak_mib": max(r.peaks) / MiB}
        peak = max(r.peaks) / MiB
        print(f"  adaptive {name:14s} {sum(r.times):7.1f} s, {over} steps over budget, max peak {peak:.1f} MiB")
        if r.handle is not None:
            r.handle.close()
    results["throughput_vs_oracle"] = results["oracle"]["seconds"] / results["rematd"]["seconds"]
    results["throughput_vs_static_longest"] = results["static-longest"]["seconds"] / results["rematd"]["seconds"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few steps (smoke run)")
    parser.add_argument("--out", default="artifacts/bench-strategies.json")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (it compiles once per budget)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--blocks", default="12,32", help="the models' block counts, comma-separated (12,32)")
    parser.add_argument("--warmup", type=int, default=8, help="rounds before measuring: rematd converges in them (8)")
    malloc_argument(parser)
    args = parser.parse_args()
    malloc_kept = freed_memory_kept(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        setups = [Setup(n_layer=4, d_model=64, n_head=4, seq=128, batch=4, steps=3, warmup=2)]
        ratios, compile_ratios = [0.3, 0.6, 0.9], []
        adaptive_args = dict(n_layer=2, d_model=32, n_head=2, batch=2, steps=30)
    else:
        steps = {12: 10, 32: 6}
        setups = [
            Setup(n_layer=n, d_model=256, n_head=8, seq=256, batch=8, steps=steps.get(n, 6), warmup=args.warmup)
            for n in (int(b) for b in args.blocks.split(","))
        ]
        ratios = [0.1, 0.3, 0.5, 0.7, 0.9]
        compile_ratios = [] if args.no_compile else [0.1, 0.5, 0.9]
        adaptive_args = dict(n_layer=4, d_model=128, n_head=4, batch=2, steps=200)
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "freed_memory_kept": malloc_kept,
        "models": [],
    }
    for i, setup in enumerate(setups):
        print(f"\n{setup.n_layer} blocks, d_model {setup.d_model}, seq {setup.seq}, batch {setup.batch}", flush=True)
        result = budgets_table(setup, ratios, compile_ratios if i == 0 else [])
        report["models"].append(result)
        cols = [
            ("budget_ratio", "budget", ".0%"),
            ("rematd_ratio", "rematd", ".3f"),
            ("rematd_peak_mib", "peak MiB", ".1f"),
            ("rematd_fits", "fits", ""),
            ("rematd_modes", "modes", ""),
            ("full_ratio", "full", ".3f"),
            ("every-2nd_ratio", "every-2", ".3f"),
            ("sqrt-n_ratio", "sqrt-n", ".3f"),
            ("compile_ratio", "compile", ".3f"),
            ("best_static", "best static that fits", ""),
            ("best_static_ratio", "its ratio", ".3f"),
            ("vs_best_static", "rematd / it", ".3f"),
            ("same_plan_modes", "its plan pinned", ""),
            ("vs_same_plan", "rematd / it", ".3f"),
        ]
        print()
        print(table(result["rows"], cols))
        s = result["static"]
        print("static peaks (MiB): " + ", ".join(f"{k} {v['peak'] / MiB:.1f}" for k, v in s.items()))
        for r in result["rows"]:
            if "compile_s" in r:
                print(f"torch.compile at {r['budget_ratio']:.0%}: compile {r['compile_s']:.1f} s")
            if "compile_error" in r:
                print(f"torch.compile at {r['budget_ratio']:.0%}: {r['compile_error']}")
    print("\nadaptive scenario: sequence length drawn per step from 128-1024, fixed budget", flush=True)
    report["adaptive"] = adaptive(**adaptive_args)  # type: ignore[arg-type]
    a = report["adaptive"]
    print(
        f"throughput vs oracle {a['throughput_vs_oracle']:.3f}x; vs static plan for the longest "
        f"{a['throughput_vs_static_longest']:.3f}x; steps over budget {a['rematd']['steps_over_budget']}"
    )
    write_json(args.out, report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
