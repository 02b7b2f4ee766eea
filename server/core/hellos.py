"""A rank's hello: the live session it resumes, or a fresh one from what the store holds of the rank.

A fresh session continues the rank's plan history where it outlived a restart of the service (its plan in
force, what its controller learned), numbers its plans on from the job's last run, and may start from a
warm-start plan of the same model. Reads of the store are done before any lock of the core; the hello's own
write (``RankWrites.opened``) is waited for, so a hello the store refuses leaves no connected rank behind.
The rank's steps, OOMs and the end of its stream are ``training``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from rematd.planner import Plan, PlannerSession
from rematd.planner.messages import MAX_INT, Hello, InvalidMessage, open_planner
from rematd.planner.plan_trials import OUTCOMES
from rematd.server.config import CoreConfig
from rematd.server.core import plan_policy as policy
from rematd.server.core.controls import OperatorControls, tune_planner
from rematd.server.core.errors import SessionTaken
from rematd.server.core.ownership import JobTokens, check_claim
from rematd.server.core.rank_writes import RankWrites
from rematd.server.core.sessions import RankSession, Sessions
from rematd.server.metrics.registry import Metrics
from rematd.server.store.rows import WarmPlanRow
from rematd.server.store.store import Store
from rematd.server.store.store_writes import RankHeldElsewhere

log = logging.getLogger("rematd.server")


@dataclasses.dataclass(frozen=True, slots=True)
class _Past:
    """What the store holds of a rank that outlived a restart of the service, read before any lock."""

    last_version: int = 0
    learned: dict[str, object] | None = None
    recompiles: int = 0
    warm: WarmPlanRow | None = None


class HelloSide:
    """Opens rank sessions; what every message of a rank checks (a plan that fits, the operator's pin)."""

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
        for outcome in OUTCOMES:
            self.metrics.plan_trials.labels(job, outcome)

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
