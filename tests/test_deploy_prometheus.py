"""A real Prometheus scrapes a real ``rematd serve`` while real CPU training streams to it.

Prometheus runs with the shipped scrape job (deploy/prometheus/prometheus.yml) and the shipped
rule files, at a 1 s scrape and evaluation interval. A job trained under a budget far below what
even full recomputation needs has a real out-of-memory risk of 1, so RematdOomRiskHigh must go
pending for it; when the job ends cleanly its series go and the alert with them.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.served import stop
from rematd import client

from .deploy_helpers import DEPLOY, RULES, alert_names, binary, free_port, load_yaml
from .helpers import live_server, tiny_model, train_step

JOB = "prom-oom-risk"
# The CPU budget caps bytes saved for backward; 64 KiB is below what even recomputing every
# block of the tiny model keeps, so the measured peak passes the budget and the risk is 1.
BUDGET_BYTES = 64 * 1024
DEADLINE_S = 45.0
STEPS = 4
T = TypeVar("T")


def prometheus_config(rematd_http: str) -> dict[str, Any]:
    """The shipped configuration, pointed at the live service, with 1 s intervals."""
    shipped = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {j["job_name"]: j for j in shipped["scrape_configs"]}
    assert "rematd" in jobs, "the alerts select up{job='rematd'}: the scrape job must be named rematd"
    scrape = dict(jobs["rematd"])
    scrape["static_configs"] = [{"targets": [rematd_http]}]
    scrape["scrape_interval"] = "1s"
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULES],
        "scrape_configs": [scrape],
    }


@contextmanager
def prometheus(config: dict[str, Any], tmp: Path) -> Iterator[str]:
    """A real Prometheus on a free loopback port; yields its base URL once it is ready."""
    exe = binary("prometheus")
    config_file = tmp / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
    log = (tmp / "prometheus.log").open("w", encoding="utf-8")
    port = free_port()
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, "prometheus exited:\n" + (tmp / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready:\n" + (tmp / "prometheus.log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)
        log.close()


def wait_for(what: str, probe: Callable[[], T | None], deadline: float) -> T:
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def query(url: str, promql: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5).json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def alerts(url: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{url}/api/v1/alerts", timeout=5).json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["alerts"]
    return result


def risk_alerts(url: str) -> list[dict[str, Any]]:
    return [
        a for a in alerts(url) if a["labels"]["alertname"] == "RematdOomRiskHigh" and a["labels"]["exported_job"] == JOB
    ]


def scraped_risk(http: str) -> float:
    text = httpx.get(f"http://{http}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "rematd_oom_risk_ratio" and s.labels.get("job") == JOB:
                return float(s.value)
    raise AssertionError(f"rematd_oom_risk_ratio for {JOB} not exported")


@pytest.mark.timeout(90)
def test_prometheus_scrapes_rematd_and_the_oom_risk_alert_goes_pending(tmp_path: Path) -> None:
    start = time.monotonic()
    deadline = start + DEADLINE_S
    with live_server(tmp_path) as srv, prometheus(prometheus_config(srv.http), tmp_path) as prom:
        model = tiny_model(n_layer=4, d_model=32, seed=5)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=srv.grpc, job=JOB, budget_bytes=BUDGET_BYTES, optimizer=opt)
        try:
            for step in range(STEPS):
                train_step(model, opt, 64, seed=step)
                assert h.flush(20.0), "the service did not answer in time"
            assert h.plan.blocks, "under this budget the planner recomputes blocks"
            risk = scraped_risk(srv.http)
            assert risk > 0.8, f"the budget is far below the peak, yet the service rates the risk {risk}"

            # The job's series, as Prometheus stored them (once a scrape after the last step landed):
            # the target's job label, and the training job's name as exported_job.
            def scraped_all_steps() -> list[dict[str, Any]]:
                got = query(prom, f'rematd_steps_total{{exported_job="{JOB}"}}')
                return got if got and float(got[0]["value"][1]) == STEPS else []

            wait_for("every step in Prometheus", scraped_all_steps, deadline)
            series = query(prom, f'rematd_oom_risk_ratio{{exported_job="{JOB}"}}')
            assert len(series) == 1 and series[0]["metric"]["job"] == "rematd"
            assert float(series[0]["value"][1]) == pytest.approx(risk)
            for name, expected in [("rematd_job_world_size", 1), ("rematd_job_connected_ranks", 1)]:
                got = query(prom, f'{name}{{exported_job="{JOB}"}}')
                assert [float(s["value"][1]) for s in got] == [expected], (name, got)
            budget = query(prom, f'rematd_budget_bytes{{exported_job="{JOB}"}}')
            assert float(budget[0]["value"][1]) == BUDGET_BYTES
            assert [float(s["value"][1]) for s in query(prom, 'up{job="rematd"}')] == [1]
            fds = query(prom, 'process_open_fds{job="rematd"} / process_max_fds{job="rematd"}')
            assert len(fds) == 1 and 0 < float(fds[0]["value"][1]) < 0.8

            pending = wait_for("RematdOomRiskHigh to go pending", lambda: risk_alerts(prom), deadline)
            assert [a["state"] for a in pending] == ["pending"], "for: 2m keeps it pending within this test"
            assert pending[0]["labels"]["severity"] == "warning"
            assert JOB in pending[0]["annotations"]["summary"]

            # Every shipped rule is loaded and evaluates against real series without error.
            def evaluated() -> list[dict[str, Any]] | None:
                groups = httpx.get(f"{prom}/api/v1/rules", timeout=5).json()["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
                return rules if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules) else None

            rules = wait_for("every rule evaluated", evaluated, deadline)
            assert sorted(r["name"] for r in rules if r["type"] == "alerting") == sorted(alert_names())
            assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
            active = alerts(prom)
            # absent(up) holds until the first scrape: that start-up blip may still be pending, never firing.
            startup = [a for a in active if a["labels"]["alertname"] == "RematdTargetMissing"]
            assert all(a["state"] == "pending" for a in startup), startup
            firing_or_pending = {a["labels"]["alertname"] for a in active} - {"RematdTargetMissing"}
            assert firing_or_pending == {"RematdOomRiskHigh"}, f"no other alert has cause here: {active}"
        finally:
            h.close()

        # A clean end removes the job's series; the alert goes with them.
        wait_for("the alert to clear after the job ended", lambda: not risk_alerts(prom) or None, deadline)
        assert query(prom, f'rematd_oom_risk_ratio{{exported_job="{JOB}"}}') == []
    assert time.monotonic() - start < 60
