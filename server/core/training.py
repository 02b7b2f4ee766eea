"""The training side of the core: a rank's hello (``hellos``), its steps and OOMs, and the end of its stream.

Each message is decided in memory (under the registry's lock, or the rank's planning lock while its
planner works) and what it changes in the store is handed to the ``StoreWriter``: a stream is
answered without waiting for the database, and no lock of the core is held while the database
works. A hello and a stream's end wait for their own writes (off the event loop, in the servicer's
threads): a hello the store refuses leaves no connected rank behind, and a stream's end is written
before the rank may come back.
"""

from __future__ import annotations

import dataclasses
import time
from typing import cast

from rematd.planner import Plan, StepObservation
from rematd.planner.messages import MAX_INT, InvalidMessage, OomReport, StepStats, observation
from rematd.server.core import plan_policy as policy
from rematd.server.core.errors import JobEnded
from rematd.server.core.hellos import HelloSide
from rematd.server.core.rank_writes import warm_row
from rematd.server.core.sessions import RankSession
from rematd.server.store.rows import LastStepRow, OomRow, StepRow, WarmPlanRow, keys

REPORTED = tuple(name for name in keys(StepRow) if name in keys(StepStats))
"""The fields of a step's row that its report carries under the same name."""


def _ended(job: str) -> JobEnded:
    return JobEnded(f"job {job!r} was ended by an operator; this rank's reports are no longer taken")


def _not_revoked(session: RankSession) -> None:
    """Raise JobEnded once an operator ended the session's job: a new run of the job opened since (another
    session of the same rank) does not bring this stream back."""
    if session.revoked:
        raise _ended(session.hello.job_id)


class TrainingSide(HelloSide):
    """Opens (``HelloSide``), feeds and closes rank sessions."""

    # -- steps and OOMs ---------------------------------------------------------

    def outgoing(self, session: RankSession, cause: str, *, new: bool = False) -> Plan | None:
        """Under the registry's lock: the plan to send when it differs from what the rank has, versioned after it;
        ``new``: the planner's base plan is new, sent even with its modes unchanged (a trial's verdict, a plan
        priced again: the rank's plan and the plans' history say why it runs what it runs)."""
        base = session.base
        want = self.pinned_or(session, base)
        plan = policy.next_plan(want, session.sent, len(session.hello.blocks), always=new and want is base)
        if plan is None:
            return None
        self.check_fits(plan, cause)
        session.steps_on_plan = 0
        session.oom_on_plan = False
        return plan

    def on_stats(self, session: RankSession, stats: StepStats) -> Plan | None:
        job = session.hello.job_id
        stats = self._under_controls(session, stats)
        obs = self._observation(session, stats)
        ran, changed = self._observe(session, stats, obs)
        now = time.time()
        with self.sessions.lock:
            _not_revoked(session)  # under the lock the end is applied under: nothing is written after it
            plan = self._next_plan(session, changed, "stats.shape")
            warm = self._steady(session, stats.steps, now) if plan is None else None
            session.recompiles = min(MAX_INT, session.recompiles + stats.recompiles)
            row = self._step_row(session, stats, obs, ran, now)
            session.has_stats = True
            self._count_step(job, session, stats, plan)
            if plan is not None:
                # Handed over (not written) under the lock that chose it: another stream of the rank
                # cannot hand over a later version first, so versions land in order.
                row_of_plan = policy.plan_row(plan, len(session.hello.blocks), stats.shape.seq_len)
                self.writes.plan(session, row_of_plan, now)
        # Into the write-behind buffer (memory) now, so a read right after the step sees it; a full
        # buffer is written on the writer's thread, as is a plan to remember for warm starts.
        self.writes.stats(job, session.hello.rank, row)
        if warm is not None:
            self.writes.remember(warm)
        return plan

    def _under_controls(self, session: RankSession, stats: StepStats) -> StepStats:
        """The step as the operator's controls see it: refused once the job was ended, its budget overridden."""
        job = session.hello.job_id
        controls = self.controls.get(job)
        if controls is not None and controls.ended_at is not None:
            raise _ended(job)
        _not_revoked(session)
        if controls is not None and controls.budget_bytes is not None and stats.budget_bytes:
            return dataclasses.replace(stats, budget_bytes=controls.budget_bytes)
        return stats

    def _observation(self, session: RankSession, stats: StepStats) -> StepObservation:
        try:
            obs = observation(session.hello, stats)
        except InvalidMessage as err:
            raise self._invalid(err) from None
        if stats.step <= session.last_step:
            raise self._invalid(
                InvalidMessage("stats.step", f"step {stats.step} does not follow step {session.last_step}")
            )
        return obs

    def _observe(self, session: RankSession, stats: StepStats, obs: StepObservation) -> tuple[Plan | None, Plan | None]:
        """The planner's turn, under the session's own lock: under the registry's, one large profile's step
        would hold up every other rank (and the event loop) while it is planned. Returns the plan the step
        ran with (for its own prediction: the planner may replace it) and the planner's new plan, if any."""
        with session.planning:
            ran = session.plan_of(stats.plan_version)
            session.last_step = stats.step
            session.last_peak = obs.peak_bytes
            started = time.perf_counter()
            # By the plan this service sent (a pin's included), not by version: the planner's versions and the
            # rank's part where a pin or an unsent plan came between.
            modes = ran.modes_for(obs.shape, len(session.hello.blocks)) if ran is not None else ()
            changed = session.planner.observe(obs, modes)
            self.metrics.plan_duration.observe(time.perf_counter() - started)
        return ran, changed

    def _steady(self, session: RankSession, steps: int, now: float) -> WarmPlanRow | None:
        """Under the registry's lock, on a step that kept its plan: the plan to remember for warm starts,
        once it has held long enough without an OOM (once per plan)."""
        session.steps_on_plan += steps
        remember = (
            session.steps_on_plan >= self.config.warm_after_steps
            and not session.oom_on_plan
            and session.remembered != session.sent.version
        )
        if not remember:
            return None
        session.remembered = session.sent.version
        return warm_row(session, now)

    @staticmethod
    def _step_row(
        session: RankSession, stats: StepStats, obs: StepObservation, ran: Plan | None, now: float
    ) -> LastStepRow:
        """The step's row; its prediction is of the plan it ran (the plan in force now if that is unknown),
        which the session keeps as what the rank ran (``session.ran``) for the gauges and the views."""
        n = len(session.hello.blocks)
        ran = ran or session.sent
        own: dict[str, object] = {}
        if len(stats.modes) == n:
            # The rank ran other modes than its plan (a pin in its process, or the plan its job's ranks agreed
            # on): the row says which, and predicts what they keep.
            ran = dataclasses.replace(ran, modes=stats.modes, shape_plans=())
            overhead = policy.overhead_at(session.planner, stats.modes, stats.shape)
            own = {"modes": policy.mode_names(stats.modes), "predicted_overhead_ratio": overhead}
        else:
            overhead = ran.at(stats.shape).predicted_overhead_ratio
        predicted = policy.predicted_at(session.planner, ran, stats.shape, obs.static_bytes, n)
        shown = ran.running(ran.modes_for(stats.shape, n), predicted_peak_bytes=predicted, overhead=overhead)
        session.ran = dataclasses.replace(shown, version=stats.plan_version)
        # What the report and the row both name is copied as it came: a field added to both needs no line here.
        copied = {name: getattr(stats, name) for name in REPORTED}
        return cast(
            LastStepRow,
            dict(
                **copied,
                time=now,
                peak_bytes=obs.peak_bytes,
                predicted_peak_bytes=predicted,
                seq_len=stats.shape.seq_len,
                batch=stats.shape.batch,
                oom_risk=session.planner.oom_risk,
                recompiles_total=session.recompiles,
                thread_seconds=stats.thread_seconds / stats.steps,
                routed_bytes=stats.routed_bytes,
                **own,
            ),
        )

    def _count_step(self, job: str, session: RankSession, stats: StepStats, plan: Plan | None) -> None:
        self.metrics.steps.labels(job).inc(stats.steps)
        if session.planner.trial_step:
            self.metrics.exploration_steps.labels(job).inc(stats.steps)
        if stats.recompiles:
            self.metrics.recompiles.labels(job).inc(stats.recompiles)
        if stats.thread_seconds:
            # Clients that do not measure it send none; a folded report counts as one of its mean steps.
            self.metrics.training_thread.observe(stats.thread_seconds / stats.steps)
        if plan is not None:
            self.metrics.plans_issued.labels(job).inc()
        counted = session.trials_counted
        for outcome, ended in session.planner.trial_outcomes.items():
            if ended != counted.get(outcome, 0):
                # Fewer than counted: the rank's planner was made anew (its counts start again).
                self.metrics.plan_trials.labels(job, outcome).inc(max(0, ended - counted.get(outcome, 0)))
                counted[outcome] = ended

    def on_oom(self, session: RankSession, oom: OomReport) -> Plan | None:
        try:
            oom.validate()
        except InvalidMessage as err:
            raise self._invalid(err) from None
        job = session.hello.job_id
        with self.sessions.lock:
            _not_revoked(session)
        now = time.time()
        row = OomRow(
            step=oom.step,
            time=now,
            seq_len=oom.shape.seq_len,
            batch=oom.shape.batch,
            plan_version=oom.plan_version,
            message=oom.message[:1000],
        )
        with self.sessions.lock:
            self.writes.oom(session, row)
            self.metrics.oom_events.labels(job).inc()
            session.oom_on_plan = True
        with session.planning:
            changed = session.planner.report_oom(oom.shape)
        with self.sessions.lock:
            plan = self._next_plan(session, changed, "oom.shape")
            if plan is not None:
                self.metrics.plans_issued.labels(job).inc()
                self.writes.plan(session, policy.plan_row(plan, len(session.hello.blocks), oom.shape.seq_len), now)
        return plan

    def _next_plan(self, session: RankSession, changed: Plan | None, cause: str) -> Plan | None:
        """Under the registry's lock: take the planner's new plan (``changed``, checked to fit) as the
        rank's base, and return what goes out to the rank now, if anything."""
        if changed is not None:
            self.check_fits(session.planner.plan, cause)
            session.base = session.planner.plan
        plan = self.outgoing(session, cause, new=changed is not None)
        if plan is not None:
            session.send(plan)
        return plan

    # -- the end of a stream ----------------------------------------------------

    def close_session(self, session: RankSession, *, ended: bool) -> None:
        job = session.hello.job_id
        reg = self.sessions
        with reg.transitions(job, session.hello.rank):
            with reg.lock:
                session.streams -= 1
                self.metrics.active_streams.dec()
                if session.streams > 0:
                    return
                if reg.by_key.get(session.key) is not session:
                    # The rank came back as a new session before this stream was found dead (or it
                    # expired): the rank's state is the newer session's, not this one's.
                    return
                session.ended = ended
                session.disconnected_at = None if ended else time.monotonic()
                remember = (
                    ended
                    and not session.oom_on_plan
                    and session.steps_on_plan > 0
                    and session.remembered != session.sent.version
                )
                if remember:
                    session.remembered = session.sent.version
                warm = warm_row(session, time.time()) if remember else None
                if ended and reg.all_ended(job):
                    reg.drop_job(job)
            # After everything the stream handed over, and before a hello of the rank (which writes
            # it connected): the writer keeps that order.
            self.writes.ended(session, ended=ended, warm=warm)
