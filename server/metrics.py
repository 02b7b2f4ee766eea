"""Prometheus metrics: base units in names, one label (job) with series removed when a job ends."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector


class Metrics:
    """All of rematd's series, on a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
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
