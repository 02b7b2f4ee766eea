"""The training thread never plans: the in-process planner runs on a thread of its own, its plans unchanged by the
move, and what rematd costs the training thread is measured and reported."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.client.plans.background import MAX_QUEUED, THREAD_NAME, ThreadedBackend
from rematd.client.plans.sources import EmbeddedBackend
from rematd.client.service.step_record import StepRecord
from rematd.client.thread_cost import ThreadClock
from rematd.planner import Mode, Plan, PlannerSession, Shape
from rematd.planner.messages import StepStats
from rematd.server import ServeConfig, ServiceThread

from .helpers import tiny_model, train_step


def _planner_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _threads_that_plan(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the threads the planner's sessions observe steps on, from now on."""
    seen: set[str] = set()
    observe = PlannerSession.observe

    def spy(self: PlannerSession, *args: object, **kwargs: object) -> Plan | None:
        seen.add(threading.current_thread().name)
        return observe(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PlannerSession, "observe", spy)
    return seen


def test_planning_runs_off_the_training_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _threads_that_plan(monkeypatch)
    model = tiny_model(n_layer=4, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = len(_planner_threads())
    h = client.attach(model, optimizer=opt, budget_bytes=3 * 2**20)
    try:
        for step in range(6):
            train_step(model, opt, 128, seed=step)
        assert h.flush(10.0)
        assert h.plan.version >= 1, "the planner's first plan arrived and was applied"
        assert seen == {THREAD_NAME}, seen
        assert len(_planner_threads()) == before + 1
    finally:
        h.close()
    assert len(_planner_threads()) == before, "close stops the planner's thread"


def test_planner_thread_false_plans_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _threads_that_plan(monkeypatch)
    model = tiny_model(n_layer=2, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with client.attach(model, optimizer=opt, budget_bytes=3 * 2**20, planner_thread=False) as h:
        for step in range(3):
            train_step(model, opt, 64, seed=step)
        assert h.plan.version >= 1  # no flush: planned before the step after the profile
    assert seen == {threading.current_thread().name}


def test_planner_thread_false_with_a_server_is_refused() -> None:
    with pytest.raises(ValueError, match="planner_thread=False"):
        client.attach(tiny_model(n_layer=2), server="127.0.0.1:1", planner_thread=False)
    with pytest.raises(TypeError, match="planner_thread"):
        client.attach(tiny_model(n_layer=2), planner_thread="yes")  # type: ignore[arg-type]


def _recorded_run() -> list[tuple[str, tuple[object, ...], dict[str, object]]]:
    """A run's hello and every step's statistics, as the planner was handed them (tight budget, two lengths)."""
    model = tiny_model(n_layer=4, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, optimizer=opt, budget_bytes=3 * 2**20, planner_thread=False)
    calls: list[tuple[str, tuple[object, ...], dict[str, object]]] = []
    backend = introspect.backend(h)
    assert isinstance(backend, EmbeddedBackend)
    for name in ("open", "send_stats", "update_hello"):
        original = getattr(backend, name)

        def record(*args: object, _name: str = name, _original: object = original, **kwargs: object) -> None:
            calls.append((_name, args, kwargs))
            _original(*args, **kwargs)  # type: ignore[operator]

        setattr(backend, name, record)
    try:
        for step, seq in enumerate([256] * 8 + [64] * 6 + [256] * 6):
            train_step(model, opt, seq, seed=step)
    finally:
        h.close()
    return calls


def test_plans_are_those_the_inline_planner_makes() -> None:
    """The same calls, handed to the planner inline and on its thread (waited for after each), make the same plans
    in the same order: the move changes when a plan arrives, not which."""
    calls = _recorded_run()
    assert sum(1 for c in calls if c[0] == "send_stats") >= 15
    inline: list[Plan] = []
    threaded: list[Plan] = []
    a = EmbeddedBackend(inline.append)
    b = ThreadedBackend(threaded.append)
    try:
        for name, args, kwargs in calls:
            getattr(a, name)(*args, **kwargs)
            getattr(b, name)(*args, **kwargs)
            assert b.flush(10.0)
    finally:
        b.close(5.0)
    assert len(inline) >= 2, "the run changed plans: the comparison sees more than the first"
    assert [(p.version, p.modes, p.shape_plans, p.reason) for p in threaded] == [
        (p.version, p.modes, p.shape_plans, p.reason) for p in inline
    ]


def test_a_planner_behind_folds_steady_steps_and_bounds_its_queue() -> None:
    calls = _recorded_run()
    opened = next(args for name, args, _ in calls if name == "open")
    records = [args[0] for name, args, _ in calls if name == "send_stats"]
    assert all(isinstance(s, StepRecord) for s in records)
    stats = [s.stats() for s in records]
    plans: list[Plan] = []
    b = ThreadedBackend(plans.append)
    try:
        shapes = list(dict.fromkeys(s.shape for s in stats))
        assert len(shapes) == 2, shapes
        with introspect.planning_lock(b):  # the planner is busy: calls queue up
            b.open(*opened)
            steady = stats[-1]
            for k in range(50):
                b.send_stats(StepRecord.of(StepStats(**{**_fields(steady), "step": steady.step + 1 + k})))
            for k in range(MAX_QUEUED + 10):
                # Steps of alternating lengths are not steady: each is queued, and the oldest give way.
                shape = shapes[k % 2]
                step = StepStats(**{**_fields(steady), "step": steady.step + 100 + k, "shape": shape})
                b.send_stats(StepRecord.of(step))
            assert b.dropped > 0
            assert introspect.queued(b) <= MAX_QUEUED
        assert b.flush(30.0)
        assert b.folded >= 49, "a step like the one queued before it joins it"
        assert b.errors == 0
    finally:
        b.close(5.0)


def _fields(stats: StepStats) -> dict[str, object]:
    return {name: getattr(stats, name) for name in stats.__dataclass_fields__}


def test_the_clock_counts_rematd_code_and_not_what_it_calls() -> None:
    clock = ThreadClock()
    clock.take()
    clock.enter()
    clock.call(time.sleep, 0.05)  # the model's time
    clock.leave()
    assert clock.take() < 0.01
    clock.enter()
    time.sleep(0.03)  # rematd's own
    clock.call(time.sleep, 0.05)
    clock.leave()
    spent = clock.take()
    assert 0.03 <= spent < 0.045
    # A stretch of rematd's code inside the model's (a part's wrapper in a block's forward) counts itself once.
    clock.enter()

    def model_forward() -> None:
        clock.enter()
        time.sleep(0.02)
        clock.leave()

    clock.call(model_forward)
    clock.leave()
    assert 0.02 <= clock.take() < 0.035


def test_the_step_reports_rematd_time_on_the_training_thread() -> None:
    model = tiny_model(n_layer=4, d_model=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with client.attach(model, optimizer=opt, budget_bytes=3 * 2**20) as h:
        spent = []
        for step in range(8):
            began = time.perf_counter()
            train_step(model, opt, 64, seed=step)
            took = time.perf_counter() - began
            assert h.last_stats is not None
            spent.append(h.last_stats.thread_seconds)
            assert 0 < h.last_stats.thread_seconds < took + 0.05
    assert all(s > 0 for s in spent[2:])


def test_the_service_exports_the_training_thread_histogram(tmp_path: Path) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db"), metrics_cache_seconds=0))
    bound = svc.start()
    try:
        model = tiny_model(n_layer=2, d_model=32)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with client.attach(model, optimizer=opt, server=bound.grpc, job="thread-cost") as h:
            for step in range(5):
                train_step(model, opt, 64, seed=step)
            assert h.flush(10.0)
            text = httpx.get(f"http://{bound.http}/metrics", timeout=10).text
            count = next(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("rematd_training_thread_seconds_count")
            )
            assert count >= 4
            rank = httpx.get(f"http://{bound.http}/api/v1/jobs/thread-cost", timeout=10).json()
            assert rank["ranks"][0]["last_stats"]["thread_seconds"] > 0
    finally:
        svc.stop()


def test_a_steps_statistics_are_built_once_whichever_thread_asks_first() -> None:
    """The training thread leaves raw figures; the planner's thread and ``h.last_stats`` may ask at once, and get
    the same object (a caller tells a new step by identity)."""
    record = StepRecord(
        3,
        Shape(batch=2, seq_len=4, tokens=8),
        100,
        7,
        (5, 1, 2, 1000),
        (0.1, 1, ((2, 0.25), None), 0, 0.0, (), 1e-4, 0),
    )
    built: list[StepStats] = []
    threads = [threading.Thread(target=lambda: built.append(record.stats())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(built) == 8 and all(s is built[0] for s in built)
    stats = built[0]
    assert (stats.step, stats.saved_peak_bytes, stats.static_bytes, stats.budget_bytes) == (3, 5, 7, 100)
    ((stored,),) = (stats.mode_seconds,)
    assert (stored.mode, stored.blocks, stored.forward_seconds) == (Mode.STORE, 2, 0.25)
    assert record.memory().held_bytes == 1 and record.memory() is record.memory()
