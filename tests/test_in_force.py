"""``h.plan`` is the plan the step ran: after a length change, its modes are the blocks' and its prediction the
table entry's for that length."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from rematd import client
from rematd.planner import Mode
from rematd.planner.plan import entry_for
from rematd.server import ServeConfig, ServiceThread

from .helpers import tiny_model, train_step


def test_the_plan_in_force_follows_the_length_the_step_ran() -> None:
    model = tiny_model(n_layer=4, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # Long steps need recomputation under this budget, short ones store every block.
    h = client.attach(model, optimizer=opt, budget_bytes=3 * 2**20)
    ran: dict[int, set[tuple[Mode, ...]]] = {}
    try:
        for step, seq in enumerate([256] * 4 + [64] * 3 + [256] * 2):
            train_step(model, opt, seq, seed=step)
            plan = h.plan
            assert plan.modes == h.modes, (step, seq, plan)
            if not plan.version:
                assert set(h.modes) == {Mode.RECOMPUTE} and "profiling" in plan.reason
                continue
            ran.setdefault(seq, set()).add(h.modes)
            entry = entry_for(plan.shape_plans, h.last_shape)
            if entry is not None and entry.modes == h.modes:
                assert plan.predicted_peak_bytes == entry.predicted_peak_bytes
            assert plan.blocks == tuple(i for i, m in enumerate(h.modes) if m != Mode.STORE)
            assert plan.predicted_peak_bytes > 0
        assert ran[64] != ran[256], ran  # the lengths ran different modes: the check above saw a change
        # The history keeps the planner's plans as they came; the last one's table holds both lengths' entries.
        assert h.history[-1].version == h.plan.version
    finally:
        h.close()


def _checkpointed_gauge(http: str, job: str) -> float:
    metrics = httpx.get(f"{http}/metrics", timeout=10).text
    prefix = f'rematd_checkpointed_blocks{{job="{job}"'
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix))


def test_served_surfaces_show_the_plan_each_step_ran(tmp_path: Path) -> None:
    model = tiny_model(n_layer=4, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ran: list[tuple[int, tuple[Mode, ...]]] = []
    # Every scrape renders afresh: the gauges are read after each step.
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "rematd.db"), metrics_cache_seconds=0))
    bound = svc.start()
    http = f"http://{bound.http}"
    h = client.attach(model, optimizer=opt, budget_bytes=3 * 2**20, server=bound.grpc, job="in-force")
    try:
        # A step of a new length makes the service plan again: it has sent a plan the rank has not run yet.
        for step, seq in enumerate([256] * 4 + [64] * 3 + [256] * 2 + [64]):
            train_step(model, opt, seq, seed=step)
            assert h.flush(20.0)
            assert h.plan.modes == h.modes, (step, h.plan)
            version, modes = h.plan.version, h.modes
            ran.append((version, modes))
            job = httpx.get(f"{http}/api/v1/jobs/in-force", timeout=10).json()
            rank = job["ranks"][0]
            assert (rank["plan_version"], rank["modes"]) == (version, [m.label for m in modes]), (step, rank)
            assert _checkpointed_gauge(http, "in-force") == sum(m != Mode.STORE for m in modes), step
            if version:
                assert job["in_force"]["version"] == version, (step, job["in_force"])
                assert job["in_force"]["modes"] == [m.label for m in modes], (step, job["in_force"])
        rows = httpx.get(f"{http}/api/v1/jobs/in-force/stats", timeout=10).json()["stats"]
        # Each step's row names the plan the step ran.
        assert [r["plan_version"] for r in rows] == [v for v, _ in ran], rows
        assert len({v for v, _ in ran}) > 1 and len({m for _, m in ran}) > 1, ran  # plans and modes moved
    finally:
        h.close()
        svc.stop()
