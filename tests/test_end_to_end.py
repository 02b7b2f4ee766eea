"""The whole loop on loopback: a real ``rematd serve`` process and real CPU training."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rematd import client
from rematd.planner import Plan

from .helpers import live_server, tiny_model, train_step

# Sequence lengths of the run: the middle stretch needs checkpointing under the budget.
SCHEDULE = [32] * 4 + [128] * 8 + [32] * 10


def run(server: str | None, job: str, budget: int) -> tuple[list[Plan], list[int], client.Handle, list[str]]:
    model = tiny_model(n_layer=4, d_model=32, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Store or recompute only: which of two equally cheap modes wins can hang on timing noise,
    # and this test compares two runs plan for plan.
    h = client.attach(model, server=server, job=job, budget_bytes=budget, optimizer=opt, modes=["recompute"])
    peaks, modes = [], []
    for step, seq in enumerate(SCHEDULE):
        train_step(model, opt, seq, seed=step)
        # Wait for the planner's answer so both modes apply each plan at the same step.
        assert h.flush(20.0), "the service did not answer in time"
        assert h.last_stats is not None
        peaks.append(h.last_stats.saved_peak_bytes)
        modes.append("".join(m.name[0] for m in h.modes))
    h.close()
    return h.history, peaks, h, modes


def budget_for_run() -> int:
    """A budget between the short and the long sequences' no-checkpoint peaks."""
    model = tiny_model(n_layer=4, d_model=32, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    h = client.attach(model, optimizer=opt)
    # The profiling step recomputes every block; the next one stores them all (no budget to keep under).
    train_step(model, opt, 32)
    assert h.flush(10.0)  # the planner's thread has made the first plan: the next step runs it
    train_step(model, opt, 32)
    short = h.last_stats.saved_peak_bytes if h.last_stats else 0
    h.close()
    return int(short * 3.5)


@pytest.fixture(scope="module")
def budget() -> int:
    return budget_for_run()


def scrape(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, s.labels.get("job", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def key(plans: list[Plan]) -> list[tuple[int, tuple[int, ...], int, int]]:
    return [(p.version, p.blocks, p.checkpoint_every, p.predicted_peak_bytes) for p in plans]


def test_served_loop_plans_rest_metrics_and_embedded_parity(tmp_path: Path, budget: int) -> None:
    with live_server(tmp_path) as srv:
        served, peaks, h, modes = run(srv.grpc, "e2e-job", budget)

        # Plans reached the client and were applied, each step with the modes for its length.
        # h.plan is the last plan as the last step ran it: that step's length's entry in the plan's own fields.
        assert len(served) >= 2 and h.plan == served[-1].at(h.last_shape), key(served)
        long_steps = [i for i, s in enumerate(SCHEDULE) if s == 128]
        short_after = [i for i, s in enumerate(SCHEDULE) if s == 32 and i > long_steps[-1]]
        assert all("R" in modes[i] for i in long_steps[1:]), f"the long sequences are checkpointed: {modes}"
        assert all(modes[i] == "SSSS" for i in short_after), f"short ones store again: {modes}"
        assert all(peaks[i] <= budget for i in long_steps[1:]), "every planned long step fits the budget"
        assert max(peaks[i] for i in long_steps[1:]) < peaks[long_steps[0]] or peaks[long_steps[0]] <= budget

        with httpx.Client(base_url=srv.url, timeout=10) as http:
            assert http.get("/healthz").json()["status"] == "ok"
            jobs = http.get("/api/v1/jobs").json()["jobs"]
            job = next(j for j in jobs if j["job"] == "e2e-job")
            assert job["num_blocks"] == 4
            assert job["ranks"][0]["last_stats"]["step"] == len(SCHEDULE) - 1
            assert job["plan"]["version"] == served[-1].version
            assert job["state"] == "ended"

            history = http.get("/api/v1/jobs/e2e-job/plans").json()["plans"]
            assert [(p["version"], tuple(p["blocks"])) for p in history] == [(p.version, p.blocks) for p in served]
            assert all(p["reason"] for p in history)
            assert [p["created_at"] for p in history] == sorted(p["created_at"] for p in history)

            stats = http.get("/api/v1/jobs/e2e-job/stats").json()["stats"]
            assert [s["step"] for s in stats] == list(range(len(SCHEDULE)))
            assert [s["peak_bytes"] for s in stats] == peaks

            missing = http.get("/api/v1/jobs/nope/plans")
            assert missing.status_code == 404 and "nope" in missing.json()["detail"]

            page = http.get("/")
            assert page.status_code == 200 and "rematd" in page.text

            samples = scrape(f"{srv.url}/metrics")
            assert ("rematd_plans_issued_total", "e2e-job") not in samples, "an ended job's series are removed"
            assert samples[("rematd_active_streams", "")] == 0

    embedded, embedded_peaks, _, embedded_modes = run(None, "e2e-job", budget)
    assert key(embedded) == key(served)
    assert embedded_peaks == peaks
    assert embedded_modes == modes


def test_metrics_while_running(tmp_path: Path, budget: int) -> None:
    with live_server(tmp_path) as srv:
        model = tiny_model(n_layer=4, d_model=32, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=srv.grpc, job="live", budget_bytes=budget, optimizer=opt)
        for step in range(3):
            train_step(model, opt, 128, seed=step)
            assert h.flush(20.0)
        samples = scrape(f"{srv.url}/metrics")
        assert samples[("rematd_budget_bytes", "live")] == budget
        assert 0 < samples[("rematd_peak_bytes", "live")] <= samples[("rematd_predicted_peak_bytes", "live")] * 4
        assert samples[("rematd_checkpointed_blocks", "live")] >= 1, "seq 128 does not fit without checkpointing"
        assert samples[("rematd_plans_issued_total", "live")] >= 1
        assert samples[("rematd_steps_total", "live")] == 3
        assert samples[("rematd_active_streams", "")] == 1
        jobs = httpx.get(f"{srv.url}/api/v1/jobs", timeout=10).json()["jobs"]
        assert jobs[0]["state"] == "running" and jobs[0]["ranks"][0]["connected"]
        h.close()
