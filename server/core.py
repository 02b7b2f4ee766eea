"""The transport-neutral core: jobs, ranks, plans and history.

The gRPC servicer and the HTTP router are thin adapters over this class;
domain errors are raised here and mapped once per transport.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rematd.planner import Plan, PlannerSession
from rematd.records import Hello, InvalidMessage, OomReport, StepStats, observation, open_planner
from rematd.server.metrics import Metrics
from rematd.server.store import Store

log = logging.getLogger("rematd.server")

CONNECTED = "connected"
DISCONNECTED = "disconnected"
ENDED = "ended"


class JobNotFound(LookupError):
    """No job of that name is known."""

    def __init__(self, job: str) -> None:
        super().__init__(f"no job named {job!r}")
        self.job = job


class SessionError(ValueError):
    """A message that does not fit the session's state (e.g. stats before hello)."""


def plan_row(plan: Plan) -> dict[str, Any]:
    row = asdict(plan)
    row["blocks"] = list(plan.blocks)
    return row


@dataclass(slots=True)
class RankSession:
    """One connected rank: its hello, planner and last step."""

    hello: Hello
    planner: PlannerSession
    last_step: int = -1
    last_peak: int = 0
    streams: int = 0
    ended: bool = False
    opened_at: float = field(default_factory=time.time)

    @property
    def key(self) -> tuple[str, int]:
        return (self.hello.job_id, self.hello.rank)


class AdvisorCore:
    """Per-(job, rank) planning with a durable record and metrics."""

    def __init__(self, store: Store, metrics: Metrics | None = None) -> None:
        self.store = store
        self.metrics = metrics or Metrics()
        self._lock = threading.RLock()
        self._sessions: dict[tuple[str, int], RankSession] = {}

    # -- the training side ----------------------------------------------------

    def open_session(self, hello: Hello) -> tuple[RankSession, Plan]:
        """Start or resume a rank's session; returns it and the plan to apply."""
        try:
            planner = open_planner(hello)
        except InvalidMessage:
            self.metrics.invalid_messages.inc()
            raise
        now = time.time()
        with self._lock:
            existing = self._sessions.get((hello.job_id, hello.rank))
            resumed = (
                existing is not None
                and hello.plan_version > 0
                and existing.hello.model_fingerprint == hello.model_fingerprint
                and len(existing.hello.blocks) == len(hello.blocks)
            )
            if resumed and existing is not None:
                session = existing
                session.hello = hello
            else:
                if hello.plan_version > 0:
                    # A rank that outlived a restart of the service: continue its plan history.
                    last = self.store.last_plan_version(hello.job_id, hello.rank)
                    planner = open_planner(hello, first_version=max(last, hello.plan_version) + 1)
                session = RankSession(hello=hello, planner=planner)
                self._sessions[session.key] = session
            session.streams += 1
            session.ended = False
            self.store.upsert_job(
                job=hello.job_id,
                now=now,
                world_size=hello.world_size,
                num_blocks=len(hello.blocks),
                budget_bytes=hello.budget_bytes,
                fingerprint=hello.model_fingerprint,
            )
            self.store.upsert_rank(job=hello.job_id, rank=hello.rank, device=hello.device_name, state=CONNECTED)
            self.metrics.active_streams.inc()
            self.metrics.budget_bytes.labels(hello.job_id).set(hello.budget_bytes)
            self.metrics.world_size.labels(hello.job_id).set(hello.world_size)
            self._count_connected(hello.job_id)
            plan = session.planner.plan
            if not resumed:
                self._record_plan(session, plan, now)
            log.info("rank %s of job %s %s", hello.rank, hello.job_id, "resumed" if resumed else "connected")
            return session, plan

    def on_stats(self, session: RankSession, stats: StepStats) -> Plan | None:
        """One step's statistics; returns a new plan when it changes."""
        try:
            obs = observation(session.hello, stats)
        except InvalidMessage:
            self.metrics.invalid_messages.inc()
            raise
        if stats.step <= session.last_step:
            self.metrics.invalid_messages.inc()
            raise InvalidMessage("stats.step", f"step {stats.step} does not follow step {session.last_step}")
        job = session.hello.job_id
        now = time.time()
        with self._lock:
            session.last_step = stats.step
            session.last_peak = obs.peak_bytes
            plan = session.planner.observe(obs)
            current = session.planner.plan
            self.store.add_stats(
                job=job,
                rank=session.hello.rank,
                row={
                    "step": stats.step,
                    "time": now,
                    "peak_bytes": obs.peak_bytes,
                    "budget_bytes": stats.budget_bytes,
                    "predicted_peak_bytes": current.predicted_peak_bytes,
                    "plan_version": stats.plan_version,
                    "seq_len": stats.shape.seq_len,
                    "batch": stats.shape.batch,
                    "step_seconds": stats.step_seconds,
                },
            )
            if plan is not None:
                self._record_plan(session, plan, now)
            self._update_job_metrics(job, stats.budget_bytes)
        return plan

    def on_oom(self, session: RankSession, oom: OomReport) -> Plan | None:
        """An out-of-memory event; returns the tighter plan."""
        try:
            oom.validate()
        except InvalidMessage:
            self.metrics.invalid_messages.inc()
            raise
        job = session.hello.job_id
        now = time.time()
        with self._lock:
            self.store.add_oom(
                job=job,
                rank=session.hello.rank,
                row={
                    "step": oom.step,
                    "time": now,
                    "seq_len": oom.shape.seq_len,
                    "batch": oom.shape.batch,
                    "plan_version": oom.plan_version,
                    "message": oom.message[:1000],
                },
            )
            self.metrics.oom_events.labels(job).inc()
            plan = session.planner.report_oom(oom.shape)
            if plan is not None:
                self._record_plan(session, plan, now)
                self._update_job_metrics(job, session.planner.budget_bytes)
        return plan

    def close_session(self, session: RankSession, *, ended: bool) -> None:
        """A rank's stream closed: ``ended`` when it said goodbye, else it was lost."""
        job = session.hello.job_id
        with self._lock:
            session.streams -= 1
            self.metrics.active_streams.dec()
            if session.streams > 0:
                return
            session.ended = ended
            self.store.set_rank_state(job=job, rank=session.hello.rank, state=ENDED if ended else DISCONNECTED)
            ranks = [s for s in self._sessions.values() if s.hello.job_id == job]
            if ended and all(s.ended for s in ranks):
                for s in ranks:
                    del self._sessions[s.key]
                self.metrics.forget_job(job)
            else:
                self._count_connected(job)

    def _count_connected(self, job: str) -> None:
        live = sum(1 for s in self._sessions.values() if s.hello.job_id == job and s.streams > 0)
        self.metrics.connected_ranks.labels(job).set(live)

    def _record_plan(self, session: RankSession, plan: Plan, now: float) -> None:
        job = session.hello.job_id
        self.store.add_plan(job=job, rank=session.hello.rank, plan=plan_row(plan), now=now)
        self.metrics.plans_issued.labels(job).inc()

    def _update_job_metrics(self, job: str, budget: int) -> None:
        ranks = [s for s in self._sessions.values() if s.hello.job_id == job]
        if not ranks:
            return
        peak = max(s.last_peak for s in ranks)
        plans = [s.planner.plan for s in ranks]
        m = self.metrics
        m.steps.labels(job).inc()
        m.peak_bytes.labels(job).set(peak)
        m.budget_bytes.labels(job).set(budget)
        m.headroom_ratio.labels(job).set((budget - peak) / budget if budget else 0.0)
        m.predicted_peak_bytes.labels(job).set(max(p.predicted_peak_bytes for p in plans))
        m.checkpointed_blocks.labels(job).set(max(len(p.blocks) for p in plans))
        m.predicted_overhead_ratio.labels(job).set(max(p.predicted_overhead_ratio for p in plans))
        m.oom_risk.labels(job).set(max(s.planner.oom_risk for s in ranks))

    # -- the operator side ----------------------------------------------------

    def list_jobs(self) -> list[dict[str, Any]]:
        return [self._job_view(row) for row in self.store.jobs()]

    def get_job(self, job: str) -> dict[str, Any]:
        row = self.store.job(job)
        if row is None:
            raise JobNotFound(job)
        return self._job_view(row)

    def _job_view(self, row: dict[str, Any]) -> dict[str, Any]:
        job = row["job"]
        ranks = self.store.ranks(job)
        plans = self.store.plans(job)
        states = {r["state"] for r in ranks}
        state = "running" if CONNECTED in states else ("ended" if states == {ENDED} else "disconnected")
        return {
            "job": job,
            "state": state,
            "created_at": row["created_at"],
            "updated_at": row["updated_at"],
            "world_size": row["world_size"],
            "num_blocks": row["num_blocks"],
            "budget_bytes": row["budget_bytes"],
            "model_fingerprint": row["model_fingerprint"],
            "ranks": [
                {
                    "rank": r["rank"],
                    "connected": r["state"] == CONNECTED,
                    "state": r["state"],
                    "device": r["device"],
                    "last_stats": r["last_stats"],
                }
                for r in ranks
            ],
            "plan": plans[-1] if plans else None,
        }

    def job_plans(self, job: str) -> list[dict[str, Any]]:
        if self.store.job(job) is None:
            raise JobNotFound(job)
        return self.store.plans(job)

    def job_stats(self, job: str, *, limit: int = 2000) -> list[dict[str, Any]]:
        if self.store.job(job) is None:
            raise JobNotFound(job)
        return self.store.stats(job, limit)

    def job_ooms(self, job: str) -> list[dict[str, Any]]:
        if self.store.job(job) is None:
            raise JobNotFound(job)
        return self.store.ooms(job)
