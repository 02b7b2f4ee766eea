"""Prometheus metrics: base units in names, bounded labels, series removed when a job ends.

Per-job gauges are computed when Prometheus scrapes, from the live sessions
(a snapshot the core hands over), not updated on every message: a job of a
thousand ranks would otherwise pay for a thousand-rank aggregate per rank per
step. Counters and histograms are updated as things happen.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Message handling is sub-millisecond when healthy; the top buckets catch a stalled loop or database.
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
MESSAGE_KINDS = ("hello", "stats", "oom", "goodbye")
MAX_JOB_SERIES = 1000
"""Live jobs with per-job series unless --max-job-series says otherwise."""


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


# name, help, how a job's value comes from its ranks
_JOB_GAUGES: tuple[tuple[str, str], ...] = (
    ("rematd_peak_bytes", "Largest measured peak of the budgeted memory over a job's ranks, last step."),
    ("rematd_budget_bytes", "Memory budget of a job."),
    ("rematd_predicted_peak_bytes", "Predicted peak of the plan in force (largest over ranks)."),
    ("rematd_headroom_ratio", "(budget - measured peak) / budget for a job, last step."),
    ("rematd_checkpointed_blocks", "Blocks recomputed by the plan in force (largest over ranks)."),
    ("rematd_predicted_recompute_overhead_ratio", "Predicted recompute overhead of the plan in force."),
    ("rematd_oom_risk_ratio", "Out-of-memory risk of a job, 0-1 (largest over ranks)."),
    ("rematd_job_connected_ranks", "Ranks of a job with a live stream."),
    ("rematd_job_world_size", "Ranks a job trains with."),
)


class _LiveCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snapshot = self.metrics.snapshot
        samples = [*(snapshot() if snapshot is not None else []), *self.metrics.peer_samples()]
        jobs: dict[str, list[RankSample]] = {}
        for s in samples:
            jobs.setdefault(s.job, []).append(s)
        exported = self.metrics.choose_jobs(jobs)
        dropped = GaugeMetricFamily(
            "rematd_job_series_dropped", "Live jobs whose per-job series are left out (over --max-job-series)."
        )
        dropped.add_metric([], len(jobs) - len(exported))
        yield dropped
        fams = {name: GaugeMetricFamily(name, doc, labels=["job"]) for name, doc in _JOB_GAUGES}
        for job, ranks in sorted((job, jobs[job]) for job in exported):
            measured = [r for r in ranks if r.has_stats]
            budget = min(r.budget_bytes for r in ranks)
            fams["rematd_budget_bytes"].add_metric([job], budget)
            fams["rematd_job_world_size"].add_metric([job], max(r.world_size for r in ranks))
            fams["rematd_job_connected_ranks"].add_metric([job], sum(r.connected for r in ranks))
            fams["rematd_predicted_peak_bytes"].add_metric([job], max(r.predicted_peak_bytes for r in ranks))
            fams["rematd_checkpointed_blocks"].add_metric([job], max(r.checkpointed_blocks for r in ranks))
            fams["rematd_predicted_recompute_overhead_ratio"].add_metric(
                [job], max(r.predicted_overhead_ratio for r in ranks)
            )
            if measured:
                peak = max(r.peak_bytes for r in measured)
                fams["rematd_peak_bytes"].add_metric([job], peak)
                fams["rematd_headroom_ratio"].add_metric([job], (budget - peak) / budget if budget else 0.0)
                fams["rematd_oom_risk_ratio"].add_metric([job], max(r.oom_risk for r in measured))
        yield from fams.values()
        if self.metrics.per_rank:
            peak_fam = GaugeMetricFamily(
                "rematd_rank_peak_bytes",
                "Measured peak of one rank, last step (--per-rank-metrics).",
                labels=["job", "rank"],
            )
            risk_fam = GaugeMetricFamily(
                "rematd_rank_oom_risk_ratio", "Out-of-memory risk of one rank, 0-1 (--per-rank-metrics).",
                labels=["job", "rank"],
            )  # fmt: skip
            for s in samples:
                if s.has_stats and s.job in exported:
                    peak_fam.add_metric([s.job, str(s.rank)], s.peak_bytes)
                    risk_fam.add_metric([s.job, str(s.rank)], s.oom_risk)
            yield peak_fam
            yield risk_fam


class _Summed(Collector):
    """Counts kept by this process, plus those other worker processes published."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        peers = self.metrics.peer_counts()
        for name, (metric, kind) in self.metrics.summed.items():
            values = dict(_values(metric))
            for counts in peers:
                for key, value in counts.get(name, {}).items():
                    values[key] = values.get(key, 0.0) + value
            labels = list(metric._labelnames)
            family: CounterMetricFamily | GaugeMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(name, metric._documentation, labels=labels)
            else:
                family = GaugeMetricFamily(name, metric._documentation, labels=labels)
            by_job = labels == ["job"] and self.metrics.exported is not None
            for key, value in sorted(values.items()):
                label_values = json.loads(key)
                if by_job and self.metrics.exported is not None and label_values[0] not in self.metrics.exported:
                    continue
                family.add_metric(label_values, value)
            yield family


def _values(metric: Counter | Gauge) -> Iterator[tuple[str, float]]:
    """(labels as a JSON list, value) of each series of an unregistered counter or gauge."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            yield json.dumps([sample.labels[n] for n in metric._labelnames]), sample.value


class Metrics:
    """All of rematd's series, on a registry of their own."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, per_rank: bool = False, max_jobs: int = MAX_JOB_SERIES
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.per_rank = per_rank
        """Export per-rank series too (labels job and rank): opt-in, a large job has thousands of ranks."""
        self.max_jobs = max_jobs
        """Live jobs with per-job series, at most: 10,000 jobs made a 10 MiB scrape of 120,000 series."""
        self.exported: set[str] | None = None
        """The jobs the last scrape gave series, when it left some out (None: every live job's)."""
        self.snapshot: Callable[[], list[RankSample]] | None = None
        """Set by the core: the live ranks, read at scrape time."""
        self.peers: Callable[[], list[dict[str, Any]]] | None = None
        """Set in the worker that serves HTTP when others share the port: what they published."""
        r = self.registry
        # process_open_fds / process_max_fds and friends, for the file-descriptor alert.
        ProcessCollector(registry=r)
        r.register(_LiveCollector(self))
        # Counted here and added to what other workers count: exported by _Summed, not registered.
        self.plans_issued = Counter("rematd_plans_issued", "Plans sent to training ranks.", ["job"], registry=None)
        self.oom_events = Counter("rematd_oom_events", "Out-of-memory events reported.", ["job"], registry=None)
        self.steps = Counter("rematd_steps", "Training steps reported.", ["job"], registry=None)
        self.exploration_steps = Counter(
            "rematd_exploration_steps",
            "Training steps that ran a trial of a mode not yet measured at their length.",
            ["job"],
            registry=None,
        )
        self.recompiles = Counter(
            "rematd_recompiles", "Graphs compiled for the blocks' variants (attach(..., compile=True)).", ["job"],
            registry=None,
        )  # fmt: skip
        self.active_streams = Gauge("rematd_active_streams", "Training ranks connected now.", registry=None)
        self.invalid_messages = Counter("rematd_invalid_messages", "Messages refused as invalid.", registry=None)
        self.rejected_rows = Counter(
            "rematd_record_rejected_rows", "Buffered statistics rows the record refused, set aside.", registry=None
        )
        self.record_write_failures = Counter(
            "rematd_record_write_failures",
            "Writes to the record that failed (a full or failing disk, a lost database); see /readyz.",
            registry=None,
        )
        self.oom_dropped = Counter(
            "rematd_oom_events_dropped",
            "OOM events a rank reported faster than its rate (a burst of 10, then 1 a second), dropped.",
            registry=None,
        )
        self.record_lost = Gauge(
            "rematd_record_lost",
            "1 while the record's database file is deleted, replaced or truncated under the service (writes stop).",
            registry=r,
        )
        self.message_duration = Histogram(
            "rematd_message_duration_seconds",
            "Time to handle one message from a training rank, by kind of message.",
            ["kind"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        for kind in MESSAGE_KINDS:
            self.message_duration.labels(kind)
        self.plan_duration = Histogram(
            "rematd_plan_duration_seconds",
            "Time the planner takes to decide on one step's statistics.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.unauthenticated = Counter(
            "rematd_unauthenticated_requests", "Requests refused for a missing or wrong token.", ["transport"],
            registry=None,
        )  # fmt: skip
        self.service_faults = Counter(
            "rematd_service_faults",
            "Messages the service failed to handle through a fault of its own (answered INTERNAL), by kind.",
            ["kind"],
            registry=None,
        )
        for kind in ("hello", "stats", "oom", "goodbye"):
            self.service_faults.labels(kind)  # present at 0, so that a rate over it is defined from the start
        self.summed: dict[str, tuple[Counter | Gauge, str]] = {
            "rematd_plans_issued": (self.plans_issued, "counter"),
            "rematd_oom_events": (self.oom_events, "counter"),
            "rematd_steps": (self.steps, "counter"),
            "rematd_exploration_steps": (self.exploration_steps, "counter"),
            "rematd_recompiles": (self.recompiles, "counter"),
            "rematd_invalid_messages": (self.invalid_messages, "counter"),
            "rematd_record_rejected_rows": (self.rejected_rows, "counter"),
            "rematd_record_write_failures": (self.record_write_failures, "counter"),
            "rematd_oom_events_dropped": (self.oom_dropped, "counter"),
            "rematd_unauthenticated_requests": (self.unauthenticated, "counter"),
            "rematd_service_faults": (self.service_faults, "counter"),
            "rematd_active_streams": (self.active_streams, "gauge"),
        }
        r.register(_Summed(self))
        self._per_job = (self.plans_issued, self.oom_events, self.steps, self.exploration_steps, self.recompiles)

    def choose_jobs(self, jobs: dict[str, list[RankSample]]) -> set[str]:
        """The live jobs that get series: all up to ``max_jobs``, else those most at risk of running out of
        memory (then by name)."""
        if len(jobs) <= self.max_jobs:
            self.exported = None
            return set(jobs)
        ranked = sorted(jobs, key=lambda j: (-max(r.oom_risk for r in jobs[j]), j))
        self.exported = set(ranked[: self.max_jobs])
        return self.exported

    def local_counts(self) -> dict[str, dict[str, float]]:
        """This process's counts, by metric and labels (a JSON list), for the worker serving HTTP."""
        return {name: dict(_values(metric)) for name, (metric, _) in self.summed.items()}

    def _peer_states(self) -> list[dict[str, Any]]:
        return self.peers() if self.peers is not None else []

    def peer_counts(self) -> list[dict[str, dict[str, float]]]:
        return [state.get("counts", {}) for state in self._peer_states()]

    def peer_samples(self) -> list[RankSample]:
        return [RankSample(**s) for state in self._peer_states() for s in state.get("samples", ())]

    def forget_job(self, job: str) -> None:
        """Remove a job's counters; its gauges go with its sessions."""
        for metric in self._per_job:
            with contextlib.suppress(KeyError):
                metric.remove(job)
