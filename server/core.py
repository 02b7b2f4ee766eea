"""The transport-neutral core: jobs, ranks, plans, operator controls and history.

The gRPC servicer and the HTTP router are thin adapters over this class;
domain errors (``rematd.server.errors``) are raised here and mapped once per
transport.

What a rank is sent is the core's decision, not only the planner's: an
operator's pin, or a warm start from an earlier job of the same model,
overrides the planner's plan. Versions of the plans a rank is sent increase by
one per change, and equal the planner's own when nothing overrides it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from rematd.planner import (
    ControllerConfig,
    Mode,
    Plan,
    PlannerSession,
    Profile,
    Shape,
    ShapePlan,
    blocks_of,
    every_k_blocks,
    frequency_of,
)
from rematd.planner.cost import overhead_ratio
from rematd.planner.shapes import at_shape
from rematd.planner.shapes import forget as forget_prepared
from rematd.records import (
    JOB_ID_RE,
    MAX_INT,
    Hello,
    InvalidMessage,
    OomReport,
    StepStats,
    observation,
    open_planner,
)
from rematd.server.config import CoreConfig
from rematd.server.errors import JobEnded, JobNotFound, SessionError, SessionTaken
from rematd.server.metrics import Metrics, RankSample
from rematd.server.store import Store

__all__ = ["AdvisorCore", "JobNotFound", "RankSession", "SessionError"]

log = logging.getLogger("rematd.server")
_T = TypeVar("_T")

CONNECTED = "connected"
DISCONNECTED = "disconnected"
ENDED = "ended"
JOB_STATES = ("running", "disconnected", "ended")
# Below this out-of-memory risk a rank's steady steps may be folded into fewer reports.
QUIET_RISK = 0.25


MODE_NAMES = {m: m.name.lower() for m in Mode}
MODES_BY_NAME = {name: m for m, name in MODE_NAMES.items()}


def mode_names(modes: tuple[Mode, ...]) -> list[str]:
    return [MODE_NAMES[m] for m in modes]


def modes_of(names: list[str], field_name: str) -> tuple[Mode, ...]:
    bad = sorted({n for n in names if n not in MODES_BY_NAME})
    if bad:
        raise InvalidMessage(field_name, f"unknown mode(s) {bad}; use {', '.join(MODES_BY_NAME)}")
    return tuple(MODES_BY_NAME[n] for n in names)


def shape_plan_row(entry: ShapePlan) -> dict[str, Any]:
    return {
        "max_seq_len": entry.max_seq_len,
        "max_tokens": entry.max_tokens,
        "modes": mode_names(entry.modes),
        "predicted_peak_bytes": entry.predicted_peak_bytes,
        "predicted_overhead_ratio": entry.predicted_overhead_ratio,
    }


def shape_plan_of(row: dict[str, Any]) -> ShapePlan:
    return ShapePlan(
        max_seq_len=int(row["max_seq_len"]),
        max_tokens=int(row["max_tokens"]),
        modes=modes_of(list(row["modes"]), "shape_plans.modes"),
        predicted_peak_bytes=int(row["predicted_peak_bytes"]),
        predicted_overhead_ratio=float(row["predicted_overhead_ratio"]),
    )


MAX_INTERNED_BYTES = 64 << 20
"""What the shared profiles may take in all."""
_BYTES_PER_BLOCK = 600
"""A block's record in a hello, or its costs in a profile, with its modes (measured, rounded up)."""


def _interned_bytes(value: object) -> int:
    blocks = value.num_blocks if isinstance(value, Profile) else len(value) if isinstance(value, tuple) else 1
    return 256 + blocks * _BYTES_PER_BLOCK


def _same_secret(given: str, issued: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), issued.encode())


def plan_row(plan: Plan, num_blocks: int) -> dict[str, Any]:
    """A plan as the record and the REST API keep it: every block's mode and the per-length table."""
    row = asdict(plan)
    row["blocks"] = list(plan.blocks)
    row["modes"] = mode_names(plan.block_modes(num_blocks))
    row["shape_plans"] = [shape_plan_row(e) for e in plan.shape_plans]
    return row


def entry_in_force(plan: dict[str, Any], seq_len: int | None, tokens: int | None = None) -> dict[str, Any]:
    """Of a recorded plan, what a step of ``seq_len`` runs: the first table entry covering it, the
    longest past the table, the plan's own modes without a table (or without a length)."""
    table = plan.get("shape_plans") or []
    entry = None
    if table and seq_len:
        entry = next(
            (e for e in table if seq_len <= e["max_seq_len"] and (tokens is None or tokens <= e["max_tokens"])),
            table[-1],
        )
    if entry is None:
        return {
            "max_seq_len": None,
            "modes": plan["modes"],
            "predicted_peak_bytes": plan["predicted_peak_bytes"],
            "predicted_overhead_ratio": plan["predicted_overhead_ratio"],
        }
    return {k: entry[k] for k in ("max_seq_len", "modes", "predicted_peak_bytes", "predicted_overhead_ratio")}


def shape_bucket(tokens: int) -> int:
    """Power-of-two bucket of tokens per batch: plans learnt at one size serve sizes within 2x."""
    return int(tokens).bit_length()


@dataclass(slots=True)
class Controls:
    """An operator's overrides for one job (persisted; shared by every worker through the record)."""

    pin_blocks: tuple[int, ...] | None = None
    pin_every: int | None = None
    margin_ratio: float | None = None
    budget_bytes: int | None = None
    ended_at: float | None = None
    pin_modes: tuple[Mode, ...] | None = None

    @property
    def pinned(self) -> bool:
        return self.pin_blocks is not None or self.pin_every is not None or self.pin_modes is not None

    def as_row(self) -> dict[str, Any]:
        return {
            "pin_blocks": list(self.pin_blocks) if self.pin_blocks is not None else None,
            "pin_modes": mode_names(self.pin_modes) if self.pin_modes is not None else None,
            "pin_every": self.pin_every,
            "margin_ratio": self.margin_ratio,
            "budget_bytes": self.budget_bytes,
            "ended_at": self.ended_at,
        }


@dataclass(slots=True)
class RankSession:
    """One connected rank: its hello, planner, the plan it was sent and its last step."""

    hello: Hello
    planner: PlannerSession
    sent: Plan
    base: Plan
    """What the rank gets without a pin: the planner's plan, or the warm start until the planner changes it."""
    last_step: int = -1
    last_peak: int = 0
    streams: int = 0
    ended: bool = False
    steps_on_plan: int = 0
    oom_on_plan: bool = False
    remembered: int = 0
    has_stats: bool = False
    recompiles: int = 0
    """Graphs compiled for the rank's block variants so far (``attach(..., compile=True)``), kept in the
    record with its last statistics so that the count outlives the stream and the service."""
    opened_at: float = field(default_factory=time.time)
    disconnected_at: float | None = None
    """When (monotonic) its last stream went without a goodbye; None while connected or ended."""
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False, compare=False)
    """Proves a reconnecting stream is this rank's: issued in a stream's first ack, presented in its hello."""
    planning: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Held while its planner works, which the core's lock is not."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.hello.job_id, self.hello.rank)


class AdvisorCore:
    """Per-(job, rank) planning with a durable record and metrics."""

    def __init__(self, store: Store, metrics: Metrics | None = None, config: CoreConfig | None = None) -> None:
        self.store = store
        self.metrics = metrics or Metrics()
        self.config = config or CoreConfig()
        self._lock = threading.RLock()
        self._transitions = threading.Lock()
        """Orders a rank's hello and its stream's end in the record; taken before ``_lock``, never under it."""
        self._sessions: dict[tuple[str, int], RankSession] = {}
        self._by_job: dict[str, dict[int, RankSession]] = {}
        self._controls: dict[str, Controls] = {}
        self._controls_revision = 0
        self._interned: dict[Any, Any] = {}
        self._interned_bytes = 0
        # A plan to remember for warm starts is written on a thread of its own: on_stats runs on the event
        # loop, where a write would hold up every stream. Readers of warm plans wait for it (_wait_warm).
        self._warm_writes = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rematd-warm-plans")
        self._warm_pending: concurrent.futures.Future[None] | None = None
        self.metrics.snapshot = self.rank_samples
        self.store.buffer.on_rejected = self.metrics.rejected_rows.inc
        self.store.on_write_failure = self.metrics.record_write_failures.inc
        self.refresh_controls()

    # -- the training side ----------------------------------------------------

    def open_session(self, hello: Hello) -> tuple[RankSession, Plan]:
        """Start or resume a rank's session; returns it and the plan to apply.

        The record is written before the rank counts as connected: a hello the record refuses
        leaves no connected rank (and no open-stream count) behind.
        """
        try:
            planner = self._planner(hello)
            if hello.plan_version >= MAX_INT:
                raise InvalidMessage("hello.plan_version", f"leaves no room for a newer version below {MAX_INT}")
        except InvalidMessage:
            self.metrics.invalid_messages.inc()
            raise
        hello = dataclasses.replace(hello, blocks=self._shared(hello.blocks))
        self._wait_warm()  # before the core's lock: a warm start reads what the steps before it remembered
        now = time.time()
        job = hello.job_id
        with self._transitions, self._lock:
            existing = self._sessions.get((job, hello.rank))
            owner = existing is not None and _same_secret(hello.session_secret, existing.secret)
            if existing is not None and existing.streams > 0 and not owner:
                # The model fingerprint, job and rank can all be read over REST: only the secret the
                # live stream was given proves a hello is that rank's.
                self.metrics.invalid_messages.inc()
                raise SessionTaken(
                    f"rank {hello.rank} of job {job!r} is live on another stream; a reconnect must present "
                    "the session secret from that stream's first acknowledgement (retry once it has ended)"
                )
            resumed = (
                existing is not None
                and owner
                and hello.plan_version > 0
                and existing.hello.model_fingerprint == hello.model_fingerprint
                and len(existing.hello.blocks) == len(hello.blocks)
            )
            controls = self._controls.get(job)
            jumped = recorded = False
            if resumed and existing is not None:
                session = existing
                session.hello = hello
                if hello.plan_version > session.sent.version:
                    # The rank planned on its own while cut off: continue above its versions.
                    # Under its planning lock (taken inside the core's, never the other way round): a
                    # stats thread of its old stream may still be planning.
                    with session.planning:
                        session.planner.renumber_after(hello.plan_version)
                        session.base = session.planner.plan
                    session.sent = self._pinned(session) or session.base
                    jumped = session.sent.version > hello.plan_version
            else:
                if hello.plan_version > 0:
                    # A rank that outlived a restart of the service: continue its plan history, from the
                    # plan it has in force when it says which (a plan made afresh from the profile alone
                    # would forget what the last service learned, and could be looser).
                    last = self.store.last_plan_version(job, hello.rank)
                    if hello.plan is not None:
                        planner.continue_from(hello.plan)
                        self._restore_learned(planner, job, hello.rank)
                        if last > hello.plan_version:
                            planner.renumber_after(last)
                        recorded = last == hello.plan_version
                    else:
                        planner = self._planner(hello, first_version=max(last, hello.plan_version) + 1)
                self._apply_tuning(planner, controls)
                session = RankSession(hello=hello, planner=planner, sent=planner.plan, base=planner.plan)
                if hello.plan_version > 0:
                    # The same run going on after a restart of the service: its count goes on too.
                    session.recompiles = self._recorded_recompiles(job, hello.rank)
                if hello.plan_version == 0 and self.config.warm_start:
                    session.base = self._warm_start(session) or session.base
                session.sent = self._pinned(session) or session.base
            for plan in (session.base, session.sent):
                self._check_fits(plan, "hello.blocks")
            if controls is not None and controls.ended_at is not None:
                # A job an operator ended comes back as a new run under the same name.
                controls = dataclasses.replace(controls, ended_at=None)
                self.store.set_controls(job, controls.as_row(), now)
                self._controls[job] = controls
            new_plan = (not resumed or jumped) and not recorded
            self.store.open_rank(
                job=job,
                rank=hello.rank,
                now=now,
                world_size=hello.world_size,
                num_blocks=len(hello.blocks),
                budget_bytes=hello.budget_bytes,
                fingerprint=hello.model_fingerprint,
                device=hello.device_name,
                plan=plan_row(session.sent, len(hello.blocks)) if new_plan else None,
            )
            if new_plan:
                self.metrics.plans_issued.labels(job).inc()
            if not resumed:
                self._sessions[session.key] = session
                self._by_job.setdefault(job, {})[hello.rank] = session
            session.streams += 1
            session.ended = False
            session.disconnected_at = None
            self.metrics.active_streams.inc()
            # Present from the start at 0, so that increase() sees the first OOM.
            self.metrics.oom_events.labels(job)
            self.metrics.steps.labels(job)
            log.info("rank %s of job %s %s", hello.rank, job, "resumed" if resumed else "connected")
            return session, session.sent

    def on_stats(self, session: RankSession, stats: StepStats) -> Plan | None:
        """One step's statistics; returns the plan to send when it changes."""
        job = session.hello.job_id
        controls = self._controls.get(job)
        if controls is not None and controls.ended_at is not None:
            raise JobEnded(f"job {job!r} was ended by an operator; this rank's reports are no longer taken")
        if controls is not None and controls.budget_bytes is not None and stats.budget_bytes:
            stats = dataclasses.replace(stats, budget_bytes=controls.budget_bytes)
        try:
            obs = observation(session.hello, stats)
        except InvalidMessage:
            self.metrics.invalid_messages.inc()
            raise
        if stats.step <= session.last_step:
            self.metrics.invalid_messages.inc()
            raise InvalidMessage("stats.step", f"step {stats.step} does not follow step {session.last_step}")
        now = time.time()
        # Planning is the session's own work, done under its own lock: under the core's, one large
        # profile's step would hold up every other rank (and the event loop) while it is planned.
        with session.planning:
            # The plan the step ran with, for its own prediction (the planner may replace it below).
            ran = session.sent if stats.plan_version == session.sent.version else None
            session.last_step = stats.step
            session.last_peak = obs.peak_bytes
            started = time.perf_counter()
            changed = session.planner.observe(obs)
            self.metrics.plan_duration.observe(time.perf_counter() - started)
        remember = False
        with self._lock:
            if changed is not None:
                self._check_fits(session.planner.plan, "stats.shape")
                session.base = session.planner.plan
            plan = self._outgoing(session, "stats.shape")
            if plan is not None:
                session.sent = plan
            else:
                session.steps_on_plan += stats.steps
                remember = (
                    session.steps_on_plan >= self.config.warm_after_steps
                    and not session.oom_on_plan
                    and session.remembered != session.sent.version
                )
                if remember:
                    session.remembered = session.sent.version
            session.recompiles = min(MAX_INT, session.recompiles + stats.recompiles)
            row = {
                "step": stats.step,
                "time": now,
                "peak_bytes": obs.peak_bytes,
                "budget_bytes": stats.budget_bytes,
                "predicted_peak_bytes": self._predicted_at(session, ran or session.sent, stats.shape, obs.static_bytes),
                "plan_version": stats.plan_version,
                "seq_len": stats.shape.seq_len,
                "batch": stats.shape.batch,
                "step_seconds": stats.step_seconds,
                "oom_risk": session.planner.oom_risk,
                "recompiles_total": session.recompiles,
            }
            session.has_stats = True
            self.metrics.steps.labels(job).inc(stats.steps)
            if stats.recompiles:
                self.metrics.recompiles.labels(job).inc(stats.recompiles)
        # Written after the core's lock is let go: a slow record holds up this rank's stream, not every other's.
        if plan is not None:
            self._record_plan(session, plan, now)
        elif remember:
            self._warm_pending = self._warm_writes.submit(self._remember_logged, session, now)
        self.store.add_stats(job=job, rank=session.hello.rank, row=row)
        return plan

    def _recorded_recompiles(self, job: str, rank: int) -> int:
        """The rank's compile count as the record last kept it (0 for a rank it never saw)."""
        last = self.store.last_rank_stats(job, rank)
        return int(last.get("recompiles_total", 0)) if last else 0

    def report_interval(self, session: RankSession) -> float:
        """How long the rank may fold steady steps into one report: the longest allowed once its plan
        has held for a while with no risk and no loosening under way; else 0, every step reported."""
        cfg = self.config
        planner = session.planner
        if session.steps_on_plan >= cfg.quiet_steps and planner.steady and planner.oom_risk < QUIET_RISK:
            return cfg.max_report_interval_seconds
        return 0.0

    def on_oom(self, session: RankSession, oom: OomReport) -> Plan | None:
        """An out-of-memory event; returns the tighter plan."""
        try:
            oom.validate()
        except InvalidMessage:
            self.metrics.invalid_messages.inc()
            raise
        job = session.hello.job_id
        now = time.time()
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
        with self._lock:
            self.metrics.oom_events.labels(job).inc()
            session.oom_on_plan = True
        with session.planning:
            changed = session.planner.report_oom(oom.shape)
        with self._lock:
            if changed is not None:
                self._check_fits(session.planner.plan, "oom.shape")
                session.base = session.planner.plan
            plan = self._outgoing(session, "oom.shape")
            if plan is not None:
                session.sent = plan
        if plan is not None:
            self._record_plan(session, plan, now)
        return plan

    def close_session(self, session: RankSession, *, ended: bool) -> None:
        """A rank's stream closed: ``ended`` when it said goodbye, else it was lost.

        Blocking (it writes the record): the servicer calls it off the event loop. The writes come
        after the core's lock is let go, so a slow record does not hold up every other rank's steps;
        ``_transitions`` keeps them in order with a hello of the same rank, which writes it connected.
        """
        job = session.hello.job_id
        self._wait_warm()
        with self._transitions:
            with self._lock:
                session.streams -= 1
                self.metrics.active_streams.dec()
                if session.streams > 0:
                    return
                if self._sessions.get(session.key) is not session:
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
                if ended and all(s.ended for s in self._by_job.get(job, {}).values()):
                    self._drop_job(job)
            if remember:
                self._remember(session, time.time())
            self.store.set_rank_state(job=job, rank=session.hello.rank, state=ENDED if ended else DISCONNECTED)
            try:
                self._save_learned(session, time.time())
            except Exception as err:  # the rank's end still counts; the last plan's state stays recorded
                log.warning(
                    "job %s rank %d: what its controller learned was not saved: %s", job, session.hello.rank, err
                )
            if ended:
                # Every rank said goodbye (here and on other workers): the job ended now.
                self.store.end_job_if_done(job, time.time())

    def expire_sessions(self, now: float | None = None) -> int:
        """Forget ranks whose stream has been gone longer than the expiry; returns how many.

        A rank that crashes never says goodbye: without this its state and its job's series would
        stay for the life of the process. A job goes when none of its ranks is left but ended ones.
        """
        now = time.monotonic() if now is None else now
        cutoff = now - self.config.session_expiry_seconds
        with self._lock:
            gone = [
                s
                for s in self._sessions.values()
                if s.streams == 0 and s.disconnected_at is not None and s.disconnected_at <= cutoff
            ]
            for s in gone:
                self._sessions.pop(s.key, None)
                self._by_job.get(s.hello.job_id, {}).pop(s.hello.rank, None)
            for job in {s.hello.job_id for s in gone}:
                if all(r.ended for r in self._by_job.get(job, {}).values()):
                    self._drop_job(job)
            if gone:
                self._forget_unused(gone)
        for job, n in collections.Counter(s.hello.job_id for s in gone).items():
            log.info(
                "job %s: %d rank(s) forgotten, their streams lost over %.0f s ago",
                job,
                n,
                self.config.session_expiry_seconds,
            )
        return len(gone)

    def _drop_job(self, job: str) -> None:
        dropped = list(self._by_job.pop(job, {}).values())
        for s in dropped:
            self._sessions.pop(s.key, None)
        self.metrics.forget_job(job)
        self._forget_unused(dropped)

    def _shared(self, value: _T) -> _T:
        """One copy of a profile (or its blocks) for every rank that sends the same one.

        The ranks of a job, and the jobs of one model, send the same profile: sharing it is most of
        a session's memory at thousands of ranks. Bounded by the bytes its entries take (a value
        past the bound is used unshared), and emptied of what no session uses as jobs end.
        """
        with self._lock:
            hit = self._interned.get(value)
            if hit is not None:
                return hit  # type: ignore[no-any-return]
            cost = _interned_bytes(value)
            if self._interned_bytes + cost > MAX_INTERNED_BYTES:
                return value
            self._interned[value] = value
            self._interned_bytes += cost
            return value

    def _forget_unused(self, dropped: Iterable[RankSession] = ()) -> None:
        """Drop shared profiles no session uses any more, and what the planner prepared for them
        (and for the profiles of ``dropped`` sessions, shared or not)."""
        with self._lock:
            live = {id(v) for s in self._sessions.values() for v in (s.hello.blocks, s.planner.profile)}
            gone = [v for v in self._interned if id(v) not in live]
            for v in gone:
                del self._interned[v]
                self._interned_bytes -= _interned_bytes(v)
        profiles = {id(v): v for v in gone if isinstance(v, Profile)}
        profiles.update((id(s.planner.profile), s.planner.profile) for s in dropped)
        for key, profile in profiles.items():
            if key not in live:
                forget_prepared(profile)

    def _planner(self, hello: Hello, first_version: int = 1) -> PlannerSession:
        """The planner for a rank over a profile shared with every rank that sent the same one."""
        hello.validate()
        return open_planner(hello, first_version=first_version, profile=self._shared(hello.profile()))

    # -- what a rank is sent --------------------------------------------------

    def _pinned(self, session: RankSession) -> Plan | None:
        controls = self._controls.get(session.hello.job_id)
        if controls is None or not controls.pinned:
            return None
        n = len(session.hello.blocks)
        if controls.pin_modes is not None:
            modes = (controls.pin_modes + (Mode.STORE,) * n)[:n]
            reason = f"pinned by an operator: modes {_letters(modes)}"
        elif controls.pin_every is not None:
            blocks = every_k_blocks(n, controls.pin_every)
            modes = _recompute(blocks, n)
            reason = (
                f"pinned by an operator: every {controls.pin_every} block(s) recompute"
                if blocks
                else "pinned by an operator: every block stores"
            )
        else:
            blocks = tuple(b for b in controls.pin_blocks or () if b < n)
            modes = _recompute(blocks, n)
            reason = f"pinned by an operator: blocks {list(blocks)} recompute"
        return self._plan_for(session, modes, reason)

    def _usable(self, session: RankSession, modes: tuple[Mode, ...]) -> tuple[Mode, ...]:
        """``modes`` with any a block's profile does not offer replaced by recomputation, which every block has."""
        options = session.planner.profile.options_at(None)
        return tuple(
            m if any(o.mode == m for o in opts) else Mode.RECOMPUTE for m, opts in zip(modes, options, strict=True)
        )

    def _plan_for(
        self, session: RankSession, modes: tuple[Mode, ...], reason: str, table: tuple[ShapePlan, ...] = ()
    ) -> Plan:
        """A plan of given modes (and table) sent instead of the planner's, priced by the rank's profile."""
        profile = session.planner.profile
        usable = self._usable(session, modes)
        if usable != modes:
            reason += f" (as {_letters(usable)}: the profile offers no such mode for some blocks)"
        at = at_shape(profile, None)
        peak, extra = at.cost(usable)
        blocks = blocks_of(usable)
        uniform = all(m in (Mode.STORE, Mode.RECOMPUTE) for m in usable)
        return Plan(
            version=session.sent.version,
            blocks=blocks,
            checkpoint_every=frequency_of(profile.num_blocks, blocks) if uniform else 0,
            predicted_peak_bytes=session.planner.static_bytes + at.other_bytes + peak,
            predicted_overhead_ratio=overhead_ratio(extra, at.forward_seconds),
            target_bytes=session.planner.plan.target_bytes,
            reason=reason,
            modes=usable,
            shape_plans=table,
        )

    def _predicted_at(self, session: RankSession, plan: Plan, shape: Shape, static_bytes: int) -> int:
        """The peak predicted for one step: the modes ``plan`` runs at its shape, priced at that shape."""
        try:
            at = at_shape(session.planner.profile, shape if shape.seq_len else None)
            return static_bytes + at.other_bytes + at.cost(plan.modes_for(shape, len(session.hello.blocks)))[0]
        except ValueError:
            return plan.predicted_peak_bytes

    def _outgoing(self, session: RankSession, cause: str) -> Plan | None:
        """The plan to send when it differs from what the rank has, versioned after it."""
        want = self._pinned(session) or session.base
        n = len(session.hello.blocks)
        # Modes and the table, not just which blocks checkpoint: selective to recompute, or an entry
        # for another length, is a change the rank must hear of.
        if (want.block_modes(n), want.shape_plans) == (session.sent.block_modes(n), session.sent.shape_plans):
            return None
        plan = dataclasses.replace(want, version=session.sent.version + 1)
        self._check_fits(plan, cause)
        session.steps_on_plan = 0
        session.oom_on_plan = False
        return plan

    def _check_fits(self, plan: Plan, cause: str) -> None:
        """Refuse, naming the field that led to it, a plan with numbers the record cannot hold.

        Every field is bounded on arrival, but sizes scale with the shape and add up over blocks,
        and versions count up: an absurd profile or shape must cost its own stream, not the record.
        """
        if plan.version > MAX_INT:
            self.metrics.invalid_messages.inc()
            raise InvalidMessage("hello.plan_version", f"plan versions would pass {MAX_INT}")
        peak = max(plan.predicted_peak_bytes, plan.target_bytes, *(e.predicted_peak_bytes for e in plan.shape_plans))
        if peak > MAX_INT:
            self.metrics.invalid_messages.inc()
            raise InvalidMessage(
                cause, f"the profile's sizes and static_bytes predict a peak of {peak} bytes, more than {MAX_INT}"
            )

    def _warm_start(self, session: RankSession) -> Plan | None:
        h = session.hello
        if not h.model_fingerprint:
            return None
        warm = self.store.warm_plan(
            fingerprint=h.model_fingerprint, device=h.device_name, bucket=shape_bucket(h.profile_shape.tokens)
        )
        n = len(h.blocks)
        if warm is None or warm["num_blocks"] != n or warm["job"] == h.job_id:
            return None
        try:
            modes = modes_of(list(warm["modes"]), "warm_plans.modes")
            table = tuple(shape_plan_of(e) for e in warm["shape_plans"])
        except (InvalidMessage, KeyError, TypeError, ValueError):
            log.warning("the warm-start plan of job %s is unreadable; planning from the profile", warm["job"])
            return None
        if len(modes) != n or any(len(e.modes) != n for e in table):
            return None
        planned = session.planner.plan
        if modes == planned.block_modes(n) and table == planned.shape_plans:
            reason = f"warm start from job {warm['job']} (same as planned)"
        else:
            # Only when it fits this job's target by the profile it sent, at every length of its
            # table (or, where nothing fits, is as lean as any plan): another budget may not hold it.
            target = planned.target_bytes
            static = session.planner.static_bytes
            profile = session.planner.profile
            try:
                at = at_shape(profile, None)
                if static + at.other_bytes + at.cost(modes)[0] > target:
                    return None
                for e in table:
                    at = at_shape(profile, Shape(batch=profile.shape.batch, seq_len=e.max_seq_len, tokens=e.max_tokens))
                    peak = at.cost(e.modes)[0]
                    if static + at.other_bytes + peak > target and peak > at.knapsack.least_peak()[0]:
                        return None
            except ValueError:  # a mode this profile does not offer
                return None
            reason = f"warm start from job {warm['job']}"
        return self._plan_for(session, modes, reason, table)

    def _remember_logged(self, session: RankSession, now: float) -> None:
        try:
            self._remember(session, now)
        except Exception as err:  # the step was taken; the warm start waits for the next plan that holds
            log.error("job %s rank %d: remembering its plan failed: %s", session.hello.job_id, session.hello.rank, err)

    def _wait_warm(self) -> None:
        pending = self._warm_pending
        if pending is not None:
            concurrent.futures.wait([pending])

    def _remember(self, session: RankSession, now: float) -> None:
        h = session.hello
        if not h.model_fingerprint:
            return
        self.store.remember_warm_plan(
            fingerprint=h.model_fingerprint,
            device=h.device_name,
            bucket=shape_bucket(h.profile_shape.tokens),
            job=h.job_id,
            blocks=session.sent.blocks,
            num_blocks=len(h.blocks),
            budget_bytes=session.planner.budget_bytes,
            now=now,
            modes=mode_names(session.sent.block_modes(len(h.blocks))),
            shape_plans=[shape_plan_row(e) for e in session.sent.shape_plans],
        )

    def _apply_tuning(self, planner: PlannerSession, controls: Controls | None) -> None:
        if controls is not None and controls.margin_ratio is not None:
            planner.controller.config = dataclasses.replace(
                planner.controller.config, margin_ratio=controls.margin_ratio
            )

    # -- metrics --------------------------------------------------------------

    def rank_samples(self) -> list[RankSample]:
        """The live ranks, for the gauges Prometheus scrapes."""
        with self._lock:
            sessions = list(self._sessions.values())
        return [
            RankSample(
                job=s.hello.job_id,
                rank=s.hello.rank,
                connected=s.streams > 0,
                world_size=s.hello.world_size,
                budget_bytes=s.planner.budget_bytes,
                peak_bytes=s.last_peak,
                has_stats=s.has_stats,
                predicted_peak_bytes=s.sent.predicted_peak_bytes,
                checkpointed_blocks=len(s.sent.blocks),
                predicted_overhead_ratio=s.sent.predicted_overhead_ratio,
                oom_risk=s.planner.oom_risk,
            )
            for s in sessions
        ]

    def _record_plan(self, session: RankSession, plan: Plan, now: float) -> None:
        job = session.hello.job_id
        self.store.add_plan(job=job, rank=session.hello.rank, plan=plan_row(plan, len(session.hello.blocks)), now=now)
        self.metrics.plans_issued.labels(job).inc()
        self._save_learned(session, now)

    # -- what controllers learned, across restarts ------------------------------

    def _save_learned(self, session: RankSession, now: float) -> None:
        """Kept with each plan and when a stream ends: a restarted service continues from it instead of
        relearning by issuing the same loosening (and its undoing) again."""
        with session.planning:
            state = session.planner.controller.export_state()
        self.store.save_learned(job=session.hello.job_id, rank=session.hello.rank, state=state, now=now)

    def _restore_learned(self, planner: PlannerSession, job: str, rank: int) -> None:
        state = self.store.learned(job=job, rank=rank)
        if state is None:
            return
        try:
            planner.controller.restore_state(state)
        except ValueError as err:  # a record from another rematd: plan afresh rather than refuse the rank
            log.warning("job %s rank %d: what its controller learned cannot be restored (%s)", job, rank, err)

    # -- the operator side: controls ------------------------------------------

    def _require_job(self, job: str) -> dict[str, Any]:
        row = self.store.job(job) if JOB_ID_RE.match(job) else None
        if row is None:
            raise JobNotFound(job)
        return row

    def _set_controls(self, job: str, controls: Controls) -> None:
        rev = self.store.set_controls(job, controls.as_row(), time.time())
        with self._lock:
            self._controls[job] = controls
            self._controls_revision = max(self._controls_revision, rev)
            retune = self._apply_controls(job, controls)
        self._retune(retune)

    def pin(
        self,
        job: str,
        *,
        checkpoint_every: int | None = None,
        blocks: list[int] | None = None,
        modes: list[str] | None = None,
    ) -> dict[str, Any]:
        """Pin a job's plan until unpinned: every k-th block or a set of blocks recomputing, or one mode per block."""
        row = self._require_job(job)
        n = int(row["num_blocks"])
        if sum(x is not None for x in (checkpoint_every, blocks, modes)) != 1:
            raise InvalidMessage("body", "give exactly one of checkpoint_every, blocks or modes")
        pinned_modes: tuple[Mode, ...] | None = None
        if modes is not None:
            if len(modes) != n:
                raise InvalidMessage("modes", f"give one mode per block: {n} for this job, got {len(modes)}")
            pinned_modes = modes_of(list(modes), "modes")
            with self._lock:
                sessions = list(self._by_job.get(job, {}).values())
            for s in sessions:
                options = s.planner.profile.options_at(None)
                missing = [i for i, (m, opts) in enumerate(zip(pinned_modes, options, strict=True))
                           if not any(o.mode == m for o in opts)]  # fmt: skip
                if missing:
                    raise InvalidMessage(
                        "modes", f"blocks {missing} of rank {s.hello.rank} do not offer the modes asked for them"
                    )
        if checkpoint_every is not None and not 0 <= checkpoint_every <= n:
            raise InvalidMessage(
                "checkpoint_every", f"must be in 0-{n} for a job of {n} blocks, got {checkpoint_every}"
            )
        pinned: tuple[int, ...] | None = None
        if blocks is not None:
            bad = [b for b in blocks if not 0 <= b < n]
            if bad:
                raise InvalidMessage("blocks", f"indices {bad} are outside 0-{n - 1}")
            pinned = tuple(sorted(set(blocks)))
        c = dataclasses.replace(self._controls.get(job) or Controls())
        c.pin_every, c.pin_blocks, c.pin_modes = checkpoint_every, pinned, pinned_modes
        self._set_controls(job, c)
        return self.job_controls(job)

    def unpin(self, job: str) -> dict[str, Any]:
        self._require_job(job)
        c = dataclasses.replace(self._controls.get(job) or Controls())
        c.pin_every, c.pin_blocks, c.pin_modes = None, None, None
        self._set_controls(job, c)
        return self.job_controls(job)

    def tune(self, job: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Override a job's margin or budget (a value of None clears the override)."""
        self._require_job(job)
        c = dataclasses.replace(self._controls.get(job) or Controls())
        if "margin_ratio" in changes:
            m = changes["margin_ratio"]
            if m is not None and not (isinstance(m, (int, float)) and math.isfinite(m) and 0.0 <= m < 1.0):
                raise InvalidMessage("margin_ratio", f"must be in [0, 1), got {m!r}")
            c.margin_ratio = None if m is None else float(m)
        if "budget_bytes" in changes:
            b = changes["budget_bytes"]
            if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
                raise InvalidMessage("budget_bytes", f"must be a positive integer, got {b!r}")
            c.budget_bytes = b
        self._set_controls(job, c)
        return self.job_controls(job)

    def end_job(self, job: str) -> dict[str, Any]:
        """Mark a job ended: its series go, its live streams are refused at their next message."""
        self._require_job(job)
        now = time.time()
        c = dataclasses.replace(self._controls.get(job) or Controls())
        c.ended_at = now
        self.store.end_job(job, now)
        self.store.set_rank_state(job=job, state=ENDED)
        self._set_controls(job, c)
        return self.get_job(job)

    def job_controls(self, job: str) -> dict[str, Any]:
        c = self._controls.get(job) or Controls()
        return {"job": job, **c.as_row()}

    def refresh_controls(self) -> None:
        """Pick up controls another worker or replica wrote to the shared record."""
        changed = self.store.controls_since(self._controls_revision)
        if not changed:
            return
        retune: list[tuple[RankSession, float]] = []
        with self._lock:
            for row in changed:
                job = row["job"]
                c = Controls(
                    pin_blocks=tuple(row["pin_blocks"]) if row["pin_blocks"] is not None else None,
                    pin_modes=modes_of(row["pin_modes"], "pin_modes") if row.get("pin_modes") is not None else None,
                    pin_every=row["pin_every"],
                    margin_ratio=row["margin_ratio"],
                    budget_bytes=row["budget_bytes"],
                    ended_at=row["ended_at"],
                )
                self._controls[job] = c
                self._controls_revision = max(self._controls_revision, int(row["revision"]))
                retune.extend(self._apply_controls(job, c))
        self._retune(retune)

    def _apply_controls(self, job: str, c: Controls) -> list[tuple[RankSession, float]]:
        """Under the core's lock: drop an ended job; returns the job's ranks and the margin each now plans with."""
        if c.ended_at is not None and job in self._by_job:
            self._drop_job(job)
            return []
        return [
            (
                s,
                c.margin_ratio
                if c.margin_ratio is not None
                else (s.hello.margin_ratio or ControllerConfig().margin_ratio),
            )
            for s in self._by_job.get(job, {}).values()
        ]

    @staticmethod
    def _retune(margins: list[tuple[RankSession, float]]) -> None:
        """Change ranks' planners under their own planning lock (a planning thread may be using them),
        after the core's lock is let go: planning can take a while, and the two locks never nest this way."""
        for s, margin in margins:
            with s.planning:
                if s.planner.controller.config.margin_ratio != margin:
                    s.planner.controller.config = dataclasses.replace(s.planner.controller.config, margin_ratio=margin)

    # -- the operator side: reads ---------------------------------------------

    def list_jobs(self, state: str | None = None) -> list[dict[str, Any]]:
        if state is not None and state not in JOB_STATES:
            raise InvalidMessage("state", f"must be one of {JOB_STATES}, got {state!r}")
        ranks: dict[str, list[dict[str, Any]]] = {}
        for r in self.store.all_ranks():
            ranks.setdefault(r["job"], []).append(r)
        plans = self.store.latest_plans()
        rank_plans: dict[str, dict[int, dict[str, Any]]] = {}
        for (job, rank), p in self.store.latest_rank_plans().items():
            rank_plans.setdefault(job, {})[rank] = p
        ooms = self.store.oom_counts()
        views = [
            self._job_view(
                row,
                ranks.get(row["job"], []),
                plans.get(row["job"]),
                ooms.get(row["job"], 0),
                rank_plans.get(row["job"], {}),
            )
            for row in self.store.jobs()
        ]
        return [v for v in views if state is None or v["state"] == state]

    def get_job(self, job: str) -> dict[str, Any]:
        row = self._require_job(job)
        plans = self.store.plans(job)
        own = {int(p["rank"]): p for p in plans}  # in the order they were made: each rank's last wins
        return self._job_view(row, self.store.ranks(job), plans[-1] if plans else None, len(self.store.ooms(job)), own)

    def _job_view(
        self,
        row: dict[str, Any],
        ranks: list[dict[str, Any]],
        plan: dict[str, Any] | None,
        ooms: int,
        rank_plans: dict[int, dict[str, Any]],
    ) -> dict[str, Any]:
        """A job as the REST API shows it; ``plan`` is the job's newest, ``rank_plans`` each rank's own newest."""
        job = row["job"]
        states = {r["state"] for r in ranks}
        if row.get("ended_at") is not None or (states and states == {ENDED}):
            state = "ended"
        else:
            state = "running" if CONNECTED in states else "disconnected"
        ended = state == "ended"
        # A copy under the lock: HTTP reads run on a thread pool while the event loop adds ranks.
        with self._lock:
            live = {
                s.hello.rank: (s.sent, len(s.hello.blocks), s.planner.oom_risk)
                for s in self._by_job.get(job, {}).values()
            }
        rank_views = []
        newest: dict[str, Any] = {}
        for r in ranks:
            now = live.get(r["rank"])
            last = r["last_stats"] or {}
            seq, tokens = last.get("seq_len"), (last.get("seq_len") or 0) * (last.get("batch") or 1)
            if last and (not newest or (last.get("step", -1), last.get("time", 0)) > (newest["step"], newest["time"])):
                newest = {"step": last.get("step", -1), "time": last.get("time", 0), "seq_len": seq, "tokens": tokens}
            force: dict[str, Any] | None = None
            if now is not None:
                sent, n = now[0], now[1]
                shape = Shape(batch=last.get("batch") or 1, seq_len=seq or 0, tokens=tokens)
                force = {"modes": mode_names(sent.modes_for(shape, n) if seq else sent.block_modes(n))}
            elif r["rank"] in rank_plans:
                # Not live: what the rank's own last plan runs (the job's newest may be another rank's).
                force = entry_in_force(rank_plans[r["rank"]], seq, tokens)
            rank_views.append(
                {
                    "rank": r["rank"],
                    "connected": r["state"] == CONNECTED,
                    "state": r["state"],
                    "device": r["device"],
                    "last_stats": r["last_stats"],
                    "plan_version": now[0].version if now else last.get("plan_version"),
                    # What its last step's length runs under the plan it has (or its own last one).
                    "modes": force["modes"] if force else None,
                    "checkpointed_blocks": [i for i, m in enumerate(force["modes"]) if m != "store"] if force else None,
                    # An ended job carries no live risk: what it last measured is history.
                    "oom_risk": None if ended else (now[2] if now else last.get("oom_risk")),
                }
            )
        peaks = [r["last_stats"]["peak_bytes"] for r in ranks if r["last_stats"]]
        budget = row["budget_bytes"]
        risks = [v["oom_risk"] for v in rank_views if v["oom_risk"] is not None]
        in_force = None
        if plan is not None:
            in_force = {
                "seq_len": newest.get("seq_len"),
                **entry_in_force(plan, newest.get("seq_len"), newest.get("tokens") or None),
            }
        return {
            "job": job,
            "state": state,
            "created_at": row["created_at"],
            "updated_at": row["updated_at"],
            "ended_at": row.get("ended_at"),
            "world_size": row["world_size"],
            "num_blocks": row["num_blocks"],
            "budget_bytes": budget,
            "model_fingerprint": row["model_fingerprint"],
            "device": row.get("device", ""),
            "ranks": rank_views,
            "plan": plan,
            "in_force": in_force,
            "peak_bytes": max(peaks) if peaks else None,
            "headroom_ratio": (budget - max(peaks)) / budget if peaks and budget else None,
            "oom_risk": None if ended else (max(risks) if risks else None),
            "oom_events": ooms,
            "recompiles": sum(int((r["last_stats"] or {}).get("recompiles_total", 0)) for r in ranks),
            "controls": self.job_controls(job),
        }

    def job_plans(self, job: str) -> list[dict[str, Any]]:
        self._require_job(job)
        return self.store.plans(job)

    def job_stats(
        self,
        job: str,
        *,
        limit: int = 2000,
        since: float | None = None,
        until: float | None = None,
        rank: int | None = None,
    ) -> list[dict[str, Any]]:
        self._require_job(job)
        if since is not None and until is not None and since > until:
            raise InvalidMessage("since", f"since ({since}) is after until ({until})")
        return self.store.stats(job, limit, since=since, until=until, rank=rank)

    def job_ooms(self, job: str) -> list[dict[str, Any]]:
        self._require_job(job)
        return self.store.ooms(job)


_LETTERS = {Mode.STORE: ".", Mode.SELECTIVE: "s", Mode.RECOMPUTE: "R", Mode.OFFLOAD: "O"}


def _letters(modes: tuple[Mode, ...]) -> str:
    """Modes one letter a block, as the demo prints them: . store, s selective, R recompute, O offload."""
    return "".join(_LETTERS[m] for m in modes)


def _recompute(blocks: tuple[int, ...], n: int) -> tuple[Mode, ...]:
    chosen = set(blocks)
    return tuple(Mode.RECOMPUTE if i in chosen else Mode.STORE for i in range(n))
