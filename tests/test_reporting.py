"""Fewer reports from steady ranks, as the service allows; a restarted service continues a rank's plan."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from rematd import client, wire
from rematd.client.service.folding import Folder, fold, steady
from rematd.planner import Mode
from rematd.server import ServeConfig, ServiceThread
from rematd.server.config import CoreConfig
from rematd.server.core.advisor import AdvisorCore
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store
from rematd.v1 import advisor_pb2 as pb

from .helpers import service_thread, tiny_model, train_step
from .test_service import hello, session, stats


def test_steady_steps_fold_and_a_change_goes_out_at_once() -> None:
    f = Folder()
    assert f.offer(stats(0, 1000), now=0.0) == [stats(0, 1000)], "nothing is folded before the service allows it"
    f.interval = 10.0
    assert f.offer(stats(1, 1010), now=1.0) == []
    assert f.offer(stats(2, 990), now=2.0) == []
    # Another length: what was folded goes first, on its own, then the step.
    out = f.offer(stats(3, 1000, seq=128), now=3.0)
    assert [r.step for r in out] == [2, 3] and out[0].steps == 2 and out[0].saved_peak_bytes == 1010
    # A peak 5% above the last one reported is news.
    assert f.offer(stats(4, 1050, seq=128), now=4.0) == [stats(4, 1050, seq=128)]
    assert f.offer(stats(5, 1049, seq=128), now=5.0) == []
    assert f.due(now=6.0) is None, "the interval is not up"
    folded = f.due(now=6.0, force=True)
    assert folded is not None and folded.step == 5 and folded.steps == 1
    # Once the interval is up, the steady steps go out as one report.
    f.offer(stats(6, 1050, seq=128), now=7.0)
    out = f.offer(stats(7, 1050, seq=128), now=20.0)
    assert [(r.step, r.steps) for r in out] == [(7, 2)]
    f.restart()
    assert f.offer(stats(8, 1050, seq=128), now=21.0) == [stats(8, 1050, seq=128)], "a new stream hears every step"


def test_fold_keeps_the_largest_peaks_and_the_mean_step_time() -> None:
    a = replace(stats(1, 900), step_seconds=1.0, peak_allocated_bytes=7)
    b = replace(a, step=2, saved_peak_bytes=800, step_seconds=3.0, peak_allocated_bytes=0)
    both = fold(a, b)
    assert (both.step, both.steps, both.saved_peak_bytes, both.peak_allocated_bytes) == (2, 2, 900, 7)
    assert both.step_seconds == pytest.approx(2.0)
    assert steady(b, a) is False  # 800 against 900: over 2% apart
    assert pb.StepStats.FromString(wire.stats_to_pb(both).SerializeToString()).steps == 2


def test_less_room_on_the_device_or_more_fragmentation_is_not_steady() -> None:
    GiB = 2**30
    was = replace(stats(1, 900, budget=64 * GiB), reserved_bytes=40 * GiB, free_bytes=30 * GiB, total_bytes=80 * GiB)
    assert steady(replace(was, step=2, free_bytes=30 * GiB - 1000), was), "jitter within a grain is steady"
    assert steady(replace(was, step=2, free_bytes=40 * GiB), was), "more room tells the service nothing urgent"
    assert not steady(replace(was, step=2, free_bytes=20 * GiB), was), "another process took 10 GiB"
    assert not steady(replace(was, step=2, inactive_split_bytes=4 * GiB), was), "4 GiB more fragmented"


def _core(tmp_path: Path, **config: float) -> AdvisorCore:
    return AdvisorCore(Store(f"sqlite:///{tmp_path / 'r.db'}"), Metrics(), CoreConfig(**config))  # type: ignore[arg-type]


def test_the_service_allows_folding_only_while_nothing_would_change(tmp_path: Path) -> None:
    core = _core(tmp_path, max_report_interval_seconds=5.0, quiet_steps=4)
    s, _ = core.open_session(hello(budget=10_000))
    intervals = []
    for step in range(8):
        core.on_stats(s, stats(step, 3900))
        intervals.append(core.report_interval(s))
    assert intervals[:3] == [0.0] * 3 and intervals[-1] == 5.0, intervals
    # A longer step that needs a new plan: report every step again.
    assert core.on_stats(s, stats(8, 9500, seq=128)) is not None
    assert core.report_interval(s) == 0.0
    off = _core(tmp_path / "off", max_report_interval_seconds=0.0, quiet_steps=1)
    s2, _ = off.open_session(hello(job="off"))
    for step in range(5):
        off.on_stats(s2, stats(step, 3900))
    assert off.report_interval(s2) == 0.0


def test_a_mode_change_that_keeps_the_same_blocks_is_sent(tmp_path: Path) -> None:
    core = _core(tmp_path)
    s, first = core.open_session(hello())
    n = len(s.hello.blocks)
    # The planner moves block 0 from selective to recompute: the same blocks checkpoint, in another mode.
    s.sent = replace(first, modes=(Mode.SELECTIVE,) + (Mode.STORE,) * (n - 1), blocks=(0,))
    s.base = replace(first, modes=(Mode.RECOMPUTE,) + (Mode.STORE,) * (n - 1), blocks=(0,))
    out = core.training.outgoing(s, "stats.shape")
    assert out is not None and out.modes[0] == Mode.RECOMPUTE and out.version == first.version + 1


def test_a_restarted_service_continues_from_the_plan_in_force(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    first = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(db)))
    first.start()
    try:
        got, err = session(
            first.service.bound.grpc,  # type: ignore[union-attr]
            [pb.ClientMessage(hello=wire.hello_to_pb(hello(budget=10**6)))],
        )
        assert err is None and got[0].plan.version == 1
    finally:
        first.stop()
    # The rank tightened to every block recomputing (say, after an OOM the old service heard of) and
    # comes back with that plan in force: a roomy budget would give a fresh planner nothing to recompute.
    tight = replace(wire.plan_from_pb(got[0].plan), modes=(Mode.RECOMPUTE,) * 4, blocks=(0, 1, 2, 3), shape_plans=())
    back = replace(hello(budget=10**6), plan_version=1, plan=tight)
    second = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(db)))
    second.start()
    try:
        target = second.service.bound.grpc  # type: ignore[union-attr]
        got, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(back))])
        assert err is None
        assert got[0].plan.version == 1 and list(got[0].plan.checkpoint_blocks) == [0, 1, 2, 3]
        history = httpx.get(f"http://{second.service.bound.http}/api/v1/jobs/job-a/plans", timeout=10).json()  # type: ignore[union-attr]
        history = history["plans"] if isinstance(history, dict) else history
        assert [p["version"] for p in history] == [1], "the plan in force is not recorded twice"
        # A plan that does not fit the profile is refused by name.
        bad = replace(back, plan=replace(tight, modes=(Mode.RECOMPUTE,) * 3))
        _, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(bad))])
        assert err is not None and (err.details() or "").startswith("hello.plan.block_modes:"), err
    finally:
        second.stop()


def steady_run(grpc_target: str, job: str, *, pause: float) -> client.Handle:
    """60 alike steps of a tiny model streamed to a service as ``job``; the handle, still open. Store and recompute
    only: with a part's cheap mode beside storing, the step-level prices may try it a few steps (trials are
    reported, not folded), which is not what these tests are about."""
    model = tiny_model(n_layer=2, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, server=grpc_target, job=job, budget_bytes=10**9, optimizer=opt, modes=["recompute"])
    for step in range(60):
        train_step(model, opt, 32, seed=step)
        time.sleep(pause)
    return h


def test_a_steady_rank_reports_less_often_and_every_step_is_counted(tmp_path: Path) -> None:
    with service_thread(tmp_path / "r.db", max_report_interval_seconds=0.5) as bound:
        h = steady_run(bound.grpc, "steady", pause=0.02)
        assert h.flush(10.0), "folded steps go out on flush"
        metrics = httpx.get(f"http://{bound.http}/metrics", timeout=10).text
        steps = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith('rematd_steps_total{job="steady"}')
        )
        assert steps == 60, "folded steps are counted"
        rows = httpx.get(f"http://{bound.http}/api/v1/jobs/steady/stats?limit=1000", timeout=10).json()
        rows = rows["stats"] if isinstance(rows, dict) else rows
        assert len(rows) < 45, f"{len(rows)} reports for 60 steady steps"
        assert rows[-1]["step"] == 59
        h.close()


def test_close_without_flush_delivers_every_step_it_counted(tmp_path: Path) -> None:
    with service_thread(tmp_path / "r.db", max_report_interval_seconds=5.0) as bound:
        h = steady_run(bound.grpc, "closing", pause=0.01)
        h.close()  # no flush first: the steps folded into the next report must not be lost
        job = httpx.get(f"http://{bound.http}/api/v1/jobs/closing", timeout=10).json()
        assert job["ranks"][0]["last_stats"]["step"] == 59, job["ranks"][0]["last_stats"]
        rows = httpx.get(f"http://{bound.http}/api/v1/jobs/closing/stats?limit=1000", timeout=10).json()
        rows = rows["stats"] if isinstance(rows, dict) else rows
        assert len(rows) < 50, f"{len(rows)} reports: the steady steps were not folded, so nothing was at stake"
