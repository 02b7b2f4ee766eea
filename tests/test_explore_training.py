"""Trials on real CPU training steps, through a real ``rematd serve`` on loopback: the trial runs the
untried mode on a few blocks, stays within the budget, says so in its reason (REST) and is counted
in Prometheus."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from rematd import client
from rematd.planner import ControllerConfig
from rematd.planner.plan_trials import allowance
from rematd.planner.reasons import letters
from rematd.planner.timing import FORWARD_LIKE, MIN_BLOCKS
from rematd.planner.units import MODES_BY_LETTER

from .dashboard_helpers import CHROMIUM, rank_prices
from .helpers import live_server, tiny_model, train_step

STEPS = 80
"""At most: the run stops a few steps after its first trial (on a busy machine the times that call for one
come later)."""
SEQ = 128


def no_checkpoint_peak(seq: int) -> int:
    model = tiny_model(n_layer=4, d_model=32, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    h = client.attach(model, optimizer=opt, planner_thread=False)  # plans in force at the step after each answer
    # The profiling step recomputes every block; the next one stores them all (no budget to keep under).
    train_step(model, opt, seq)
    train_step(model, opt, seq)
    peak = h.last_stats.saved_peak_bytes if h.last_stats else 0
    h.close()
    return peak


def test_a_trial_runs_on_real_steps_within_the_budget_and_is_reported(tmp_path: Path) -> None:
    # About half of what storing every block saves: the plan recomputes. Every mode is priced from the profile
    # (offload, the one tried before it is planned, is CUDA's): the step-level prices try plans.
    budget = int(no_checkpoint_peak(SEQ) * 0.55)
    with live_server(tmp_path) as srv:
        model = tiny_model(n_layer=4, d_model=32, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=srv.grpc, job="explore", budget_bytes=budget, optimizer=opt)
        ran, peaks = [], []
        first_trial: int | None = None
        for step in range(STEPS):
            train_step(model, opt, SEQ, seed=step)
            assert h.flush(20.0), "the service did not answer in time"
            assert h.last_stats is not None
            ran.append(letters(tuple(h.modes)))
            peaks.append(h.last_stats.saved_peak_bytes)
            if first_trial is None and h.plan.reason.startswith("trial of a plan:"):
                first_trial = step
            if first_trial is not None and step >= max(first_trial + 8, 39):
                break
        steps = len(ran)
        plans = httpx.get(f"{srv.url}/api/v1/jobs/explore/plans", timeout=10).json()["plans"]
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        prices = httpx.get(f"{srv.url}/api/v1/jobs/explore", timeout=10).json()["ranks"][0]["prices"]
        shown = rank_prices(srv.url, "explore") if os.path.exists(CHROMIUM) else None
        h.close()
    reasons = [p["reason"] for p in plans]
    trials = [r for r in reasons if r.startswith("trial of a plan:")]
    assert all("target" in r or "in turn" in r for r in trials), trials
    assert max(peaks) <= budget, (peaks, budget)
    counted = {
        s.labels.get("job"): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "rematd_exploration_steps_total"
    }
    # Trials of plans run within their own bound at the one table entry; the counter saw them. Whether one
    # starts follows the noise of this machine's steps (a trial on steps too noisy to tell is never worth it):
    # on a busy machine none may, and the counter says none ran. The trial that steps' given times always
    # call for, through the same service, is tests/test_step_prices_served.py's.
    config = ControllerConfig()
    plan_trials = allowance(steps, config) + config.plan_trial_steps
    if trials:
        assert 1 <= counted["explore"] <= plan_trials, counted
    else:
        assert counted.get("explore", 0) == 0, (counted, reasons)
    # How sure each price is. The profiling step times no mode (it runs every block recomputed, to profile);
    # a mode the plans never ran after it is still the profile's estimate, and one they ran often enough is
    # measured: by its rematerialisation alone where it reruns a forward (recompute, attention, mlp), else
    # once a plain forward was timed beside it (a stored or recomputed block's: plans of selective blocks
    # alone time none, and its price stays the profile's). Which modes the plans use follows this machine's
    # step times, so the checks follow what ran.
    by_mode = {p["mode"]: p for p in prices}
    assert set(by_mode) == {"selective", "titan", "attention", "mlp", "recompute"}
    runs = Counter(MODES_BY_LETTER[c].name.lower() for plan in ran[1:] for c in plan)
    plain_forward = runs["store"] + runs["recompute"] > 0
    forward_like = {m.name.lower() for m in FORWARD_LIKE}
    for name, price in by_mode.items():
        comparable = plain_forward or name in forward_like
        if runs[name] == 0:
            assert price["state"] == "estimate" and price["timed_blocks"] == 0, price
        else:
            assert 0 < price["timed_blocks"] <= runs[name], (price, runs)
            if price["state"] == "measured":
                assert comparable and price["scale"] > 0, (price, runs)
            elif comparable and price["timed_blocks"] >= MIN_BLOCKS:
                assert price["state"] == "trial", (price, runs)
    # The same at the one length the job ran, with the step the mode timed most was last timed there.
    timed = max(prices, key=lambda p: p["timed_blocks"])
    (bucket,) = timed["buckets"]
    assert bucket["max_seq_len"] == SEQ and bucket["state"] == timed["state"] and bucket["scale"] > 0
    assert 0 < bucket["timed_blocks"] <= timed["timed_blocks"] and 0 < bucket["last_step"] < steps
    if shown is not None:
        assert f"{timed['mode']} {timed['state']}" in shown and "blocks timed" in shown, shown
        assert f"\u2264{SEQ} " in shown, shown
