"""Every reason a plan gives agrees with its figures: a loosening quotes room only under the target, a step it
calls over the target was over it, and a tightening keeps no more at any length it changes."""

from __future__ import annotations

import re

from rematd.client.demo.training import DemoConfig, train
from rematd.planner import Plan, ShapePlan
from rematd.planner.reasons import changed, recomputes_less

from .test_plan_reasons import given_peaks_plans

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
SIZE = r"([\d.]+ (?:B|KiB|MiB|GiB|TiB))"
OVER = re.compile(rf"a step of length (\d+) peaked at {SIZE}, over the target of {SIZE}")
ROOM = re.compile(rf"the last, of length (\d+), peaked at {SIZE} of {SIZE}")
TRIAL = re.compile(rf"predicted {SIZE}(?: as the measured peaks correct it \(x[\d.]+\))? of the {SIZE} target")
NO_FIT = re.compile(rf"no plan fits the budget of {SIZE}: the leanest, {SIZE} predicted")
FITS = re.compile(rf"predicted {SIZE} fits target {SIZE}")


def size(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def table(plan: Plan) -> tuple[ShapePlan, ...]:
    return plan.shape_plans


def check_figures(reason: str) -> int:
    """Checks the figures ``reason`` quotes against each other; how many it checked."""
    checked = 0
    for _seq, peak, target in OVER.findall(reason):
        assert size(peak) > size(target) * 0.999, reason  # the quoted sizes are rounded to 0.1
        checked += 1
    for _seq, peak, target in ROOM.findall(reason):
        assert size(peak) <= size(target) * 1.001, reason
        checked += 1
    for low, high in TRIAL.findall(reason) + FITS.findall(reason):
        assert size(low) <= size(high) * 1.001, reason
        checked += 1
    for budget, leanest in NO_FIT.findall(reason):
        assert size(leanest) > size(budget) * 0.999, reason
        checked += 1
    return checked


def check(history: list[Plan]) -> int:
    """Checks each plan's reason against its figures and the plan before it; how many figures it checked."""
    checked = 0
    for before, plan in zip([history[0], *history], history, strict=False):
        reason = plan.reason
        checked += check_figures(reason)
        if reason.startswith("loosen"):
            assert recomputes_less(table(before), table(plan)), (before.shape_plans, plan.shape_plans, reason)
            checked += 1
        if reason.startswith("tighten"):
            for _seq, old, new in changed(table(before), table(plan)):
                if old is not None:
                    # Priced at one static memory (a plan's figures are all of one moment): 1% for its move.
                    assert new.predicted_peak_bytes <= old.predicted_peak_bytes * 1.01, (old, new, reason)
                    checked += 1
    return checked


def test_the_demos_reasons_agree_with_their_figures() -> None:
    # The demo's loop on a smaller GPT, under a budget its longest steps cannot fit: every kind of reason.
    cfg = DemoConfig(steps=120, budget_mib=6, n_layer=6, d_model=64, batch=4)
    # Each step waits for the planner's answer: the same plans at the same steps, whatever the machine's load.
    history = train(cfg, server=None, job="reasons", sync=True, out=lambda _line: None).history
    reasons = [p.reason for p in history]
    # Every plan the planner made, the first and any replaced before a step ran it included.
    assert [p.version for p in history] == list(range(1, len(history) + 1)), [p.version for p in history]
    assert history[0].reason.startswith("initial plan from profile"), history[0].reason
    assert check(history) >= 6, reasons
    # The longest steps fit no plan, whatever the step times; which loosenings and trials come before them
    # follows the machine's measured times, so the room a loosening quotes is checked by the session below.
    assert any(NO_FIT.search(r) for r in reasons), reasons


def test_a_sessions_loosenings_quote_room_under_the_target_they_had() -> None:
    history = given_peaks_plans("reasons-truth")
    reasons = [p.reason for p in history]
    assert check(history) >= 3, reasons
    assert any(ROOM.search(r) for r in reasons) and any(OVER.search(r) for r in reasons), reasons


def test_a_budget_nobody_gave_is_named_as_the_hosts_memory() -> None:
    import torch

    from rematd import client
    from rematd.client.demo.tiny_gpt import GPTConfig, TinyGPT, lm_loss

    model = TinyGPT(GPTConfig(n_layer=2, d_model=32))
    h = client.attach(model, planner_thread=False)
    try:
        for _ in range(2):
            lm_loss(model, torch.randint(0, 100, (2, 17))).backward()
            h.step()
        reason = h.plan.reason
    finally:
        h.close()
    # The target quoted is the host's memory less the margin: the reason says so, and how to set a budget.
    assert FITS.search(reason) and "no budget given: the budget is the host's memory" in reason, reason
    assert "attach(budget_bytes=)" in reason
