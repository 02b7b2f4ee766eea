"""rematd's Prometheus series: base units in names, bounded labels, series removed when a job ends.

Counters and histograms are updated as things happen; the per-job gauges are computed at scrape time
(``rematd.server.metrics.live``). Counts that several worker processes keep are added together at
scrape time (``rematd.server.metrics.peers`` says why this is not prometheus_client's multiprocess
mode).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rematd.server.metrics.live import LiveGauges, RankSample

__all__ = ["MAX_JOB_SERIES", "MESSAGE_KINDS", "Metrics", "RankSample"]

# Message handling is sub-millisecond when healthy; the top buckets catch a stalled loop or database.
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
MESSAGE_KINDS = ("hello", "stats", "oom", "goodbye")
MAX_JOB_SERIES = 1000
"""Live jobs with per-job series unless --max-job-series says otherwise."""


class Metrics:
    """All of rematd's series, on a registry of their own."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, per_rank: bool = False, max_jobs: int = MAX_JOB_SERIES
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.max_jobs = max_jobs
        """Live jobs with per-job series, at most: 10,000 jobs made a 10 MiB scrape of 120,000 series."""
        self.exported: set[str] | None = None
        """The jobs the last scrape gave series, when it left some out (None: every live job's)."""
        self.snapshot: Callable[[], list[RankSample]] | None = None
        """Set by the core: the live ranks, read at scrape time."""
        self.peers: Callable[[], list[dict[str, Any]]] | None = None
        """Set in the worker that serves HTTP when others share the port: what they published."""
        self.summed: dict[str, Counter | Gauge] = {}
        """Series every worker keeps, added together at scrape time (exported by ``_Summed``)."""
        # process_open_fds / process_max_fds and friends, for the file-descriptor alert.
        ProcessCollector(registry=self.registry)
        self.registry.register(LiveGauges(self._live_samples, self.choose_jobs, per_rank=per_rank))
        self._count_messages()
        self._count_store()
        self._time()
        self.registry.register(_Summed(self))

    def _count_messages(self) -> None:
        per_job = ["job"]
        self.plans_issued = self._summed_counter("rematd_plans_issued", "Plans sent to training ranks.", per_job)
        self.oom_events = self._summed_counter("rematd_oom_events", "Out-of-memory events reported.", per_job)
        self.steps = self._summed_counter("rematd_steps", "Training steps reported.", per_job)
        self.exploration_steps = self._summed_counter(
            "rematd_exploration_steps", "Training steps that ran a trial of a mode not yet measured at their length.",
            per_job,
        )  # fmt: skip
        self.recompiles = self._summed_counter(
            "rematd_recompiles", "Graphs compiled for the blocks' variants (attach(..., compile=True)).", per_job
        )
        self._per_job = (self.plans_issued, self.oom_events, self.steps, self.exploration_steps, self.recompiles)
        self.active_streams = Gauge("rematd_active_streams", "Training ranks connected now.", registry=None)
        self.summed["rematd_active_streams"] = self.active_streams
        self.invalid_messages = self._summed_counter("rematd_invalid_messages", "Messages refused as invalid.")
        self.oom_dropped = self._summed_counter(
            "rematd_oom_events_dropped",
            "OOM events a rank reported faster than its rate (a burst of 10, then 1 a second), dropped.",
        )
        self.unauthenticated = self._summed_counter(
            "rematd_unauthenticated_requests", "Requests refused for a missing or wrong token.", ["transport"]
        )
        self.service_faults = self._summed_counter(
            "rematd_service_faults",
            "Messages the service failed to handle through a fault of its own (answered INTERNAL), by kind.",
            ["kind"],
        )
        for kind in MESSAGE_KINDS:
            self.service_faults.labels(kind)  # present at 0, so that a rate over it is defined from the start

    def _count_store(self) -> None:
        self.rejected_rows = self._summed_counter(
            "rematd_store_rejected_rows", "Buffered statistics rows the store refused, set aside."
        )
        self.store_write_failures = self._summed_counter(
            "rematd_store_write_failures",
            "Writes to the store that failed (a full or failing disk, a lost database); see /readyz.",
        )
        self.store_lost = Gauge(
            "rematd_store_lost",
            "1 while the store's database file is deleted, replaced or truncated under the service (writes stop).",
            registry=self.registry,
        )

    def _time(self) -> None:
        self.message_duration = Histogram(
            "rematd_message_duration_seconds",
            "Time to handle one message from a training rank, by kind of message.",
            ["kind"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        for kind in MESSAGE_KINDS:
            self.message_duration.labels(kind)
        self.plan_duration = Histogram(
            "rematd_plan_duration_seconds",
            "Time the planner takes to decide on one step's statistics.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def _summed_counter(self, name: str, doc: str, labels: list[str] | None = None) -> Counter:
        """A counter this process keeps, exported added to what other workers count (so not registered)."""
        counter = Counter(name, doc, labels or [], registry=None)
        self.summed[name] = counter
        return counter

    def _live_samples(self) -> list[RankSample]:
        return [*(self.snapshot() if self.snapshot is not None else []), *self.peer_samples()]

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
        return {name: dict(_values(metric)) for name, metric in self.summed.items()}

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


class _Summed(Collector):
    """Counts kept by this process, plus those other worker processes published."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        peers = self.metrics.peer_counts()
        exported = self.metrics.exported
        for name, metric in self.metrics.summed.items():
            values = dict(_values(metric))
            for counts in peers:
                for key, value in counts.get(name, {}).items():
                    values[key] = values.get(key, 0.0) + value
            labels = list(metric._labelnames)
            family_of = CounterMetricFamily if isinstance(metric, Counter) else GaugeMetricFamily
            family = family_of(name, metric._documentation, labels=labels)
            by_job = labels == ["job"] and exported is not None
            for key, value in sorted(values.items()):
                label_values = json.loads(key)
                if not by_job or exported is None or label_values[0] in exported:
                    family.add_metric(label_values, value)
            yield family


def _values(metric: Counter | Gauge) -> Iterator[tuple[str, float]]:
    """(labels as a JSON list, value) of each series of an unregistered counter or gauge."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            yield json.dumps([sample.labels[n] for n in metric._labelnames]), sample.value
