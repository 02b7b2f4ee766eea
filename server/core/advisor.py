"""The transport-neutral core: jobs, ranks, plans, operator controls and history.

The gRPC servicer and the HTTP router are thin adapters over ``AdvisorCore``;
domain errors (``rematd.server.core.errors``) are raised here and mapped once per
transport. The core is composed of parts that each do one thing: the live
ranks (``sessions``), what a rank is sent (``plan_policy``), the training side
(``hellos``, ``training``) and its writes (``rank_writes``, over the store's
``writer``), an operator's controls (``controls``) and the REST reads
(``read_views``, in the shapes of ``views``).

What a rank is sent is the core's decision, not only the planner's: an
operator's pin, or a warm start from an earlier job of the same model,
overrides the planner's plan. Versions of the plans a rank is sent increase by
one per change, and equal the planner's own when nothing overrides it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from typing_extensions import Unpack

from rematd.planner import Plan
from rematd.planner.messages import Hello, OomReport, StepStats
from rematd.server.config import CoreConfig
from rematd.server.core import plan_policy as policy
from rematd.server.core.controls import OperatorControls, PinTarget
from rematd.server.core.errors import JobNotFound, SessionError, StoreStalled
from rematd.server.core.ownership import JobTokens
from rematd.server.core.paging import JOBS_PAGE, ROWS_PAGE, Page
from rematd.server.core.plan_policy import (
    mode_names,
)
from rematd.server.core.rank_writes import RankWrites
from rematd.server.core.read_views import ReadViews
from rematd.server.core.sessions import RankSession, Sessions
from rematd.server.core.training import TrainingSide
from rematd.server.core.views import JOB_STATES, JobView, StatsQuery
from rematd.server.metrics.registry import Metrics, RankSample
from rematd.server.store.database import is_store_error
from rematd.server.store.retention_clock import RetentionClock
from rematd.server.store.rows import ControlsRow, StoredOomRow, StoredPlanRow, StoredStepRow
from rematd.server.store.store import Store
from rematd.server.store.writer import StoreWriter

__all__ = ["JOB_STATES", "AdvisorCore", "JobNotFound", "RankSession", "SessionError", "mode_names"]

log = logging.getLogger("rematd.server")

READ_WAIT_SECONDS = 5.0
"""How long a REST read waits for the writes queued before it."""


class AdvisorCore:
    """Per-(job, rank) planning with a durable store and metrics."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics | None = None,
        config: CoreConfig | None = None,
        *,
        job_tokens: JobTokens | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics or Metrics()
        self.config = config or CoreConfig()
        self.sessions = Sessions(self.metrics)
        self.retention_clock = RetentionClock()
        self.writer = StoreWriter(on_failure=self._write_failed, describe=self._describe)
        self.controls = OperatorControls(store, self.sessions)
        self.training = TrainingSide(
            store=store,
            metrics=self.metrics,
            config=self.config,
            sessions=self.sessions,
            controls=self.controls,
            writes=RankWrites(store, self.writer),
            job_tokens=job_tokens,
        )
        self.views = ReadViews(store, self.sessions, job_controls=self.controls.job_controls, settle=self._settle)
        self.metrics.snapshot = self.rank_samples
        self.store.buffer.on_rejected = self.metrics.rejected_rows.inc
        self.store.on_write_failure = self.metrics.store_write_failures.inc
        self.store.transactions.on_conflict = self.metrics.store_conflicts.inc
        self.metrics.store_lost.set_function(lambda: 1.0 if self.store.lost else 0.0)
        self.refresh_controls()

    # -- the training side ----------------------------------------------------

    def open_session(self, hello: Hello) -> tuple[RankSession, Plan]:
        """Start or resume a rank's session; returns it and the plan to apply.

        Blocking (it waits for the store): the servicer calls it off the event loop. The store is
        written before the rank counts as connected: a hello the store refuses leaves no connected
        rank (and no open-stream count) behind.
        """
        self.store_answers()
        return self.training.open_session(hello)

    def store_failure(self, err: BaseException) -> str:
        """Why the store fails, where ``err`` is that failure (counted and alerted on by itself, so said in one
        line); "" where it is anything else."""
        store = self.store
        if store.failing_since is not None and is_store_error(err):
            return store.last_failure or str(err)
        return ""

    def unwritable(self) -> tuple[str, float] | None:
        """Why the store takes no writes and for how many seconds it has not (None while it takes them),
        answered without waiting on it: what readiness reports."""
        store = self.store
        if store.writable():
            return None
        since = store.failing_since
        return store.last_failure, (time.monotonic() - since if since is not None else 0.0)

    def store_answers(self) -> None:
        """Raise StoreStalled while the store's database is not answering: a hello or a read would wait on it
        for as long as it is away."""
        stalled = self.store.stalled()
        if stalled:
            raise StoreStalled(f"the service's store is not answering ({stalled})")

    def on_stats(self, session: RankSession, stats: StepStats) -> Plan | None:
        """One step's statistics; returns the plan to send when it changes. Never waits for the store: the
        plan is sent after :meth:`durable`."""
        return self.training.on_stats(session, stats)

    def report_interval(self, session: RankSession) -> float:
        """How long the rank may fold steady steps into one report (0: every step reported)."""
        cfg = self.config
        return policy.report_interval(
            steps_on_plan=session.steps_on_plan,
            steady=session.planner.steady,
            oom_risk=session.planner.oom_risk,
            quiet_steps=cfg.quiet_steps,
            max_interval_seconds=cfg.max_report_interval_seconds,
        )

    def on_oom(self, session: RankSession, oom: OomReport) -> Plan | None:
        """An out-of-memory event; returns the tighter plan. Never waits for the store: it is answered after
        :meth:`durable`."""
        return self.training.on_oom(session, oom)

    def durable(self, session: RankSession) -> bool:
        """Wait until the rank's plans and OOM events handed over so far are in the store, before its answer
        goes out (a few seconds at most: then it goes out anyway). Blocking: the servicer calls it off the
        event loop."""
        return self.training.writes.durable(session)

    def close_session(self, session: RankSession, *, ended: bool) -> None:
        """A rank's stream closed: ``ended`` when it said goodbye, else it was lost.

        Blocking (it waits for the stream's writes and its end's): the servicer calls it off the
        event loop. No lock of the core is held while the store is written.
        """
        self.training.close_session(session, ended=ended)

    def expire_sessions(self, now: float | None = None) -> int:
        """Forget ranks whose stream has been gone longer than the expiry; returns how many."""
        return self.sessions.expire(time.monotonic() if now is None else now, self.config.session_expiry_seconds)

    def heartbeat(self) -> None:
        """Say in the store that this process is alive, and forget processes that are not: the ranks a
        killed process left connected read as lost from now (``rematd.server.store.holders``)."""
        for holder in self.store.heartbeat():
            log.warning("process %s is gone without closing its streams: the ranks it held read as lost", holder)

    def compact(self) -> dict[str, int]:
        """Retention and down-sampling on the store, by a clock that ignores jumps of the wall clock; jobs with
        a rank whose session is open or resumable keep every row."""
        return self.store.compact(self.retention_clock.now(), live=self.sessions.live_jobs())

    def drain_writes(self, timeout: float | None = None) -> bool:
        """Wait until every write handed over so far is in the store (or failed); False on timeout."""
        return self.writer.drain(timeout)

    def close(self) -> None:
        """Write what is queued (the service's shutdown, before the store closes)."""
        self.writer.close()

    def _settle(self) -> None:
        """Before a read: wait for the writes handed over so far, so that it sees them; a store that
        does not take them in time is read as it stands (a read must not hang with the database)."""
        if not self.writer.drain(READ_WAIT_SECONDS):
            log.warning(
                "reading the store without the writes still queued: it has not taken them in %.0f s", READ_WAIT_SECONDS
            )

    def _write_failed(self, err: BaseException) -> None:
        # The store counts a failed write of its own; anything else failed in rematd, and is counted here.
        if not is_store_error(err):
            self.metrics.store_write_failures.inc()

    def _describe(self, err: BaseException) -> str:
        if is_store_error(err) and self.store.failing_since is not None:
            return self.store.last_failure or str(err)
        return f"{type(err).__name__}: {err}"

    # -- metrics --------------------------------------------------------------

    def rank_samples(self) -> list[RankSample]:
        """The live ranks, for the gauges Prometheus scrapes."""
        return self.sessions.samples()

    # -- the operator side: controls ------------------------------------------

    def pin(self, job: str, **target: Unpack[PinTarget]) -> ControlsRow:
        """Pin a job's plan until unpinned; ``target`` as :meth:`OperatorControls.pin` takes it."""
        return self.controls.pin(job, **target)

    def unpin(self, job: str) -> ControlsRow:
        return self.controls.unpin(job)

    def tune(self, job: str, changes: Mapping[str, object]) -> ControlsRow:
        """Override a job's margin or budget (a value of None clears the override)."""
        return self.controls.tune(job, changes)

    def end_job(self, job: str) -> JobView:
        """Mark a job ended: its series go, its live streams are refused at their next message."""
        self.controls.end_job(job)
        return self.get_job(job)

    def job_controls(self, job: str) -> ControlsRow:
        return self.controls.job_controls(job)

    def refresh_controls(self) -> None:
        """Pick up controls another worker or replica wrote to the shared store."""
        self.controls.refresh()

    # -- the operator side: reads ---------------------------------------------

    def list_jobs(self, state: str | None = None) -> list[JobView]:
        return self.views.list_jobs(state)

    def jobs_page(
        self, state: str | None = None, *, limit: int = JOBS_PAGE, cursor: str | None = None
    ) -> Page[JobView]:
        """A page of jobs in the order they were created, and where the next starts."""
        return self.views.jobs_page(state, limit=limit, cursor=cursor)

    def plans_page(self, job: str, *, limit: int = ROWS_PAGE, cursor: str | None = None) -> Page[StoredPlanRow]:
        return self.views.plans_page(job, limit=limit, cursor=cursor)

    def ooms_page(self, job: str, *, limit: int = ROWS_PAGE, cursor: str | None = None) -> Page[StoredOomRow]:
        return self.views.ooms_page(job, limit=limit, cursor=cursor)

    def get_job(self, job: str) -> JobView:
        return self.views.get_job(job)

    def job_plans(self, job: str) -> list[StoredPlanRow]:
        return self.views.job_plans(job)

    def job_stats(self, job: str, **query: Unpack[StatsQuery]) -> list[StoredStepRow]:
        """A job's step statistics; ``query`` as :meth:`ReadViews.job_stats` takes it."""
        return self.views.job_stats(job, **query)

    def job_ooms(self, job: str) -> list[StoredOomRow]:
        return self.views.job_ooms(job)
