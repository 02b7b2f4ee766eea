"""The live ranks: each one's session, the registry of them by job, the profiles they share, and
forgetting ranks whose streams are long gone.

The registry's lock guards only memory: nothing that waits on the store or the planner is done
under it. A rank's hello and its stream's end are ordered by a lock of that rank's own
(``transitions``), so that one rank's slow write holds up no other rank's hello.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar, cast

from rematd.planner import Plan, PlannerSession, Profile
from rematd.planner.messages import Hello
from rematd.planner.shapes import forget as forget_prepared
from rematd.server.core.rate import Bucket
from rematd.server.metrics.registry import Metrics, RankSample

log = logging.getLogger("rematd.server")
_T = TypeVar("_T")

CONNECTED = "connected"
DISCONNECTED = "disconnected"
ENDED = "ended"

MAX_INTERNED_BYTES = 64 << 20
"""What the shared profiles may take in all."""
_BYTES_PER_BLOCK = 600
"""A block's entry in a hello, or its costs in a profile, with its modes (measured, rounded up)."""
_TRANSITION_STRIPES = 64
SENT_KEPT = 8
"""Plans sent to a rank before its newest, kept to tell which one a step ran."""


def _interned_bytes(value: object) -> int:
    blocks = value.num_blocks if isinstance(value, Profile) else len(value) if isinstance(value, tuple) else 1
    return 256 + blocks * _BYTES_PER_BLOCK


@dataclass(slots=True)
class RankSession:
    """One connected rank: its hello, planner, the plan it was sent and its last step."""

    hello: Hello
    planner: PlannerSession
    sent: Plan
    base: Plan
    """What the rank gets without a pin: the planner's plan, or the warm start until the planner changes it."""
    sent_before: collections.deque[Plan] = field(
        default_factory=lambda: collections.deque(maxlen=SENT_KEPT), repr=False, compare=False
    )
    """The plans sent before ``sent``, the newest last: the rank runs each until the next arrives, so a step may
    report one of them (several, where plans follow each other inside one step)."""
    ran: Plan | None = None
    """The plan the rank's last step ran, as it ran at that step's length (its modes and prediction); None
    before its first step."""
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
    store with its last statistics so that the count outlives the stream and the service."""
    trials_counted: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    """The planner's plan trials ended, by outcome, as the metrics have counted them so far."""
    opened_at: float = field(default_factory=time.time)
    unwritten: int = 0
    """The store writer's ticket of the rank's latest plan or OOM event: its answer waits for it."""
    revoked: bool = False
    """An operator ended its job: the streams that hold this session are refused at their next message, even
    if the job is opened again meanwhile (a new run gets a session of its own)."""
    disconnected_at: float | None = None
    """When (monotonic) its last stream went without a goodbye; None while connected or ended."""
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False, compare=False)
    """Proves a reconnecting stream is this rank's: issued in a stream's first ack, presented in its hello."""
    ooms: Bucket = field(default_factory=Bucket, repr=False, compare=False)
    """How many more OOM events the rank may report now: one stream once sent 1,664 a second."""
    planning: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Held while its planner works, which the core's lock is not."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.hello.job_id, self.hello.rank)

    def send(self, plan: Plan) -> None:
        """``plan`` goes out to the rank; the one before it stays known while steps may still report it."""
        if plan.version != self.sent.version:
            self.sent_before.append(self.sent)
        self.sent = plan

    @property
    def shown(self) -> Plan:
        """What the gauges show: the plan the last step ran, or before any step the plan sent."""
        return self.ran or self.sent

    def plan_of(self, version: int) -> Plan | None:
        """The plan of ``version`` the rank was sent, when it is among the last :data:`SENT_KEPT` + 1."""
        if self.sent.version == version:
            return self.sent
        return next((p for p in reversed(self.sent_before) if p.version == version), None)


class Sessions:
    """The live ranks by (job, rank) and by job, and the profiles they share."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.lock = threading.RLock()
        self.by_key: dict[tuple[str, int], RankSession] = {}
        self.by_job: dict[str, dict[int, RankSession]] = {}
        self.interned: dict[object, object] = {}
        self.interned_bytes = 0
        self._transitions = [threading.Lock() for _ in range(_TRANSITION_STRIPES)]

    def transitions(self, job: str, rank: int) -> threading.Lock:
        """Orders a rank's hello and its stream's end in the store; taken before ``lock``, never under it.
        Striped: ranks that share a stripe wait for each other's transitions, the rest never do."""
        return self._transitions[hash((job, rank)) % _TRANSITION_STRIPES]

    def of_job(self, job: str) -> list[RankSession]:
        with self.lock:
            return list(self.by_job.get(job, {}).values())

    def live_jobs(self) -> set[str]:
        """Jobs with a rank whose session is open (a live stream) or resumable (lost, not yet expired)."""
        with self.lock:
            return {job for job, ranks in self.by_job.items() if any(s.streams or not s.ended for s in ranks.values())}

    def add(self, session: RankSession) -> None:
        """Under ``lock``."""
        self.by_key[session.key] = session
        self.by_job.setdefault(session.hello.job_id, {})[session.hello.rank] = session

    def all_ended(self, job: str) -> bool:
        with self.lock:
            return all(s.ended for s in self.by_job.get(job, {}).values())

    def drop_job(self, job: str) -> None:
        with self.lock:
            dropped = list(self.by_job.pop(job, {}).values())
            for s in dropped:
                self.by_key.pop(s.key, None)
        self.metrics.forget_job(job)
        self.forget_unused(dropped)

    def expire(self, now: float, expiry_seconds: float) -> int:
        """Forget ranks whose stream has been gone longer than ``expiry_seconds``; returns how many.

        A rank that crashes never says goodbye: without this its state and its job's series would
        stay for the life of the process. A job goes when none of its ranks is left but ended ones.
        """
        cutoff = now - expiry_seconds
        with self.lock:
            gone = [
                s
                for s in self.by_key.values()
                if s.streams == 0 and s.disconnected_at is not None and s.disconnected_at <= cutoff
            ]
            for s in gone:
                self.by_key.pop(s.key, None)
                self.by_job.get(s.hello.job_id, {}).pop(s.hello.rank, None)
            for job in {s.hello.job_id for s in gone}:
                if self.all_ended(job):
                    self.drop_job(job)
            if gone:
                self.forget_unused(gone)
        for job, n in collections.Counter(s.hello.job_id for s in gone).items():
            log.info("job %s: %d rank(s) forgotten, their streams lost over %.0f s ago", job, n, expiry_seconds)
        return len(gone)

    def shared(self, value: _T) -> _T:
        """One copy of a profile (or its blocks) for every rank that sends the same one.

        The ranks of a job, and the jobs of one model, send the same profile: sharing it is most of
        a session's memory at thousands of ranks. Bounded by the bytes its entries take (a value
        past the bound is used unshared), and emptied of what no session uses as jobs end.
        """
        with self.lock:
            hit = self.interned.get(value)
            if hit is not None:
                return cast(_T, hit)  # the value it was kept as, equal to ``value``, of its type
            cost = _interned_bytes(value)
            if self.interned_bytes + cost > MAX_INTERNED_BYTES:
                return value
            self.interned[value] = value
            self.interned_bytes += cost
            return value

    def forget_unused(self, dropped: Iterable[RankSession] = ()) -> None:
        """Drop shared profiles no session uses any more, and what the planner prepared for them
        (and for the profiles of ``dropped`` sessions, shared or not)."""
        with self.lock:
            live = {id(v) for s in self.by_key.values() for v in (s.hello.blocks, s.planner.profile)}
            gone = [v for v in self.interned if id(v) not in live]
            for v in gone:
                del self.interned[v]
                self.interned_bytes -= _interned_bytes(v)
        profiles = {id(v): v for v in gone if isinstance(v, Profile)}
        profiles.update((id(s.planner.profile), s.planner.profile) for s in dropped)
        for key, profile in profiles.items():
            if key not in live:
                forget_prepared(profile)

    def samples(self) -> list[RankSample]:
        """The live ranks, for the gauges Prometheus scrapes."""
        with self.lock:
            sessions = list(self.by_key.values())
        return [
            RankSample(
                job=s.hello.job_id,
                rank=s.hello.rank,
                connected=s.streams > 0,
                world_size=s.hello.world_size,
                budget_bytes=s.planner.budget_bytes,
                peak_bytes=s.last_peak,
                has_stats=s.has_stats,
                # What the last step ran, not what was sent after it: the gauges follow the training.
                predicted_peak_bytes=s.shown.predicted_peak_bytes,
                checkpointed_blocks=len(s.shown.blocks),
                predicted_overhead_ratio=s.shown.predicted_overhead_ratio,
                oom_risk=s.planner.oom_risk,
            )
            for s in sessions
        ]
