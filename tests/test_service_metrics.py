"""Prometheus series: names alerts rely on, latency histograms, opt-in per-rank series, removal at job end."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rematd.server.core.advisor import AdvisorCore
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store

from .test_service import hello, stats

ALERTED = {
    "rematd_peak_bytes",
    "rematd_budget_bytes",
    "rematd_predicted_peak_bytes",
    "rematd_headroom_ratio",
    "rematd_checkpointed_blocks",
    "rematd_predicted_recompute_overhead_ratio",
    "rematd_oom_risk_ratio",
    "rematd_job_connected_ranks",
    "rematd_job_world_size",
    "rematd_plans_issued_total",
    "rematd_oom_events_total",
    "rematd_steps_total",
    "rematd_active_streams",
}


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def names(m: Metrics) -> set[str]:
    return {name for name, _ in samples(m)}


def run_job(tmp: Path, metrics: Metrics) -> AdvisorCore:
    core = AdvisorCore(Store(tmp / "r.db"), metrics)
    sessions = [core.open_session(hello(job="m", rank=r))[0] for r in (0, 1)]
    for step in range(3):
        for s in sessions:
            core.on_stats(s, stats(step, 9500 if step == 1 else 500, seq=128 if step == 1 else 64))
    return core


def test_alerted_names_and_latency_histograms(tmp_path: Path) -> None:
    m = Metrics()
    core = run_job(tmp_path, m)
    got = names(m)
    assert got >= ALERTED, ALERTED - got
    assert "rematd_invalid_messages_total" in got and "process_cpu_seconds_total" in got
    s = samples(m)
    assert s[("rematd_plan_duration_seconds_count", ())] == 6
    assert ("rematd_message_duration_seconds_bucket", (("kind", "stats"), ("le", "+Inf"))) in s
    assert s[("rematd_job_connected_ranks", (("job", "m"),))] == 2
    assert not any(n.startswith("rematd_rank_") for n in got), "per-rank series are opt-in"
    # Every label is bounded: job, rank when asked for, kind, outcome, transport, and the histogram's le.
    assert {k for _, labels in s for k, _ in labels} <= {"job", "kind", "le", "outcome", "transport", "rank"}
    for sess in list(core.sessions.by_job["m"].values()):
        core.close_session(sess, ended=True)
    assert not any(dict(labels).get("job") == "m" for _, labels in samples(m)), "an ended job's series go"


def test_per_rank_series_are_opt_in_and_go_with_the_job(tmp_path: Path) -> None:
    m = Metrics(per_rank=True)
    core = run_job(tmp_path, m)
    s = samples(m)
    assert s[("rematd_rank_peak_bytes", (("job", "m"), ("rank", "1")))] == 500
    assert ("rematd_rank_oom_risk_ratio", (("job", "m"), ("rank", "0"))) in s
    core.end_job("m")
    assert not any(n.startswith("rematd_rank_") and dict(lb).get("job") == "m" for n, lb in samples(m))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is absent")
def test_promtool_accepts_the_exposition(tmp_path: Path) -> None:
    m = Metrics(per_rank=True)
    run_job(tmp_path, m)
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=generate_latest(m.registry), capture_output=True, timeout=30
    )
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
