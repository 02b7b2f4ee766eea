"""The per-job gauges, computed when Prometheus scrapes from the live ranks (a snapshot the core hands
over), not updated on every message: a job of a thousand ranks would otherwise pay for a thousand-rank
aggregate per rank per step. Headroom and OOM risk come from ``rematd.server.figures``, as the
dashboard's do."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rematd.server.figures import headroom_ratio, job_oom_risk, job_peak


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSample:
    """What the gauges need from one live rank."""

    job: str
    rank: int
    connected: bool
    world_size: int
    budget_bytes: int
    peak_bytes: int
    has_stats: bool
    predicted_peak_bytes: int
    checkpointed_blocks: int
    predicted_overhead_ratio: float
    oom_risk: float


JOB_GAUGES: dict[str, str] = {
    "rematd_peak_bytes": "Largest measured peak of the budgeted memory over a job's ranks, last step.",
    "rematd_budget_bytes": "Memory budget of a job.",
    "rematd_predicted_peak_bytes": "Predicted peak of what the last step ran (largest over ranks).",
    "rematd_headroom_ratio": "(budget - measured peak) / budget for a job, last step.",
    "rematd_checkpointed_blocks": "Blocks the last step did not store (largest over ranks).",
    "rematd_predicted_recompute_overhead_ratio": "Predicted recompute overhead of what the last step ran.",
    "rematd_oom_risk_ratio": "Out-of-memory risk of a job, 0-1 (largest over ranks).",
    "rematd_job_connected_ranks": "Ranks of a job with a live stream.",
    "rematd_job_world_size": "Ranks a job trains with.",
}


def job_values(ranks: Sequence[RankSample]) -> dict[str, float]:
    """One job's gauges from its live ranks; those that need a measured step are left out before one."""
    measured = [r for r in ranks if r.has_stats]
    budget = min(r.budget_bytes for r in ranks)
    values: dict[str, float | None] = {
        "rematd_budget_bytes": budget,
        "rematd_job_world_size": max(r.world_size for r in ranks),
        "rematd_job_connected_ranks": sum(r.connected for r in ranks),
        "rematd_predicted_peak_bytes": max(r.predicted_peak_bytes for r in ranks),
        "rematd_checkpointed_blocks": max(r.checkpointed_blocks for r in ranks),
        "rematd_predicted_recompute_overhead_ratio": max(r.predicted_overhead_ratio for r in ranks),
    }
    if measured:
        peak = job_peak(r.peak_bytes for r in measured)
        values["rematd_peak_bytes"] = peak
        values["rematd_headroom_ratio"] = headroom_ratio(budget, peak)
        values["rematd_oom_risk_ratio"] = job_oom_risk(r.oom_risk for r in measured)
    return {name: value for name, value in values.items() if value is not None}


class LiveGauges(Collector):
    """The per-job gauges (and, opt-in, per-rank ones) of the ranks ``samples`` returns at scrape time;
    ``choose`` picks the jobs that get series."""

    def __init__(
        self,
        samples: Callable[[], list[RankSample]],
        choose: Callable[[dict[str, list[RankSample]]], set[str]],
        *,
        per_rank: bool,
    ) -> None:
        self.samples = samples
        self.choose = choose
        self.per_rank = per_rank

    def collect(self) -> Iterator[GaugeMetricFamily]:
        samples = self.samples()
        jobs: dict[str, list[RankSample]] = {}
        for s in samples:
            jobs.setdefault(s.job, []).append(s)
        exported = self.choose(jobs)
        dropped = GaugeMetricFamily(
            "rematd_job_series_dropped", "Live jobs whose per-job series are left out (over --max-job-series)."
        )
        dropped.add_metric([], len(jobs) - len(exported))
        yield dropped
        families = {name: GaugeMetricFamily(name, doc, labels=["job"]) for name, doc in JOB_GAUGES.items()}
        for job in sorted(exported):
            for name, value in job_values(jobs[job]).items():
                families[name].add_metric([job], value)
        yield from families.values()
        if self.per_rank:
            yield from _per_rank([s for s in samples if s.has_stats and s.job in exported])


def _per_rank(samples: list[RankSample]) -> Iterator[GaugeMetricFamily]:
    peak = GaugeMetricFamily(
        "rematd_rank_peak_bytes", "Measured peak of one rank, last step (--per-rank-metrics).", labels=["job", "rank"]
    )
    risk = GaugeMetricFamily(
        "rematd_rank_oom_risk_ratio", "Out-of-memory risk of one rank, 0-1 (--per-rank-metrics).",
        labels=["job", "rank"],
    )  # fmt: skip
    for s in samples:
        peak.add_metric([s.job, str(s.rank)], s.peak_bytes)
        risk.add_metric([s.job, str(s.rank)], s.oom_risk)
    yield peak
    yield risk
