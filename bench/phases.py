"""rematd after convergence against the fastest static plan that fits, per sequence length held for a phase.

    python -m bench.phases                     # 12-block GPT, d_model 128, batch 4, lengths 256 then 160
    python -m bench.phases --quick             # a small model, for a smoke run

One budget per job (a fraction of what no checkpointing saves for backward at
the longest length), held while the length changes phase by phase, as in
``rematd demo``. The contenders step in turn, round after round: no
checkpointing, rematd at each budget, and at each length the static plans a
user would write (all-selective, every 2nd and 3rd block, and for each budget
the fewest leading blocks recomputed, selective, or recomputed with the rest
selective, that fit by the profile). A static plan counts as fitting when its
measured peak (saved-tensor accounting) is within the budget. Reported per
budget and length: rematd's step time over no checkpointing's and over the
fastest static plan that fits (medians over the phase's last rounds of each
round's ratio), its plan, its largest peak and its steps over the budget
(warm-up and trials included), and the trial steps it spent.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench.common import MiB, gpt, median, table, timed_step, tokens, write_json
from bench.strategies import LETTERS, Runner
from rematd import client
from rematd.planner import Mode, Profile, Shape
from rematd.planner.cost import choose, peak_of

S, K, R = Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """The model and the phases of the run."""

    n_layer: int
    d_model: int
    n_head: int
    batch: int
    lengths: tuple[int, ...]
    """Sequence length of each phase, in order."""
    warmup: int
    """Rounds at the start of a phase before measuring: rematd's plan converges in them."""
    steps: int
    """Measured rounds per phase."""


def families(n: int, profile: Profile, shape: Shape, budget: int) -> dict[str, tuple[Mode, ...]]:
    """The static plans tried at ``shape``: the fixed ones, and per family the fewest leading blocks that
    fit ``budget`` by the profile (leading blocks: their kept bytes are released last, so they fit best)."""
    plans = {
        "all-selective": (K,) * n,
        "every-2nd": tuple(R if i % 2 == 0 else S for i in range(n)),
        "every-3rd": tuple(R if i % 3 == 0 else S for i in range(n)),
    }
    options = profile.options_at(shape)
    other = profile.other_at(shape)
    for name, head, tail in (("first-m R", R, S), ("first-m s", K, S), ("first-m R, rest s", R, K)):
        for m in range(1, n + 1):  # none of them (m = 0) is storing every block, already a contender
            modes = (head,) * m + (tail,) * (n - m)
            if peak_of(choose(options, modes), outside_bytes=other, outside_in_backward=False) <= budget:
                plans[name.replace("m", str(m))] = modes
                break
    return plans


def run(setup: Setup, ratios: list[float]) -> dict[str, Any]:
    n, longest = setup.n_layer, max(setup.lengths)
    modes_offered = ["recompute", "selective"]
    first = tokens(setup.batch, setup.lengths[0], 0)

    def attach(budget: int) -> Runner:
        model = gpt(n, setup.d_model, setup.n_head)
        h = client.attach(model, budget_bytes=budget, modes=modes_offered)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        timed_step(model, opt, first, h.step)  # the profiling step
        return Runner("", model, opt, h, [], [])

    none = attach(2**50)
    none.handle.pin_modes((S,) * n)  # type: ignore[union-attr]
    timed_step(none.model, none.opt, tokens(setup.batch, longest, 0), none.handle.step)  # type: ignore[union-attr]
    none_peak = none.handle.last_stats.saved_peak_bytes  # type: ignore[union-attr]
    profile = none.handle._backend._hello.profile()  # type: ignore[union-attr]
    budgets = {ratio: int(none_peak * ratio) for ratio in ratios}
    ours = {ratio: attach(budget) for ratio, budget in budgets.items()}
    statics: dict[str, Runner] = {}
    rows = []
    for phase, seq in enumerate(setup.lengths):
        shape = Shape(batch=setup.batch, seq_len=seq, tokens=setup.batch * seq)
        plans: dict[str, tuple[Mode, ...]] = {}
        for budget in budgets.values():
            plans.update(families(n, profile, shape, budget))
        for name, modes in plans.items():
            runner = statics.setdefault(name, attach(2**50))
            runner.times, runner.peaks = [], []
            runner.handle.pin_modes(modes)  # type: ignore[union-attr]
            runner.step(tokens(setup.batch, seq, 0), record=False)  # the pin applies at this step's boundary
        base: list[float] = []
        trials = {ratio: r.handle._backend._session.controller.explorer.trial_steps for ratio, r in ours.items()}  # type: ignore[union-attr]
        over = dict.fromkeys(ratios, 0)
        for i in range(setup.warmup + setup.steps):
            data = tokens(setup.batch, seq, 1000 * phase + i + 1)
            record = i >= setup.warmup
            none.step(data, record)
            if record:
                base.append(none.times[-1])
            for ratio, r in ours.items():
                r.step(data, record)
                assert r.handle is not None and r.handle.last_stats is not None
                over[ratio] += r.handle.last_stats.saved_peak_bytes > budgets[ratio]
            for name in plans:
                statics[name].step(data, record=True)
        peaks = {name: max(statics[name].peaks) for name in plans}
        ratio_of = {
            name: median([t / b for t, b in zip(statics[name].times[setup.warmup :], base, strict=True)])
            for name in plans
        }
        for ratio, r in ours.items():
            budget = budgets[ratio]
            mine = median([t / b for t, b in zip(r.times[-setup.steps :], base, strict=True)])
            fitting = {k: v for k, v in ratio_of.items() if peaks[k] <= budget}
            best = min(fitting.items(), key=lambda kv: kv[1]) if fitting else None
            session = r.handle._backend._session  # type: ignore[union-attr]
            rows.append(
                {
                    "budget_ratio": ratio,
                    "budget_mib": budget / MiB,
                    "seq": seq,
                    "rematd_ratio": mine,
                    "rematd_modes": "".join(LETTERS[m] for m in r.handle.modes),  # type: ignore[union-attr]
                    "rematd_peak_mib": max(r.peaks[-setup.steps :]) / MiB,
                    "steps_over_budget": over[ratio],
                    "trial_steps": session.controller.explorer.trial_steps - trials[ratio],
                    "best_static": best[0] if best else "none fits",
                    "best_static_modes": "".join(LETTERS[m] for m in plans[best[0]]) if best else "",
                    "best_static_ratio": best[1] if best else None,
                    "vs_best_static": mine / best[1] if best else None,
                    "static": {k: {"ratio": v, "peak_mib": peaks[k] / MiB} for k, v in ratio_of.items()},
                }
            )
    for r in (none, *statics.values(), *ours.values()):
        if r.handle is not None:
            r.handle.close()
    return {"setup": asdict(setup), "none_peak_mib": none_peak / MiB, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few rounds (smoke run)")
    parser.add_argument("--out", default="artifacts/bench-phases.json")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--d-model", type=int, default=128, help="model width (128)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (4)")
    parser.add_argument("--lengths", default="256,160", help="sequence length of each phase (256,160)")
    parser.add_argument("--warmup", type=int, default=30, help="rounds per phase before measuring (30)")
    parser.add_argument("--steps", type=int, default=10, help="measured rounds per phase (10)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        setup = Setup(n_layer=4, d_model=32, n_head=2, batch=2, lengths=(64, 40), warmup=12, steps=3)
    else:
        lengths = tuple(int(x) for x in args.lengths.split(","))
        setup = Setup(
            n_layer=12, d_model=args.d_model, n_head=4, batch=args.batch, lengths=lengths, warmup=args.warmup,
            steps=args.steps,
        )  # fmt: skip
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), **run(setup, [0.45, 0.7])}
    cols = [
        ("budget_ratio", "budget", ".0%"),
        ("seq", "length", "d"),
        ("rematd_ratio", "rematd", ".3f"),
        ("rematd_modes", "its plan", ""),
        ("rematd_peak_mib", "peak MiB", ".1f"),
        ("budget_mib", "budget MiB", ".1f"),
        ("steps_over_budget", "over", "d"),
        ("trial_steps", "trials", "d"),
        ("best_static", "fastest static that fits", ""),
        ("best_static_modes", "", ""),
        ("best_static_ratio", "its ratio", ".3f"),
        ("vs_best_static", "rematd / it", ".3f"),
    ]
    print(table(report["rows"], cols))
    write_json(args.out, report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
