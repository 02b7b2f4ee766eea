"""The training side of the core: a rank's hello, its steps and OOMs, and the end of its stream.

Each message is decided in memory (under the registry's lock, or the rank's planning lock while its
planner works) and what it changes in the store is handed to the ``StoreWriter``: a stream is
answered without waiting for the database, and no lock of the core is held while the database
works. A hello and a stream's end wait for their own writes (off the event loop, in the servicer's
threads): a hello the store refuses leaves no connected rank behind, and a stream's end is written
before the rank may come back.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import cast

from rematd.messages import MAX_INT, Hello, InvalidMessage, OomReport, StepStats, observation, open_planner
from rematd.planner import Plan, PlannerSession, StepObservation
from rematd.server.config import CoreConfig
from rematd.server.core import plan_policy as policy
from rematd.server.core.controls import OperatorControls, tune_planner
from rematd.server.core.errors import JobEnded, SessionTaken
from rematd.server.core.ownership import JobTokens, check_claim
from rematd.server.core.rank_writes import RankWrites, warm_row
from rematd.server.core.sessions import RankSession, Sessions
from rematd.server.metrics.registry import Metrics
from rematd.server.store.rows import LastStepRow, OomRow, StepRow, WarmPlanRow, keys
from rematd.server.store.store import RankHeldElsewhere, Store

log = logging.getLogger("rematd.server")

REPORTED = tuple(name for name in keys(StepRow) if name in keys(StepStats))
"""The fields of a step's row that its report carries under the same name."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Past:
    """What the store holds of a rank that outlived a restart of the service, read before any lock."""

    last_version: int = 0
    learned: dict[str, object] | None = None
    recompiles: int = 0
    warm: WarmPlanRow | None = None


def _ended(job: str) -> JobEnded:
    return JobEnded(f"job {job!r} was ended by an operator; this rank's reports are no longer taken")


def _not_revoked(session: RankSession) -> None:
    """Raise JobEnded once an operator ended the session's job: a new run of the job opened since (another
    session of the same rank) does not bring this stream back."""
    if session.revoked:
        raise _ended(session.hello.job_id)


class TrainingSide:
    """Opens, feeds and closes rank sessions."""

    def __init__(
        self,
        *,
        store: Store,
        metrics: Metrics,
        config: CoreConfig,
        sessions: Sessions,
        controls: OperatorControls,
        writes: RankWrites,
        job_tokens: JobTokens | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.config = config
        self.sessions = sessions
        self.controls = controls
        self.writes = writes
        self.job_tokens = job_tokens or JobTokens()

    def _invalid(self, err: InvalidMessage) -> InvalidMessage:
        self.metrics.invalid_messages.inc()
        return err

    def check_fits(self, plan: Plan, cause: str) -> None:
        try:
            policy.check_fits(plan, cause)
        except InvalidMessage as err:
            raise self._invalid(err) from None

    def planner(self, hello: Hello, first_version: int = 1) -> PlannerSession:
        """The planner for a rank over a profile shared with every rank that sent the same one."""
        hello.validate()
        return open_planner(hello, first_version=first_version, profile=self.sessions.shared(hello.profile()))

    def pinned_or(self, session: RankSession, plan: Plan) -> Plan:
        return self.controls.pinned(session) or plan

    # -- a hello ----------------------------------------------------------------

    def open_session(self, hello: Hello) -> tuple[RankSession, Plan]:
        self.job_tokens.check(hello)
        try:
            planner = self.planner(hello)
            if hello.plan_version >= MAX_INT:
                raise InvalidMessage("hello.plan_version", f"leaves no room for a newer version below {MAX_INT}")
        except InvalidMessage as err:
            raise self._invalid(err) from None
        hello = dataclasses.replace(hello, blocks=self.sessions.shared(hello.blocks))
        now = time.time()
        job = hello.job_id
        with self.sessions.transitions(job, hello.rank):
            with self.sessions.lock:
                resumed, jumped = self._resume(hello)
            recorded = False
            if resumed is None:
                session, recorded = self._fresh(hello, planner, self._past(hello))
            else:
                session = resumed
            for plan in (session.base, session.sent):
                self.check_fits(plan, "hello.blocks")
            self.controls.reopen(job, now)
            new_plan = (resumed is None or jumped) and not recorded
            row = policy.plan_row(session.sent, len(hello.blocks), hello.profile_shape.seq_len) if new_plan else None
            try:
                self.writes.opened(hello, now, row)
            except RankHeldElsewhere as err:
                self.metrics.invalid_messages.inc()
                raise SessionTaken(
                    f"rank {hello.rank} of job {job!r} is held by {err}, live on another stream; "
                    "retry once that stream has ended"
                ) from None
            if new_plan:
                self.metrics.plans_issued.labels(job).inc()
            with self.sessions.lock:
                self._connected(session)
        log.info("rank %s of job %s %s", hello.rank, job, "connected" if resumed is None else "resumed")
        return session, session.sent

    def _resume(self, hello: Hello) -> tuple[RankSession | None, bool]:
        """Under the registry's lock: the rank's live session when this hello resumes it (the same owner,
        model and blocks, and a plan in force), else None; and whether the plan it is sent jumped above
        the version the rank has."""
        existing = self.sessions.by_key.get((hello.job_id, hello.rank))
        try:
            owner = check_claim(existing, hello, self.config.session_expiry_seconds)
        except SessionTaken:
            self.metrics.invalid_messages.inc()
            raise
        if (
            existing is None
            or not owner
            or hello.plan_version == 0
            or existing.hello.model_fingerprint != hello.model_fingerprint
            or len(existing.hello.blocks) != len(hello.blocks)
        ):
            return None, False
        session = existing
        session.hello = hello
        if hello.plan_version <= session.sent.version:
            return session, False
        # The rank planned on its own while cut off: continue above its versions. Under its planning
        # lock (taken inside the registry's, never the other way round): a stats thread of its old
        # stream may still be planning.
        with session.planning:
            session.planner.renumber_after(hello.plan_version)
            session.base = session.planner.plan
        session.send(self.pinned_or(session, session.base))
        return session, session.sent.version > hello.plan_version

    def _connected(self, session: RankSession) -> None:
        """Under the registry's lock: the session counts one more stream, registered if it is not."""
        if self.sessions.by_key.get(session.key) is not session:
            # New, or resumed but forgotten (expired, its job dropped) while the store was written
            # outside the registry's lock: registered again, or its end would go unwritten.
            self.sessions.add(session)
        session.streams += 1
        session.ended = False
        session.disconnected_at = None
        self.metrics.active_streams.inc()
        job = session.hello.job_id
        # Present from the start at 0, so that increase() sees the first OOM.
        self.metrics.oom_events.labels(job)
        self.metrics.steps.labels(job)
        self.metrics.exploration_steps.labels(job)

    def _past(self, hello: Hello) -> _Past:
        """The store's reads for a new session, done with no lock of the core held."""
        job, rank = hello.job_id, hello.rank
        if hello.plan_version > 0:
            self.writes.writer.drain()  # its last stream's writes first
            last = self.store.last_plan_version(job, rank)
            learned = self.store.learned(job=job, rank=rank) if hello.plan is not None else None
            stats = self.store.last_rank_stats(job, rank)
            return _Past(
                last_version=last, learned=learned, recompiles=int(stats.get("recompiles_total", 0)) if stats else 0
            )
        # A job's name used again: this run's plan versions go on from the last run's.
        last = self.store.last_plan_version(job, rank)
        if self.config.warm_start and hello.model_fingerprint:
            bucket = policy.shape_bucket(hello.profile_shape.tokens)
            warm = self.store.warm_plan(fingerprint=hello.model_fingerprint, device=hello.device_name, bucket=bucket)
            return _Past(last_version=last, warm=warm)
        return _Past(last_version=last)

    def _fresh(self, hello: Hello, planner: PlannerSession, past: _Past) -> tuple[RankSession, bool]:
        """A new session for the rank; True when the store already holds the plan it starts on."""
        job, rank = hello.job_id, hello.rank
        recorded = False
        if hello.plan_version > 0:
            # A rank that outlived a restart of the service: continue its plan history, from the
            # plan it has in force when it says which (a plan made afresh from the profile alone
            # would forget what the last service learned, and could be looser).
            if hello.plan is not None:
                planner.continue_from(hello.plan)
                if past.learned is not None:
                    try:
                        planner.controller.restore_state(past.learned)
                    except ValueError as err:  # a store from another rematd: plan afresh rather than refuse
                        log.warning("job %s rank %d: what its controller learned cannot be restored (%s)",
                                    job, rank, err)  # fmt: skip
                if past.last_version > hello.plan_version:
                    planner.renumber_after(past.last_version)
                recorded = past.last_version == hello.plan_version
            else:
                planner = self.planner(hello, first_version=max(past.last_version, hello.plan_version) + 1)
        elif past.last_version:
            # Each version names one plan of the job, whichever run made it: no second v1 in its history.
            planner.renumber_after(past.last_version)
        tune_planner(planner, self.controls.get(job))
        session = RankSession(hello=hello, planner=planner, sent=planner.plan, base=planner.plan)
        # The same run going on after a restart of the service: its count goes on too.
        session.recompiles = past.recompiles
        if past.warm is not None:
            try:
                warm = policy.warm_start_plan(
                    past.warm, job=job, num_blocks=len(hello.blocks), planner=planner, version=session.sent.version
                )
            except ValueError as err:
                log.warning("%s; planning from the profile", err)
                warm = None
            if warm is not None:
                # A starting point, not a pin: the planner goes on from it, loosening where this job
                # measures room (and tightening at once where it must).
                planner.continue_from(warm)
                session.base = warm
        with self.sessions.lock:
            session.send(self.pinned_or(session, session.base))
        return session, recorded

    # -- steps and OOMs ---------------------------------------------------------

    def outgoing(self, session: RankSession, cause: str) -> Plan | None:
        """Under the registry's lock: the plan to send when it differs from what the rank has, versioned after it."""
        want = self.pinned_or(session, session.base)
        plan = policy.next_plan(want, session.sent, len(session.hello.blocks))
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
            changed = session.planner.observe(obs)
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
        plan = self.outgoing(session, cause)
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
