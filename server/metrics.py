"""Prometheus metrics: base units in names, one label (job) with series removed when a job ends."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

# Message handling is sub-millisecond when healthy; the top buckets catch a stalled loop or database.
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
MESSAGE_KINDS = ("hello", "stats", "oom", "goodbye")


class Metrics:
    """All of rematd's series, on a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None, *, per_rank: bool = False) -> None:
        self.registry = registry or CollectorRegistry()
        self.per_rank = per_rank
        """Export per-rank series too (labels job and rank): opt-in, a large job has thousands of ranks."""
        r = self.registry
        # process_open_fds / process_max_fds and friends, for the file-descriptor alert.
        ProcessCollector(registry=r)
        self.peak_bytes = Gauge(
            "rematd_peak_bytes",
            "Largest measured peak of the budgeted memory over a job's ranks, last step.",
            ["job"],
            registry=r,
        )
        self.budget_bytes = Gauge("rematd_budget_bytes", "Memory budget of a job.", ["job"], registry=r)
        self.predicted_peak_bytes = Gauge(
            "rematd_predicted_peak_bytes",
            "Predicted peak of the plan in force (largest over ranks).",
            ["job"],
            registry=r,
        )
        self.headroom_ratio = Gauge(
            "rematd_headroom_ratio", "(budget - measured peak) / budget for a job, last step.", ["job"], registry=r
        )
        self.checkpointed_blocks = Gauge(
            "rematd_checkpointed_blocks",
            "Blocks recomputed by the plan in force (largest over ranks).",
            ["job"],
            registry=r,
        )
        self.predicted_overhead_ratio = Gauge(
            "rematd_predicted_recompute_overhead_ratio",
            "Predicted recompute overhead of the plan in force.",
            ["job"],
            registry=r,
        )
        self.oom_risk = Gauge(
            "rematd_oom_risk_ratio", "Out-of-memory risk of a job, 0-1 (largest over ranks).", ["job"], registry=r
        )
        self.connected_ranks = Gauge(
            "rematd_job_connected_ranks", "Ranks of a job with a live stream.", ["job"], registry=r
        )
        self.world_size = Gauge("rematd_job_world_size", "Ranks a job trains with.", ["job"], registry=r)
        self.plans_issued = Counter("rematd_plans_issued", "Plans sent to training ranks.", ["job"], registry=r)
        self.oom_events = Counter("rematd_oom_events", "Out-of-memory events reported.", ["job"], registry=r)
        self.steps = Counter("rematd_steps", "Step statistics received.", ["job"], registry=r)
        self.active_streams = Gauge("rematd_active_streams", "Training ranks connected now.", registry=r)
        self.invalid_messages = Counter("rematd_invalid_messages", "Messages refused as invalid.", registry=r)
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
            "rematd_unauthenticated_requests",
            "Requests refused for a missing or wrong token.",
            ["transport"],
            registry=r,
        )
        self.rank_peak_bytes = Gauge(
            "rematd_rank_peak_bytes",
            "Measured peak of one rank, last step (--per-rank-metrics).",
            ["job", "rank"],
            registry=r,
        )
        self.rank_oom_risk = Gauge(
            "rematd_rank_oom_risk_ratio",
            "Out-of-memory risk of one rank, 0-1 (--per-rank-metrics).",
            ["job", "rank"],
            registry=r,
        )
        self._per_rank = (self.rank_peak_bytes, self.rank_oom_risk)
        self._per_job = (
            self.peak_bytes,
            self.budget_bytes,
            self.predicted_peak_bytes,
            self.headroom_ratio,
            self.checkpointed_blocks,
            self.predicted_overhead_ratio,
            self.oom_risk,
            self.connected_ranks,
            self.world_size,
            self.plans_issued,
            self.oom_events,
            self.steps,
        )

    def forget_job(self, job: str) -> None:
        for metric in self._per_job:
            with contextlib.suppress(KeyError):
                metric.remove(job)
        if self.per_rank:
            for metric in self._per_rank:
                for labels in [s.labels for fam in metric.collect() for s in fam.samples if s.labels["job"] == job]:
                    with contextlib.suppress(KeyError):
                        metric.remove(labels["job"], labels["rank"])
