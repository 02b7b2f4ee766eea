"""rematd's Prometheus series: base units in names, bounded labels, series removed when a job ends.

Counters and histograms are updated as things happen; the per-job gauges are computed at scrape time
(``rematd.server.metrics.live``). With several worker processes, counters, gauges and histograms are
prometheus_client's multiprocess files, added up at scrape time, and the per-job gauges come from the
live ranks every worker publishes (``rematd.server.metrics.peers`` says why both).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from rematd.planner.plan_trials import OUTCOMES
from rematd.server.metrics.live import LiveGauges, RankSample
from rematd.server.metrics.peers import MULTIPROC_ENV
from rematd.server.metrics.scrape import DEFAULT_SECONDS, Scrape

__all__ = ["MAX_JOB_SERIES", "MESSAGE_KINDS", "Metrics", "RankSample"]

# Message handling is sub-millisecond when healthy; the top buckets catch a stalled loop or database.
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
# rematd's share of a step: tens of microseconds when healthy, the top buckets a step it stalled.
_THREAD_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01, 0.05, 0.25, 1.0)
MESSAGE_KINDS = ("hello", "stats", "oom", "goodbye")
MAX_JOB_SERIES = 1000
"""Live jobs with per-job series unless --max-job-series says otherwise."""


class Metrics:
    """All of rematd's series: ``registry`` is what ``/metrics`` renders.

    ``multiprocess_dir`` (the workers of ``--workers``): this process's counters, gauges and histograms go
    to prometheus_client's files there, and ``registry`` adds up every worker's, dead ones included.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        per_rank: bool = False,
        max_jobs: int = MAX_JOB_SERIES,
        multiprocess_dir: Path | None = None,
        cache_seconds: float = DEFAULT_SECONDS,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.max_jobs = max_jobs
        """Live jobs with per-job series, at most: 10,000 jobs made a 10 MiB scrape of 120,000 series."""
        self.exported: set[str] = set()
        """The jobs the last scrape gave series."""
        self.snapshot: Callable[[], list[RankSample]] | None = None
        """Set by the core: the live ranks, read at scrape time."""
        self.peers: Callable[[], list[RankSample]] | None = None
        """Set in the worker that serves HTTP when others share the port: what they published."""
        # Where this process's series live: its own registry, or (several workers) unregistered, in files.
        self._own: CollectorRegistry | None = None
        source: Collector
        if multiprocess_dir is None:
            self._own = CollectorRegistry()
            source = self._own
        else:
            if os.environ.get(MULTIPROC_ENV) != str(multiprocess_dir):
                raise RuntimeError(f"{MULTIPROC_ENV} must name {multiprocess_dir} before prometheus_client is imported")
            # Unregistered, in files: read back (every worker's, dead ones too) by the collector.
            source = MultiProcessCollector(None, path=str(multiprocess_dir))  # type: ignore[no-untyped-call]
        # process_open_fds / process_max_fds and friends, for the file-descriptor alert.
        ProcessCollector(registry=self.registry)
        self.registry.register(LiveGauges(self._live_samples, self.choose_jobs, per_rank=per_rank))
        self._count_messages()
        self._count_store()
        self._time()
        # Registered after the live gauges: a scrape chooses the jobs with series before it reads counters.
        self.registry.register(_LiveJobsOnly(source, self))
        self.scrape = Scrape(self.registry, cache_seconds)
        """What /metrics serves: one render shared by the scrapes of ``cache_seconds``."""

    def _count_messages(self) -> None:
        per_job = ["job"]
        self.plans_issued = self._counter("rematd_plans_issued", "Plans sent to training ranks.", per_job)
        self.oom_events = self._counter("rematd_oom_events", "Out-of-memory events reported.", per_job)
        self.steps = self._counter("rematd_steps", "Training steps reported.", per_job)
        self.exploration_steps = self._counter(
            "rematd_exploration_steps",
            "Training steps that ran a trial: of a mode not yet measured at their length, or of a plan the step "
            "times may find faster.",
            per_job,
        )  # fmt: skip
        self.recompiles = self._counter(
            "rematd_recompiles", "Graphs compiled for the blocks' variants (attach(..., compile=True)).", per_job
        )
        self.plan_trials = self._counter(
            "rematd_plan_trials",
            "Plan trials ended, by outcome: kept (the plan tried was surely faster), stays (it was not), void (too "
            "noisy to tell), disputed (a few outlying steps made its gain), overtaken (by a new table), held or "
            "reverted (a plan kept, checked once more on fresh steps: its gain held, or did not and the plan it "
            "replaced came back).",
            ["job", "outcome"],
        )
        self._per_job = (self.plans_issued, self.oom_events, self.steps, self.exploration_steps, self.recompiles)
        self.active_streams = Gauge(
            "rematd_active_streams", "Training ranks connected now.", registry=self._own, multiprocess_mode="livesum"
        )
        self.invalid_messages = self._counter("rematd_invalid_messages", "Messages refused as invalid.")
        self.oom_dropped = self._counter(
            "rematd_oom_events_dropped",
            "OOM events a rank reported faster than its rate (a burst of 10, then 1 a second), dropped.",
        )
        self.unauthenticated = self._counter(
            "rematd_unauthenticated_requests", "Requests refused for a missing or wrong token.", ["transport"]
        )
        self.service_faults = self._counter(
            "rematd_service_faults",
            "Messages the service failed to handle through a fault of its own (answered INTERNAL), by kind.",
            ["kind"],
        )
        for kind in MESSAGE_KINDS:
            self.service_faults.labels(kind)  # present at 0, so that a rate over it is defined from the start

    def _count_store(self) -> None:
        self.rejected_rows = self._counter(
            "rematd_store_rejected_rows", "Buffered statistics rows the store refused, set aside."
        )
        self.store_write_failures = self._counter(
            "rematd_store_write_failures",
            "Writes to the store that failed (a full or failing disk, a lost database); see /readyz.",
        )
        self.store_conflicts = self._counter(
            "rematd_store_conflicts",
            "Store transactions the database rolled back to settle a conflict with another (a deadlock, a "
            "serialization failure), run again.",
        )
        self.store_lost = Gauge(
            "rematd_store_lost",
            "1 while the store's database file is deleted, replaced or truncated under the service (writes stop).",
            registry=self._own,
            multiprocess_mode="livemax",
        )

    def _time(self) -> None:
        self.message_duration = Histogram(
            "rematd_message_duration_seconds",
            "Time to handle one message from a training rank, by kind of message.",
            ["kind"],
            buckets=_LATENCY_BUCKETS,
            registry=self._own,
        )
        for kind in MESSAGE_KINDS:
            self.message_duration.labels(kind)
        self.training_thread = Histogram(
            "rematd_training_thread_seconds",
            "rematd's own time on a training rank's thread per step (its hooks and wrappers, not the model's work), "
            "as the rank measured it; a report folding steady steps counts once, as their mean.",
            buckets=_THREAD_BUCKETS,
            registry=self._own,
        )
        self.plan_duration = Histogram(
            "rematd_plan_duration_seconds",
            "Time the planner takes to decide on one step's statistics.",
            buckets=_LATENCY_BUCKETS,
            registry=self._own,
        )

    def _counter(self, name: str, doc: str, labels: list[str] | None = None) -> Counter:
        return Counter(name, doc, labels or [], registry=self._own)

    def _live_samples(self) -> list[RankSample]:
        return [*(self.snapshot() if self.snapshot is not None else []), *self.peer_samples()]

    def choose_jobs(self, jobs: dict[str, list[RankSample]]) -> set[str]:
        """The live jobs that get series: all up to ``max_jobs``, else those most at risk of running out of
        memory (then by name)."""
        if len(jobs) <= self.max_jobs:
            self.exported = set(jobs)
        else:
            ranked = sorted(jobs, key=lambda j: (-max(r.oom_risk for r in jobs[j]), j))
            self.exported = set(ranked[: self.max_jobs])
        return self.exported

    def peer_samples(self) -> list[RankSample]:
        return self.peers() if self.peers is not None else []

    def forget_job(self, job: str) -> None:
        """Remove a job's counters from this process (its gauges go with its sessions; a scrape leaves out the
        counters of jobs no worker holds, which multiprocess files keep)."""
        for metric in self._per_job:
            with contextlib.suppress(KeyError):
                metric.remove(job)
        for outcome in OUTCOMES:
            with contextlib.suppress(KeyError):
                self.plan_trials.remove(job, outcome)


class _LiveJobsOnly(Collector):
    """Counters, gauges and histograms as ``source`` has them, per-job series only for the jobs the scrape
    exports: the live ones, at most ``max_jobs`` (ended jobs' counts stay in multiprocess files)."""

    def __init__(self, source: Collector, metrics: Metrics) -> None:
        self.source = source
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        exported = self.metrics.exported
        for family in self.source.collect():
            # Without the _created series, as in the multiprocess files: the scrape is the same either way.
            family.samples = [
                s
                for s in family.samples
                if not s.name.endswith("_created") and ("job" not in s.labels or s.labels["job"] in exported)
            ]
            yield family
