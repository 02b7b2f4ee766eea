"""Step-level prices through a real ``rematd serve`` on loopback: a rank streams steps whose times say that
storing costs more than recomputing, the service's planner learns it from the reports' step times, and
the plan history (REST), the rank's prices (REST) and the dashboard (Chromium) say where the step times
overrule the per-block prices."""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from rematd import wire
from rematd.planner import ControllerConfig, Mode, ModeSeconds, Shape, letters
from rematd.planner.cost import choose, peak_of
from rematd.planner.messages import Hello, StepStats
from rematd.planner.plan_trials import OUTCOMES, allowance
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .dashboard_helpers import CHROMIUM, rank_prices
from .helpers import live_server
from .test_service import hello

N = 8
SEQ = 128
FORWARD = 0.01
BUDGET = 12_000
STEPS = 150


def true_seconds(modes: tuple[Mode, ...]) -> float:
    """Storing a block costs the step 1.5 forwards (its activations come back from memory), recomputing it
    one: every block recomputed is fastest, where the per-block timings see only the recomputation."""
    return 3 * N * FORWARD + sum(FORWARD if m == Mode.RECOMPUTE else 1.5 * FORWARD for m in modes)


def stream(target: str, h: Hello, shown: queue.Queue[str]) -> list[tuple[Mode, ...]]:
    """The rank: each step runs the plan in force, reports its peak and time; once done it waits (its
    prices are shown for live ranks only) until told to say goodbye. The modes of every step."""
    profile = h.profile()
    shape = Shape(batch=1, seq_len=SEQ, tokens=SEQ)
    options = profile.options_at(shape)
    outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
    outbox.put(pb.ClientMessage(hello=wire.hello_to_pb(h)))
    ran = []
    with grpc.insecure_channel(target) as ch:
        replies = pb_grpc.AdvisorStub(ch).Session(iter(outbox.get, None), timeout=60)
        first = next(replies).plan
        version, plans = first.version, {first.version: first}
        for step in range(STEPS):
            modes = wire.plan_from_pb(plans[version]).modes_for(shape, N)
            ran.append(modes)
            peak = peak_of(choose(options, modes))
            rec = modes.count(Mode.RECOMPUTE)
            msg = StepStats(
                step=step,
                saved_peak_bytes=peak,
                peak_allocated_bytes=peak,
                budget_bytes=BUDGET,
                shape=shape,
                plan_version=version,
                step_seconds=true_seconds(modes) * (1.0 + 0.01 * ((step * 7919) % 13 - 6) / 6),
                mode_seconds=(ModeSeconds(Mode.RECOMPUTE, rec, rec * FORWARD, rec * FORWARD),) if rec else (),
            )
            outbox.put(pb.ClientMessage(stats=wire.stats_to_pb(msg)))
            while True:
                reply = next(replies)
                if reply.WhichOneof("kind") == "plan":
                    plans[reply.plan.version] = reply.plan
                    version = reply.plan.version
                elif reply.ack.step == step:
                    break
        shown.get(timeout=60)
        outbox.put(pb.ClientMessage(goodbye=pb.Goodbye(reason="done")))
        outbox.put(None)
        list(replies)
    return ran


def test_a_served_rank_learns_from_step_times_and_says_where_they_overrule(tmp_path: Path) -> None:
    h = dataclasses.replace(hello(job="steps", rank=0, budget=BUDGET, n=N), world_size=1)
    done: queue.Queue[str] = queue.Queue()
    with live_server(tmp_path) as srv:
        result: dict[str, list[tuple[Mode, ...]]] = {}
        rank = threading.Thread(target=lambda: result.setdefault("ran", stream(srv.grpc, h, done)), daemon=True)
        rank.start()
        try:
            with httpx.Client(base_url=srv.url, timeout=10) as http:
                for _ in range(600):
                    job = http.get("/api/v1/jobs/steps")
                    if job.status_code == 200 and (job.json()["ranks"][0]["last_stats"] or {}).get("step") == STEPS - 1:
                        break
                    threading.Event().wait(0.1)
                prices = job.json()["ranks"][0]["prices"]
                plans = http.get("/api/v1/jobs/steps/plans").json()["plans"]
                metrics = http.get("/metrics").text
            text = rank_prices(srv.url, "steps") if os.path.exists(CHROMIUM) else None
        finally:
            done.put("shown")
            rank.join(timeout=60)
        assert not rank.is_alive()
    ran = result["ran"]
    assert ran[-1] == (Mode.RECOMPUTE,) * N, f"the rank ends recomputing every block: {letters(ran[-1])}"
    assert ran[5].count(Mode.RECOMPUTE) < N, "the per-block prices alone recompute as few blocks as fit"
    reasons = [p["reason"] for p in plans]
    assert any(r.startswith("trial of a plan:") for r in reasons), reasons
    # The steps the trials ran are counted, within the bound trials keep to at the one table entry.
    counted = sum(
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "rematd_exploration_steps_total" and s.labels.get("job") == "steps"
    )
    config = ControllerConfig()
    assert 1 <= counted <= allowance(STEPS, config) + config.plan_trial_steps, counted
    # Each trial ended is counted by outcome, and each verdict is a plan in the history, sent to the rank
    # whether or not it changed the modes.
    outcomes = {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "rematd_plan_trials_total" and s.labels.get("job") == "steps"
    }
    assert set(outcomes) == set(OUTCOMES) and outcomes["kept"] >= 1, outcomes
    verdicts = [r for r in reasons if "trial of a plan over" in r or "ends unweighed" in r]
    assert len(verdicts) == sum(outcomes.values()), (outcomes, verdicts)
    assert any("RRRRRRRR kept: measured" in r or "step times overrule the per-block prices" in r for r in reasons)
    recompute = next(p for p in prices if p["mode"] == "recompute")
    (bucket,) = recompute["buckets"]
    assert bucket["max_seq_len"] == SEQ
    assert bucket["step_share"] is not None and all(s < 0 for s in bucket["step_share"]), bucket
    assert all(b > 0 for b in bucket["block_share"]), bucket
    if text is not None:
        assert "by step times" in text and "per-block" in text, text
