"""The distributed examples run as their headers say (CI-sized), and what they print is true: every step of
every rank, one plan and one version across the ranks that agree, each reason's quoted figures consistent, and
a warning for every step over the budget."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from bench.launch import ROOT, run_launcher

from .test_reasons_truth import check_figures

STEP = re.compile(
    r"^(rank|stage) (\d+) step +(\d+) (?:seq +\d+ )?plan (\S+) v(\d+) peak +([\d.]+) MiB budget +([\d.]+)"
)
REASON = re.compile(r"^(?:rank|stage) (\d+) plan v(\d+): (.*)$")
OVER = re.compile(r"rematd: step (\d+) peaked at [\d.]+ MiB, [\d.]+ MiB \([\d.]+%\) over the budget of ([\d.]+) MiB")


@dataclass
class Printed:
    """What an example printed: per (rank, step) its plan, version, peak and budget; each rank's reasons; the
    steps the over-budget warnings name (with the budget they quote)."""

    steps: dict[tuple[int, int], tuple[str, int, float, float]] = field(default_factory=dict)
    reasons: list[tuple[int, int, str]] = field(default_factory=list)
    warned: list[tuple[int, float]] = field(default_factory=list)


def read(out: str) -> Printed:
    printed = Printed()
    for line in out.splitlines():
        if m := STEP.match(line):
            _, rank, step, plan, version, peak, budget = m.groups()
            printed.steps[int(rank), int(step)] = (plan, int(version), float(peak), float(budget))
        elif m := REASON.match(line):
            printed.reasons.append((int(m[1]), int(m[2]), m[3]))
        printed.warned += [(int(s), float(b)) for s, b in OVER.findall(line)]
    return printed


def check_example(out: str, *, ranks: int, steps: int, agree: bool) -> Printed:
    """Checks an example's output; ``agree``: its ranks run one plan."""
    printed = read(out)
    assert sorted(printed.steps) == [(r, s) for r in range(ranks) for s in range(steps)], out
    # A reason for every version a rank showed, each quoting figures that agree with each other.
    for rank in range(ranks):
        shown = {printed.steps[rank, s][1] for s in range(steps)}
        assert shown == {v for r, v, _ in printed.reasons if r == rank}, (rank, shown, printed.reasons)
    assert sum(check_figures(reason) for _, _, reason in printed.reasons) >= 1, printed.reasons
    if agree:
        for s in range(steps):
            assert len({printed.steps[r, s][:2] for r in range(ranks)}) == 1, f"step {s}: {out}"
    # One warning for each step a rank ran over the budget (on the CPU: its peak of saved tensors), none else;
    # the printed figures are rounded to 0.1 MiB.
    # Warnings name no rank: a step where some rank's rounded peak is too close to call is left out for all.
    near = {s for (_, s), (_, _, peak, budget) in printed.steps.items() if abs(peak - budget) <= 0.05}
    over = sorted(
        (s, budget) for (_, s), (_, _, peak, budget) in printed.steps.items() if peak > budget and s not in near
    )
    assert [w for w in sorted(printed.warned) if w[0] not in near] == over, (over, printed.warned)
    return printed


def run_example(script: str, args: list[str], env: dict[str, str] | None = None) -> str:
    """``torchrun --standalone --nproc-per-node 2 examples/<script> <args>``, as the example's header says (one
    thread a rank); what it printed, standard error after standard output."""
    launch = ["--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / script), *args]
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    return run_launcher("torch.distributed.run", launch, timeout=280, env=env, with_stderr=True)


def test_the_fsdp_example_prints_one_plan_and_true_reasons() -> None:
    out = run_example(
        "fsdp_llama.py",
        [
            *("--steps", "12", "--layers", "4", "--hidden", "64", "--batch", "2", "--seq", "32", "256", "32"),
            *("--budget-mib", "12"),
        ],
    )
    printed = check_example(out, ranks=2, steps=12, agree=True)
    # The 256-token steps fit no plan at 12 MiB: they warn, and a reason says by how much.
    assert any(s in range(4, 8) for s, _ in printed.warned), out
    assert any("no plan fits the budget of 12.0 MiB" in r for _, _, r in printed.reasons), printed.reasons


def test_the_pipeline_example_prints_each_stages_plan_and_true_reasons() -> None:
    out = run_example(
        "pipeline_llama.py", ["--steps", "8", "--layers", "4", "--hidden", "64", "--seq", "64", "--budget-mib", "3"]
    )
    printed = check_example(out, ranks=2, steps=8, agree=False)
    # The first stage holds more microbatches at once than the last: at one budget it recomputes more.
    first, last = (sum(m != "." for m in printed.steps[stage, 7][0]) for stage in (0, 1))
    assert first >= last and first > 0, printed.steps
