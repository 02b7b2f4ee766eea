"""Every switch between two modes, under DeepSpeed ZeRO (stages 1-3, parameters released after use or kept and
prefetched) and FSDP2, on 2 CPU ranks (gloo), against the same training without rematd.

The worker (``tests.workers.switch_matrix``) pins each block along a circuit through every ordered pair of
distinct modes, each pin held two steps under ZeRO-3 (it records its fetch order on the first and prefetches
along it on the second, so the next switch lands on an established trace) and one under stages 1 and 2 and
FSDP2, first among the exact modes (bitwise as without rematd), then into and out of compress (lossy: it trains
to the end and stays close). The DeepSpeed example runs to the end in a CI-sized form.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path
from typing import Any

import pytest

from .distributed import run_ranks
from .test_examples import check_example, run_example

MODES = ["store", "selective", "recompute", "compress"]
FINE = ["store", "selective", "titan", "attention", "mlp", "recompute", "compress"]
"""Every mode that trains bitwise (the finer ones too: torchtitan's op policy, a block's attention or MLP alone),
then compress; the circuit takes each of the 30 switches between the six exact modes."""
PARTS = ["store", "titan", "attention", "mlp", "recompute", "compress"]
"""Under ZeRO-3, whose steps cost most, the finer modes with store and recompute: selective's switches are
the released case's, and FSDP2's circuit takes all 30."""
DS = {"DS_ACCELERATOR": "cpu"}
LR = 1e-2
"""The workers' AdamW learning rate."""
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (scripts/setup.sh installs it: DS_BUILD_OPS=0, --no-build-isolation)",
)


def check_matrix(result: dict[str, Any]) -> None:
    case, steps = result["case"], result["steps"]
    assert result["step_count"] == len(steps), f"{case}: the handle counted {result['step_count']} steps"
    n = len(steps[0]["modes"])
    lossy_from = next((k for k, s in enumerate(steps) if "COMPRESS" in s["modes"]), len(steps))
    for k, step in enumerate(steps):
        where = f"{case} step {k} pinned {step['pinned']}"
        assert step["modes"] == (step["pinned"] or ["RECOMPUTE"] * n), where
        plain, ours = step["losses"]
        if k < lossy_from:
            assert step["loss_equal"] and step["params_equal"], (where, step["max_diff"])
        else:
            # Compress keeps the forward exact and the gradients close: the runs drift apart only a little.
            assert math.isfinite(ours) and abs(ours - plain) <= 0.02 * abs(plain), (where, plain, ours)
            # Adam moves each parameter by about its learning rate a step whatever the gradient's size. The tiny
            # models' query and key weights have gradients (~1e-5) as small as compress's error: where their signs
            # differ the runs part by up to that a step, and keep parting while compress runs (ZeRO-3 with
            # parameters kept, 22 compressing steps: 0.005-0.012 a step, 0.14 at the end; plain training without
            # DeepSpeed alike). A fixed bound fails the longest circuit however it trains; a step of Adam's apart
            # per compressing step does not (the worst case, opposite full steps, is two).
            lossy_steps = k - lossy_from + 1
            assert step["max_diff"] <= LR * lossy_steps, (where, step["max_diff"], lossy_steps)
    # The matrix is what it claims: every block made every switch between distinct modes, after its forward's
    # trace was established (each pin held two steps).
    modes = [s["modes"] for s in steps[1:]]
    offered = [m.upper() for m in case.get("modes") or MODES[:3] if m != "compress"] + (
        ["COMPRESS"] if "compress" in (case.get("modes") or []) else []
    )
    for i in range(n):
        made = {(a[i], b[i]) for a, b in itertools.pairwise(modes) if a[i] != b[i]}
        assert made == set(itertools.permutations(offered, 2)), (case, i, sorted(made))
    held = [len(list(g)) for _, g in itertools.groupby(tuple(m) for m in modes)]
    assert min(held) >= case.get("hold", 2), held
    assert lossy_from < len(steps) or "compress" not in (case.get("modes") or [])


@needs_deepspeed
@pytest.mark.parametrize(
    "cases",
    [
        pytest.param(
            [
                # No fetch order below stage 3: each pin held one step.
                {"model": "gpt2", "stage": 1, "order": "after", "modes": MODES, "hold": 1},
                {"model": "gpt2", "stage": 2, "order": "before", "modes": MODES, "hold": 1},
            ],
            id="stages-1-2",
        ),
        pytest.param(
            [
                {"model": "gpt2", "stage": 3, "order": "after", "modes": MODES},  # parameters released after use
                {"model": "gpt2", "stage": 3, "order": "before", "live": True, "modes": PARTS},  # kept, prefetched
            ],
            id="stage-3-released-and-prefetched",
        ),
    ],
)
def test_every_switch_under_zero_trains_to_the_end_bitwise_or_close(tmp_path: Path, cases: list[Any]) -> None:
    config = {"with": "deepspeed", "cases": cases}
    for results in run_ranks("switch_matrix", tmp_path, world=2, config=config, timeout=280, env=DS):
        assert [r["case"] for r in results] == cases
        for result in results:
            check_matrix(result)


def test_every_switch_under_fsdp2_trains_to_the_end_bitwise_or_close(tmp_path: Path) -> None:
    # FSDP2 records no fetch order: each pin held one step.
    cases = [{"model": "llama", "modes": FINE, "hold": 1}]
    for results in run_ranks("switch_matrix", tmp_path, world=2, config={"with": "fsdp", "cases": cases}, timeout=280):
        for result in results:
            check_matrix(result)


@needs_deepspeed
def test_the_deepspeed_example_runs_to_the_end_switching_plans(tmp_path: Path) -> None:
    args = [
        *("--steps", "12", "--layers", "4", "--hidden", "64", "--batch", "2", "--seq", "32", "256", "32"),
        *("--budget-mib", "16"),
    ]
    out = run_example("deepspeed_llama.py", args, env=DS)
    # Every step of both ranks, one plan and version across them, true reasons, a warning for each step over.
    printed = check_example(out, ranks=2, steps=12, agree=True)
    by_step = {s: plan for (r, s), (plan, *_) in printed.steps.items() if r == 0}
    # The profiling step recomputes every block, and so do the steps before the planner's first plan is in (its
    # thread plans while they run); then store at 32 tokens; at 256 the budget makes it checkpoint, and back at 32
    # it stores again.
    assert by_step[0] == "RRRR" and "...." in (by_step[1], by_step[2]) and by_step[11] == "....", by_step
    assert any(set(plan) - {"."} for plan in by_step.values()), f"the plan never checkpointed: {by_step}"
