"""Many jobs: every list is paged, /metrics carries per-job series for a bounded number of live jobs, is
rendered off the event loop, and can require the token (a real service on loopback)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.registry import Collector

from rematd.planner import Shape
from rematd.planner.messages import OomReport
from rematd.server import ServeConfig, ServiceThread

from .test_service import hello, stats

TOKEN = "scale-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
JOBS = 12


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceThread]:
    db = tmp_path_factory.mktemp("scale") / "r.db"
    svc = ServiceThread(
        ServeConfig(grpc_port=0, http_port=0, db=str(db), token=TOKEN, max_job_series=5, metrics_need_token=True)
    )
    svc.start()
    core = svc.service.core
    for j in range(JOBS):
        session, _ = core.open_session(hello(job=f"job-{j:02d}"))
        core.on_stats(session, stats(0, 3000 + 500 * j))  # later jobs nearer their budget: more at risk
    busy = core.sessions.by_key.get(("job-00", 0))
    assert busy is not None
    for step in range(7):
        core.on_oom(busy, OomReport(step=step, shape=Shape(batch=1, seq_len=64, tokens=64), plan_version=0))
    core.drain_writes(10)
    yield svc
    svc.stop()


def _get(svc: ServiceThread, path: str, **params: Any) -> httpx.Response:
    assert svc.service.bound is not None
    return httpx.get(f"http://{svc.service.bound.http}{path}", params=params, headers=AUTH, timeout=20)


def _pages(svc: ServiceThread, path: str, key: str, limit: int) -> list[list[Any]]:
    pages, cursor = [], None
    while True:
        body = _get(svc, path, limit=limit, **({"cursor": cursor} if cursor else {})).json()
        pages.append(body[key])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages
        assert len(pages) < 50


def test_jobs_are_paged_in_creation_order_without_gaps_or_repeats(service: ServiceThread) -> None:
    pages = _pages(service, "/api/v1/jobs", "jobs", 5)
    assert [len(p) for p in pages] == [5, 5, 2]
    assert [j["job"] for p in pages for j in p] == [f"job-{j:02d}" for j in range(JOBS)]
    assert len(_get(service, "/api/v1/jobs").json()["jobs"]) == JOBS  # one default page
    assert _get(service, "/api/v1/jobs", limit=100_000).status_code == 422


def test_ooms_and_plans_are_paged(service: ServiceThread) -> None:
    pages = _pages(service, "/api/v1/jobs/job-00/ooms", "ooms", 3)
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [o["step"] for p in pages for o in p] == list(range(7))
    plans = [p["version"] for page in _pages(service, "/api/v1/jobs/job-00/plans", "plans", 1) for p in page]
    assert plans == sorted(plans) and len(plans) == len(set(plans)) >= 2


@pytest.mark.parametrize("cursor", ["not-a-cursor", "W10", "!!"])
def test_a_cursor_the_list_did_not_give_is_422_naming_it(service: ServiceThread, cursor: str) -> None:
    r = _get(service, "/api/v1/jobs/job-00/ooms", cursor=cursor)
    assert r.status_code == 422 and r.json()["field"] == "cursor"


def _jobs_of(text: str, series: str) -> set[str]:
    return {line.split('job="')[1].split('"')[0] for line in text.splitlines() if line.startswith(series)}


def test_metrics_carry_a_bounded_number_of_jobs_most_at_risk_first(service: ServiceThread) -> None:
    text = _get(service, "/metrics").text
    jobs = {
        line.split('job="')[1].split('"')[0] for line in text.splitlines() if line.startswith("rematd_budget_bytes{")
    }
    assert len(jobs) == 5
    steps = {
        line.split('job="')[1].split('"')[0] for line in text.splitlines() if line.startswith("rematd_steps_total{")
    }
    assert steps == jobs  # counters follow the same jobs
    assert "rematd_job_series_dropped 7.0" in text
    risks = {
        line.split('job="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("rematd_oom_risk_ratio{")
    }
    left_out = min(risks.values())
    assert all(s.oom_risk <= left_out for s in service.service.core.rank_samples() if s.job not in jobs)


def test_metrics_need_the_token_when_told_to(service: ServiceThread) -> None:
    assert service.service.bound is not None
    r = httpx.get(f"http://{service.service.bound.http}/metrics", timeout=10)
    assert r.status_code == 401


def test_metrics_are_rendered_off_the_event_loop(service: ServiceThread) -> None:
    seen: list[str] = []

    class Where(Collector):
        def collect(self) -> Iterator[Any]:
            seen.append(threading.current_thread().name)
            return iter(())

    registry = service.service.core.metrics.registry
    where = Where()
    registry.register(where)
    try:
        # A scrape within --metrics-cache-seconds of the last render is served that render: scrape until one renders.
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            assert _get(service, "/metrics").status_code == 200
            time.sleep(0.1)
    finally:
        registry.unregister(where)
    assert seen and seen[0] != "rematd-service"  # the thread that runs the service's event loop


def test_concurrent_scrapes_of_a_thousand_jobs_share_one_render_and_health_answers(tmp_path: Path) -> None:
    svc = ServiceThread(ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "m.db"), metrics_cache_seconds=5.0))
    svc.start()
    try:
        core = svc.service.core
        for j in range(1000):
            core.open_session(hello(job=f"scraped-{j:04d}"))
        assert svc.service.bound is not None
        base = f"http://{svc.service.bound.http}"
        bodies: list[bytes] = []
        health: list[int] = []
        go = threading.Barrier(17)

        def scrape() -> None:
            go.wait(10)
            r = httpx.get(f"{base}/metrics", timeout=60, headers={"accept-encoding": "identity"})
            bodies.append(r.content)

        def probe() -> None:
            go.wait(10)
            for _ in range(10):
                health.append(httpx.get(f"{base}/healthz", timeout=60).status_code)

        threads = [threading.Thread(target=scrape) for _ in range(16)] + [threading.Thread(target=probe)]
        renders = core.metrics.scrape.renders
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(bodies) == 16 and health == [200] * 10
        # 16 scrapes at once: one render (two if the first began before the last scrape's own read of the clock).
        assert core.metrics.scrape.renders - renders <= 2
        assert all(b'rematd_job_connected_ranks{job="scraped-0999"} 1.0' in b for b in bodies)
        # What Prometheus asks for: the same body, gzipped in the same render.
        r = httpx.get(f"{base}/metrics", timeout=60, headers={"accept-encoding": "gzip"})
        assert r.headers["content-encoding"] == "gzip" and r.content in bodies
    finally:
        svc.stop()
