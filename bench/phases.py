"""rematd after convergence against the fastest static plan that fits, per sequence length held for a phase.

    python -m bench.phases                     # 12-block GPT, d_model 128, batch 4, lengths 256 then 160
    python -m bench.phases --quick             # a small model, for a smoke run

One budget per job (a fraction of what no checkpointing saves for backward at
the longest length, ``--budgets``), held while the length changes phase by
phase, as in ``rematd demo``. The contenders step in turn, round after round:
no checkpointing, rematd at each budget, and at each length the static plans a
user would write (all-selective, all torchtitan's selective, the attention
alone or the MLP alone recomputed in every block, all-recompute, every 2nd,
3rd and 4th block recomputed, and for each budget the fewest leading blocks
recomputed, selective, with their MLP or their attention recomputed, or
recomputed with the rest selective or with the rest's MLP recomputed, that
fit by the profile,
every larger count of leading blocks recomputed, and the fewest recomputed
blocks spread evenly). A static plan counts as fitting when its measured peak
(saved-tensor accounting) is within the budget. Static plans over every
budget stop after the phase's first round; after the warm-up rounds, only the
``--finalists`` fastest that fit each budget (by the warm-up) go on stepping in
the measured rounds, so that a round is short and many fit in the time.
Reported per budget and length:
rematd's step time over no checkpointing's and over the fastest static plan
that fits (medians over the phase's last rounds of each round's ratio, with
their quartiles), that plan picked two ways: the fastest in the warm-up rounds
(then compared on the measured rounds, which did not pick it), and the fastest
of the finalists in the measured rounds themselves (the luckiest of a few
noisy medians, so biased fast); whether rematd is within 1.03 of the first
with no step over the budget; how far apart two finalists running the same
plan under two names measured (the noise alone);
the same over the whole phase (the sum of rematd's step times, warm-up and
trials included, over the fastest static plan's in the same rounds),
and over its own plan pinned from the first measured round (what adapting
costs beyond the plan's work), its plan, its largest peak and its steps over
the budget (warm-up and trials included), and the trial steps it spent (of
modes and of plans). The load average before and after is printed beside the
table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.common import (
    MiB,
    freed_memory_kept,
    gpt,
    malloc_argument,
    median,
    median_interval,
    table,
    timed_step,
    tokens,
    write_json,
)
from bench.strategies import Runner
from rematd import client
from rematd.client.memory.accounting import SavedTensorAccounting
from rematd.planner import Mode, Profile, Shape, letters
from rematd.planner.cost import choose, peak_of
from rematd.planner.plan import entry_for
from rematd.planner.spread import spread

S, K, R = Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE
T, A, M = Mode.TITAN, Mode.ATTENTION, Mode.MLP
TARGET = 1.03
"""rematd's step over the fastest static plan that fits, at most (the median of the rounds' ratios)."""
EVERY = ((2, "nd"), (3, "rd"), (4, "th"))


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
    finalists: int = 3
    """Static plans per budget that go on from the warm-up rounds to the measured ones: the fastest that fit,
    by the warm-up (0: every static plan steps in every round). Plans over every budget stop after a step."""


def families(n: int, profile: Profile, shape: Shape, budget: int) -> dict[str, tuple[Mode, ...]]:
    """The static plans tried at ``shape``: the fixed ones (all-selective, all-recompute, every 2nd, 3rd
    and 4th block recomputed); per family the fewest leading blocks that fit ``budget`` by the profile
    (leading blocks: their kept bytes are released last, so they fit best), recomputed, selective, or
    recomputed with the rest selective; every count of leading blocks recomputed from that fewest up (more
    recomputation can be faster where storing costs time); and the fewest recomputed blocks spread evenly."""
    plans = {
        "all-selective": (K,) * n,
        "all-titan": (T,) * n,
        "all-attention": (A,) * n,
        "all-mlp": (M,) * n,
        "all-recompute": (R,) * n,
        **{f"every-{k}{suffix}": tuple(R if i % k == 0 else S for i in range(n)) for k, suffix in EVERY},
    }
    options = profile.options_at(shape)
    other = profile.other_at(shape)

    def fits(modes: tuple[Mode, ...]) -> bool:
        return peak_of(choose(options, modes), outside_bytes=other, outside_in_backward=False) <= budget

    families = (
        ("first-m R", R, S),
        ("first-m s", K, S),
        ("first-m m", M, S),
        ("first-m a", A, S),
        ("first-m R, rest s", R, K),
        ("first-m R, rest m", R, M),
    )
    for name, head, tail in families:
        fewest = next((m for m in range(1, n + 1) if fits((head,) * m + (tail,) * (n - m))), None)
        if fewest is None:
            continue  # none of them (m = 0) is storing every block, already a contender
        plans[name.replace("first-m", f"first-{fewest}")] = (head,) * fewest + (tail,) * (n - fewest)
        if head == R and tail == S:
            for m in range(fewest + 1, n):
                plans[f"first-{m} R"] = (R,) * m + (S,) * (n - m)
            spread_out = set(spread(list(range(n)), fewest))
            modes = tuple(R if i in spread_out else S for i in range(n))
            if fits(modes):
                plans[f"spread-{fewest} R"] = modes
    return plans


class CompiledRunner(Runner):
    """``torch.compile`` with its own activation memory budget: every step (a new length recompiles)
    under ``activation_memory_budget``; its peak from the saved-tensor hooks (what the compiled graph
    saves for backward)."""

    def __init__(self, setup: Setup, ratio: float) -> None:
        model = gpt(setup.n_layer, setup.d_model, setup.n_head)
        # A class of its own per budget: Dynamo would otherwise serve every budget the graph compiled first
        # (its guards pass for another instance of the same class), whatever the budget in force.
        model.__class__ = type(f"TinyGPT{round(ratio * 100)}", (type(model),), {})
        compiled: Any = torch.compile(model)
        super().__init__(f"compile-{ratio:.0%}", compiled, torch.optim.SGD(model.parameters(), lr=1e-4), None, [], [])
        self.ratio = ratio
        self.acct = SavedTensorAccounting()
        self.acct.exclude_module_state(model)
        self.acct.active = True

    def step(self, data: torch.Tensor, record: bool) -> None:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.ratio), self.acct.hooks():
            t = timed_step(self.model, self.opt, data)
        peak = self.acct.take_peak()
        if record:
            self.times.append(t)
            self.peaks.append(peak)


@dataclass(slots=True)
class Ours:
    """rematd at one budget, with what it did over a phase."""

    runner: Runner
    budget: int
    over: int = 0
    trials_before: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    """Steps the session had spent on trials of modes and of plans, and plan trials void, disputed and reverted
    (a plan kept whose gain did not hold on fresh steps), when the phase began."""

    @property
    def session(self) -> Any:
        return self.runner.handle._backend.session  # type: ignore[union-attr]

    def _entry(self, shape: Shape) -> Any:
        """The plan table's entry in force at ``shape`` (None: the table has none there)."""
        return entry_for(self.session.controller.table, shape)

    def in_force(self, shape: Shape) -> tuple[Mode, ...]:
        """The modes of the plan in force at ``shape``: a plan on trial's turns aside (a trial hands the plan it
        tries and the plan in force by turns; pinning or reporting whichever ran last would name the wrong one)."""
        entry = self._entry(shape)
        return tuple(entry.modes) if entry is not None else tuple(self.runner.handle.modes)  # type: ignore[union-attr]

    def predicted(self, shape: Shape) -> int:
        """The model's peak for the entry in force at ``shape`` (a trial's turns aside), uncorrected by the measured
        peaks."""
        entry = self._entry(shape)
        return int(entry.predicted_peak_bytes) if entry is not None else 0


def attach(setup: Setup, budget: int) -> Runner:
    model = gpt(setup.n_layer, setup.d_model, setup.n_head)
    h = client.attach(model, budget_bytes=budget)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    timed_step(model, opt, tokens(setup.batch, setup.lengths[0], 0), h.step)  # the profiling step
    return Runner("", model, opt, h, [], [])


def pin_statics(statics: dict[str, Runner], plans: dict[str, tuple[Mode, ...]], setup: Setup, seq: int) -> None:
    """Each static plan of this length on a runner of its own (made once per plan name)."""
    for name, modes in plans.items():
        statics.setdefault(name, attach(setup, 2**50)).pin(modes, tokens(setup.batch, seq, 0))


def per_round(times: list[float], base: list[float], steps: int) -> list[float]:
    """Each of the last ``steps`` rounds' step time over ``base``'s in the same round."""
    return [t / b for t, b in zip(times[-steps:], base[-steps:], strict=True)]


def ratio_to(r: Runner, base: list[float], steps: int) -> float:
    """Median over the last ``steps`` rounds of each round's step time over no checkpointing's."""
    return median(per_round(r.times, base, steps))


def spread_of(xs: list[float]) -> str:
    """The interquartile range of ``xs``, as people read it: "0.98-1.04"."""
    if len(xs) < 2:
        return ""
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return f"{q1:.3f}-{q3:.3f}"


def interval_text(found: Sequence[float] | None) -> str:
    """A confidence interval as people read it: "0.990-1.020" ("" for none)."""
    return f"{found[0]:.3f}-{found[1]:.3f}" if found else ""


def pin_same(runner: Runner, ours: Ours, shape: Shape, data: torch.Tensor) -> tuple[Runner, tuple[Mode, ...]]:
    """``runner`` pinned to the plan rematd has in force now at ``shape``, ready to step in the measured rounds."""
    modes = ours.in_force(shape)
    runner.pin(modes, data)
    return runner, modes


@dataclass(frozen=True, slots=True)
class Static:
    """A static plan over one phase."""

    ratio: float
    """Its step over no checkpointing's: the median of the measured rounds' ratios."""
    peak: int
    """Its largest peak (bytes saved for backward)."""
    modes: str
    times: list[float]
    """Its step times, the phase's last rounds last."""
    warm_ratio: float
    """The same median over the warm-up rounds (from ``SETTLE`` on): what picks the fastest static plan
    without the rounds it is then compared on."""


Measured = dict[str, Static]

SETTLE = 8
"""Warm-up rounds after a length change left out of the warm-up ratios (allocator and caches settling)."""


def warm_rounds(setup: Setup) -> int:
    """The warm-up rounds the warm-up ratios are taken over: from round ``SETTLE`` of the phase on."""
    return setup.warmup - min(SETTLE, setup.warmup - 1)


def warm_ratio(times: list[float], base: list[float], setup: Setup) -> float:
    """The median of each warm-up round's step time over ``base``'s, from round ``SETTLE`` of the phase on."""
    return median(per_round(times[: -setup.steps], base[: -setup.steps], warm_rounds(setup)))


def twin_gap(statics: Measured, steps: int) -> float | None:
    """The largest difference between two static contenders running the same modes (the same plan under two
    names), as the median of their rounds' ratios less 1: what the noise alone makes of one plan; None where
    no plan runs under two names."""
    by_modes: dict[str, list[Static]] = {}
    for v in statics.values():
        by_modes.setdefault(v.modes, []).append(v)
    gaps = [
        abs(median(per_round(a.times, b.times, steps)) - 1.0)
        for twins in by_modes.values()
        for i, a in enumerate(twins)
        for b in twins[i + 1 :]
    ]
    return max(gaps) if gaps else None


def phase_row(
    ours: Ours,
    ratio: float,
    seq: int,
    base: list[float],
    setup: Setup,
    statics: Measured,
    compiled: Runner | None,
    same: tuple[Runner, tuple[Mode, ...]] | None,
) -> dict[str, Any]:
    """One budget at one length: rematd against the fastest static plan that fits and torch.compile's budget."""
    r, budget, steps = ours.runner, ours.budget, setup.steps
    rounds = setup.warmup + steps
    mine = per_round(r.times, base, steps)
    fitting = {k: v for k, v in statics.items() if v.peak <= budget}
    # The fastest in the measured rounds is the luckiest of several noisy medians there: compared on the same
    # rounds, it is biased fast. The one the warm-up rounds find fastest is compared on rounds it was not
    # picked by.
    best = min(fitting.items(), key=lambda kv: kv[1].ratio) if fitting else None
    chosen = min(fitting.items(), key=lambda kv: kv[1].warm_ratio) if fitting else None
    measured = r.peaks[-1]
    shape = Shape(batch=setup.batch, seq_len=seq, tokens=setup.batch * seq)
    predicted = ours.predicted(shape)
    controller = ours.session.controller
    # rematd over the fastest static plan that fits, round by round (both stepped in every round).
    vs_best = per_round(r.times, best[1].times, steps) if best else []
    vs_chosen = per_round(r.times, chosen[1].times, steps) if chosen else []
    row: dict[str, Any] = {
        "budget_ratio": ratio,
        "budget_mib": budget / MiB,
        "seq": seq,
        "rematd_ratio": median(mine),
        "rematd_spread": spread_of(mine),
        "rematd_modes": letters(ours.in_force(shape)),
        "rematd_peak_mib": max(r.peaks[-steps:]) / MiB,
        "predicted_peak_mib": predicted / MiB,
        "predicted_error": predicted / measured - 1.0 if measured else None,
        "steps_over_budget": ours.over,
        "mode_trial_steps": controller.explorer.trial_steps - ours.trials_before[0],
        "plan_trial_steps": controller.plan_trials.trial_steps - ours.trials_before[1],
        # Trials whose own steps were too noisy to teach the step-level fit anything (taken back out).
        "plan_trials_voided": controller.plan_trials.voided - ours.trials_before[2],
        # Trials whose gain by the fit's mean the median of their own pairs of steps did not bear out.
        "plan_trials_disputed": controller.plan_trials.disputed - ours.trials_before[3],
        # Plans kept whose gain did not hold when checked once more on fresh steps: the plan replaced came back.
        "plan_trials_reverted": controller.plan_trials.outcomes["reverted"] - ours.trials_before[4],
        "best_static": best[0] if best else "none fits",
        "best_static_modes": best[1].modes if best else "",
        "best_static_ratio": best[1].ratio if best else None,
        "best_static_spread": spread_of(per_round(best[1].times, base, steps)) if best else "",
        "vs_best_static": median(vs_best) if best else None,
        "vs_best_spread": spread_of(vs_best),
        "chosen_static": chosen[0] if chosen else "none fits",
        "chosen_static_modes": chosen[1].modes if chosen else "",
        "chosen_static_ratio": chosen[1].ratio if chosen else None,
        "vs_chosen_static": median(vs_chosen) if chosen else None,
        "vs_chosen_spread": spread_of(vs_chosen),
        # How far the median itself may be off, where the rounds' ratios spread wide: the figure against 1.03.
        "vs_chosen_interval": median_interval(vs_chosen, 0.9) if chosen else None,
        "twin_gap": twin_gap(statics, steps),
        # The whole phase, warm-up, trials and plan changes included: what adapting cost in all.
        "vs_best_phase": sum(r.times[-rounds:]) / sum(best[1].times[-rounds:]) if best else None,
        "met": bool(chosen) and median(vs_chosen) <= TARGET and ours.over == 0,
        "met_vs_luckiest": bool(best) and median(vs_best) <= TARGET and ours.over == 0,
        "static": {
            k: {"ratio": v.ratio, "warm_ratio": v.warm_ratio, "peak_mib": v.peak / MiB, "modes": v.modes}
            for k, v in statics.items()
        },
    }
    row["trial_steps"] = row["mode_trial_steps"] + row["plan_trial_steps"]
    if same is not None:
        # rematd's own plan, pinned from the first measured round: what rematd adds beyond its plan's work.
        row["same_plan_modes"] = letters(same[1])
        row["same_plan_ratio"] = ratio_to(same[0], base, setup.steps)
        row["vs_same_plan"] = median(per_round(r.times, same[0].times, steps))
    if compiled is not None:
        row["compile_ratio"] = ratio_to(compiled, base, setup.steps)
        row["compile_peak_mib"] = max(compiled.peaks[-setup.steps :]) / MiB
        row["vs_compile"] = median(per_round(r.times, compiled.times, steps))
    return row


@dataclass(slots=True)
class Race:
    """A phase's contenders still stepping in its rounds, and the static plans that stopped, with why."""

    everyone: list[Runner]
    statics: dict[str, Runner]
    plans: dict[str, tuple[Mode, ...]]
    racing: set[str]
    """The static plans still stepping."""
    dropped: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per static plan that stopped: its row of the report's ``static`` table (no measured ratio)."""

    def drop(self, name: str, why: str, warm: float | None) -> None:
        runner = self.statics[name]
        self.racing.discard(name)
        self.everyone[:] = [r for r in self.everyone if r is not runner]
        self.dropped[name] = {
            "ratio": None,
            "warm_ratio": warm,
            "peak_mib": max(runner.peaks) / MiB,
            "modes": letters(self.plans[name]),
            "dropped": why,
        }


def warm_so_far(r: Runner, base: list[float], setup: Setup) -> float:
    """At the end of a phase's warm-up rounds, :func:`warm_ratio` of ``r`` (its last rounds are the warm-up's)."""
    return median(per_round(r.times, base, warm_rounds(setup)))


def finalists(warm: dict[str, float], peaks: dict[str, int], budgets: list[int], n: int) -> set[str]:
    """Per budget, the ``n`` static plans that fit it and were fastest in the warm-up rounds."""
    keep: set[str] = set()
    for budget in budgets:
        fitting = sorted((w, k) for k, w in warm.items() if peaks[k] <= budget)
        keep.update(k for _, k in fitting[:n])
    return keep


def baseline(setup: Setup, seq: int) -> tuple[Runner, int, Profile]:
    """No checkpointing, pinned to store every block and stepped once at length ``seq``: the runner, the bytes
    it saved for backward (what budgets are fractions of), and the profile its handle measured."""
    none = attach(setup, 2**50)
    none.handle.pin_modes((S,) * setup.n_layer)  # type: ignore[union-attr]
    timed_step(none.model, none.opt, tokens(setup.batch, seq, 0), none.handle.step)  # type: ignore[union-attr]
    none_peak = none.handle.last_stats.saved_peak_bytes  # type: ignore[union-attr]
    return none, none_peak, none.handle._backend.hello.profile()  # type: ignore[union-attr]


def run(setup: Setup, ratios: list[float], with_compile: bool = False) -> dict[str, Any]:
    n = setup.n_layer
    none, none_peak, profile = baseline(setup, max(setup.lengths))
    ours = {ratio: Ours(attach(setup, int(none_peak * ratio)), int(none_peak * ratio)) for ratio in ratios}
    compiled = {ratio: CompiledRunner(setup, ratio) for ratio in ratios} if with_compile else {}
    statics: dict[str, Runner] = {}
    same_runners = {ratio: attach(setup, 2**50) for ratio in ratios}
    rows = []
    for phase, seq in enumerate(setup.lengths):
        shape = Shape(batch=setup.batch, seq_len=seq, tokens=setup.batch * seq)
        plans: dict[str, tuple[Mode, ...]] = {}
        for o in ours.values():
            plans.update(families(n, profile, shape, o.budget))
            controller = o.session.controller
            trials = controller.plan_trials
            o.over = 0
            reverted = trials.outcomes["reverted"]
            o.trials_before = (
                controller.explorer.trial_steps,
                trials.trial_steps,
                trials.voided,
                trials.disputed,
                reverted,
            )
        pin_statics(statics, plans, setup, seq)
        for c in compiled.values():
            c.times, c.peaks = [], []
        everyone = [none, *(o.runner for o in ours.values()), *compiled.values(), *(statics[k] for k in plans)]
        budgets = [o.budget for o in ours.values()]
        race = Race(everyone, statics, plans, set(plans))
        same: dict[float, tuple[Runner, tuple[Mode, ...]]] = {}
        for i in range(setup.warmup + setup.steps):
            data = tokens(setup.batch, seq, 1000 * phase + i + 1)
            if i == 1 and setup.finalists:
                # A static plan over every budget is no contender: what it saves is known after one step.
                for name in sorted(race.racing):
                    if max(statics[name].peaks) > max(budgets):
                        race.drop(name, "over every budget", None)
            if i == setup.warmup:
                if setup.finalists:
                    # Only the warm-up's fastest few per budget go on to the measured rounds: with fewer contenders
                    # a round is shorter, so that more rounds, and tighter medians, fit in the same time.
                    warm = {k: warm_so_far(statics[k], none.times, setup) for k in race.racing}
                    peaks = {k: max(statics[k].peaks) for k in race.racing}
                    keep = finalists(warm, peaks, budgets, setup.finalists)
                    for name in sorted(race.racing - keep):
                        race.drop(name, "not among the warm-up's fastest", warm[name])
                same = {ratio: pin_same(same_runners[ratio], o, shape, data) for ratio, o in ours.items()}
                everyone += [r for r, _ in same.values()]
            # Rounds in turn, each in its own order, so that the machine's drift falls on every contender alike.
            for r in random.Random(1000 * phase + i).sample(everyone, len(everyone)):
                r.step(data, record=True)
            for o in ours.values():
                o.over += o.runner.handle.last_stats.saved_peak_bytes > o.budget  # type: ignore[union-attr]
        measured: Measured = {
            k: Static(
                ratio_to(r, none.times, setup.steps),
                max(r.peaks),
                letters(plans[k]),
                r.times,
                warm_ratio(r.times, none.times, setup),
            )
            for k, r in ((k, statics[k]) for k in plans if k in race.racing)
        }
        # Storing every block is a static plan too.
        rounds = setup.warmup + setup.steps
        measured["no checkpointing"] = Static(1.0, max(none.peaks[-rounds:]), letters((S,) * n), none.times, 1.0)
        for ratio, o in ours.items():
            row = phase_row(o, ratio, seq, none.times, setup, measured, compiled.get(ratio), same.get(ratio))
            row["static"].update(race.dropped)
            rows.append(row)
    # What rematd decided, plan by plan, and why.
    decided = {
        f"{ratio:.0%}": [[p.version, letters(p.modes), p.reason] for p in o.runner.handle.history]  # type: ignore[union-attr]
        for ratio, o in ours.items()
    }
    for r in (none, *statics.values(), *(o.runner for o in ours.values()), *same_runners.values()):
        if r.handle is not None:
            r.handle.close()
    return {"setup": asdict(setup), "none_peak_mib": none_peak / MiB, "rows": rows, "plans": decided}


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
    parser.add_argument(
        "--finalists", type=int, default=3, help="static plans per budget in the measured rounds (3; 0: all)"
    )
    parser.add_argument(
        "--budgets", default="0.45,0.7", help="budgets, as fractions of no checkpointing's peak at the longest length"
    )
    parser.add_argument(
        "--compile", action="store_true", help="add torch.compile at activation_memory_budget = each budget's ratio"
    )
    malloc_argument(parser)
    args = parser.parse_args()
    if args.warmup < 2:
        parser.error(f"--warmup must be at least 2 (the warm-up picks the fastest static plan), got {args.warmup}")
    malloc_kept = freed_memory_kept(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        setup = Setup(
            n_layer=4, d_model=32, n_head=2, batch=2, lengths=(64, 40), warmup=12, steps=5, finalists=args.finalists
        )
    else:
        lengths = tuple(int(x) for x in args.lengths.split(","))
        setup = Setup(
            n_layer=12, d_model=args.d_model, n_head=4, batch=args.batch, lengths=lengths, warmup=args.warmup,
            steps=args.steps, finalists=args.finalists,
        )  # fmt: skip
    load_before = os.getloadavg()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}", flush=True)
    report = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "freed_memory_kept": malloc_kept,
        "load_before": load_before,
        **run(setup, [float(x) for x in args.budgets.split(",")], args.compile),
        "load_after": os.getloadavg(),
    }
    print(f"load average after: {' '.join(f'{x:.2f}' for x in report['load_after'])}")
    cols = [
        ("budget_ratio", "budget", ".0%"),
        ("seq", "length", "d"),
        ("rematd_ratio", "rematd", ".3f"),
        ("rematd_spread", "(quartiles)", ""),
        ("rematd_modes", "its plan", ""),
        ("rematd_peak_mib", "peak MiB", ".1f"),
        ("budget_mib", "budget MiB", ".1f"),
        ("predicted_peak_mib", "predicted MiB", ".1f"),
        ("predicted_error", "predicted / peak - 1", "+.1%"),
        ("steps_over_budget", "over", "d"),
        ("trial_steps", "trials", "d"),
        ("plan_trials_voided", "void", "d"),
        ("plan_trials_disputed", "disputed", "d"),
        ("plan_trials_reverted", "reverted", "d"),
        ("best_static", "fastest static that fits", ""),
        ("best_static_modes", "", ""),
        ("best_static_ratio", "its ratio", ".3f"),
        ("best_static_spread", "(quartiles)", ""),
        ("vs_best_static", "rematd / it", ".3f"),
        ("vs_best_spread", "(quartiles)", ""),
        ("chosen_static", "fastest static by the warm-up", ""),
        ("chosen_static_modes", "", ""),
        ("vs_chosen_static", "rematd / it", ".3f"),
        ("vs_chosen_spread", "(quartiles)", ""),
        ("vs_chosen_interval_text", "(90% CI of the median)", ""),
        ("met", f"<= {TARGET}, 0 over", ""),
        ("twin_gap", "one plan, two names", ".1%"),
        ("vs_best_phase", "whole phase / it", ".3f"),
        ("same_plan_modes", "its plan pinned", ""),
        ("vs_same_plan", "rematd / it", ".3f"),
    ]
    if args.compile:
        cols += [
            ("compile_ratio", "compile at budget", ".3f"),
            ("compile_peak_mib", "its peak MiB", ".1f"),
            ("vs_compile", "rematd / it", ".3f"),
        ]
    shown = [{**r, "vs_chosen_interval_text": interval_text(r["vs_chosen_interval"])} for r in report["rows"]]
    print(table(shown, cols))
    met = sum(bool(r["met"]) for r in report["rows"])
    luckiest = sum(bool(r["met_vs_luckiest"]) for r in report["rows"])
    print(
        f"\nrematd within {TARGET}x the fastest static plan that fits (by the warm-up rounds), 0 steps over: "
        f"{met} of {len(report['rows'])}; within {TARGET}x the fastest in the measured rounds: {luckiest}"
    )
    write_json(args.out, report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
