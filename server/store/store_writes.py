"""The store's writes: a rank's hello and its state, a job's end, plans, step statistics, OOM events,
operator controls, warm-start plans and what a controller learned, this process's heartbeat, and compaction.

Each write goes through the connection's one lock and its tracking of failed writes (``connection``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection

from sqlalchemy import Connection, text

from rematd.server.store.columns import controls_params, dumps, plan_params, warm_params
from rematd.server.store.compaction import compact
from rematd.server.store.connection import StoreConnection
from rematd.server.store.holders import HOLDER_TIMEOUT_SECONDS, gone_here
from rematd.server.store.rows import ControlsRow, JobRow, LastStepRow, OomRow, PlanRow, RankRow, WarmPlanRow
from rematd.server.store.tables import JOB_CONTROLS, JOBS, OOM_EVENTS, PLANS, RANKS, WARM_PLANS

_UPSERT_JOB = JOBS.insert()
_UPSERT_RANK = RANKS.insert()
_HEARTBEAT = """INSERT INTO holders (holder, seen_at) VALUES (:holder, :now)
    ON CONFLICT(holder) DO UPDATE SET seen_at=excluded.seen_at"""
_HELD_ELSEWHERE = """SELECT ranks.holder FROM ranks WHERE ranks.job=:job AND ranks.rank=:rank
    AND ranks.state='connected' AND ranks.holder IS NOT NULL AND ranks.holder <> :holder
    AND EXISTS (SELECT 1 FROM holders h WHERE h.holder = ranks.holder AND h.seen_at >= :alive)"""
"""The process, not this one and alive, whose stream holds a rank connected."""


class RankHeldElsewhere(Exception):
    """A hello for a rank that another live process of the service (a worker, a replica) holds on a stream."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"another process of the service ({holder})")
        self.holder = holder


def _advisory_key(*names: object) -> int:
    """A PostgreSQL advisory lock's key: one (job, rank)'s hellos on two replicas one at a time, or every
    process's controls' writes (a key of one name, apart from every rank's)."""
    digest = hashlib.blake2b("\0".join(map(str, names)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


_ADD_PLAN = PLANS.insert()
_ADD_OOM = OOM_EVENTS.insert()
_NEXT_REVISION = "(SELECT COALESCE(MAX(revision), 0) + 1 FROM job_controls)"
# The revision is numbered by the write itself, under the database's own write lock (SQLite's: one writer).
_SET_CONTROLS = JOB_CONTROLS.insert().replace(":revision", _NEXT_REVISION, 1)
_CONTROLS_LOCK = _advisory_key("job_controls")
"""The advisory lock controls' writes take on PostgreSQL."""
_REMEMBER_WARM = WARM_PLANS.insert()

_SAVE_LEARNED = """INSERT INTO learned_state (job, rank, state, updated_at) VALUES (:job, :rank, :state, :updated_at)
    ON CONFLICT(job, rank) DO UPDATE SET state=excluded.state, updated_at=excluded.updated_at"""


class StoreWrites(StoreConnection):
    """What the store writes; the reads are ``StoreReads``."""

    def compact(self, now: float | None = None, live: Collection[str] = ()) -> dict[str, int]:
        """Down-sample old statistics and apply retention, keeping every row of the ``live`` jobs; returns rows
        deleted by kind."""
        self.flush()
        at = time.time() if now is None else now
        with self._writing():
            return self.transactions.run(lambda conn: compact(conn, self.config, at, live, self._liveness()))

    def open_rank(
        self,
        *,
        job: str,
        rank: int,
        now: float,
        world_size: int,
        num_blocks: int,
        budget_bytes: int,
        fingerprint: str,
        device: str = "",
        plan: PlanRow | None = None,
    ) -> None:
        """A rank's hello, in one transaction: its job, the rank as connected, the plan it starts on. Raises
        RankHeldElsewhere, writing nothing, while another live process of the service holds the rank on a
        stream: two processes that both took it would each number its plans on from the same version."""
        job_row: JobRow = {"job": job, "created_at": now, "updated_at": now, "ended_at": None, "world_size": world_size,
                           "num_blocks": num_blocks, "budget_bytes": budget_bytes, "model_fingerprint": fingerprint,
                           "device": device}  # fmt: skip
        rank_row: RankRow = {"job": job, "rank": rank, "device": device, "state": "connected", "last_stats": None}

        def hello(conn: Connection) -> str | None:
            if conn.dialect.name == "postgresql":
                # Held to the transaction's end: a second replica's hello reads the rank once this one's is in.
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _advisory_key(job, rank)})
            row = conn.execute(text(_HELD_ELSEWHERE), {"job": job, "rank": rank, **self._liveness()}).first()
            if row is not None and not gone_here(str(row[0])):
                return str(row[0])
            # The job's row before the rank's, as every write of the store takes them (``conflicts``).
            conn.execute(text(_UPSERT_JOB), dict(job_row))
            conn.execute(text(_UPSERT_RANK), {**rank_row, "holder": self.holder})
            if plan is not None:
                conn.execute(text(_ADD_PLAN), plan_params(job, rank, plan, now))
            return None

        with self._writing():
            held = self.transactions.run(hello)
        if held is not None:
            # Raised outside the write's tracking: a refusal, not a store that fails.
            raise RankHeldElsewhere(held)

    def set_rank_state(self, *, job: str, rank: int | None = None, state: str) -> None:
        if rank is None:
            self._write("UPDATE ranks SET state=:state WHERE job=:job", {"state": state, "job": job})
        else:
            self._write(
                "UPDATE ranks SET state=:state WHERE job=:job AND rank=:rank",
                {"state": state, "job": job, "rank": rank},
            )

    def disconnect_ranks(self, ranks: list[tuple[str, int]]) -> None:
        """Mark ranks whose process died disconnected, those still marked connected (not ended ones)."""
        self._write(
            "UPDATE ranks SET state='disconnected' WHERE job=:job AND rank=:rank AND state='connected'",
            [{"job": job, "rank": rank} for job, rank in ranks],
        )

    def end_job(self, job: str, now: float) -> None:
        self._write("UPDATE jobs SET ended_at=:ended_at WHERE job=:job", {"ended_at": now, "job": job})

    def end_job_if_done(self, job: str, now: float) -> None:
        """Mark the job ended when every rank the store has of it said goodbye (on any worker or replica)."""
        self._write(
            """UPDATE jobs SET ended_at=:ended_at WHERE job=:job AND ended_at IS NULL AND NOT EXISTS
               (SELECT 1 FROM ranks WHERE ranks.job=:job AND ranks.state <> 'ended')""",
            {"ended_at": now, "job": job},
        )

    def heartbeat(self, now: float | None = None) -> list[str]:
        """Say this process is alive, and forget processes that are not (not seen for the timeout, or gone
        from this host); returns those forgotten: the ranks they left connected read as lost from now."""
        at = time.time() if now is None else now

        def beat(conn: Connection) -> list[str]:
            conn.execute(text(_HEARTBEAT), {"holder": self.holder, "now": at})
            others = conn.execute(
                text("SELECT holder, seen_at FROM holders WHERE holder <> :holder"), {"holder": self.holder}
            ).all()
            gone = [h for h, seen in others if seen < at - HOLDER_TIMEOUT_SECONDS or gone_here(h)]
            for h in gone:
                conn.execute(text("DELETE FROM holders WHERE holder=:h"), {"h": h})
            return gone

        with self._writing():
            gone = self.transactions.run(beat)
        return gone

    def add_plan(self, *, job: str, rank: int, plan: PlanRow, now: float) -> None:
        self._write(_ADD_PLAN, plan_params(job, rank, plan, now))

    def add_stats(self, *, job: str, rank: int, row: LastStepRow) -> None:
        """Buffer one step's statistics; written within ``flush_seconds``."""
        if self.buffer.add(job=job, rank=rank, row=row):
            self.flush()

    def add_oom(self, *, job: str, rank: int, row: OomRow) -> None:
        self._write(_ADD_OOM, OOM_EVENTS.values({**row, "job": job, "rank": rank}))

    def set_controls(self, job: str, controls: ControlsRow, now: float) -> int:
        """Replace a job's operator controls; returns their new revision."""

        def replace(conn: Connection) -> int:
            if conn.dialect.name == "postgresql":
                # Numbered and committed one writer at a time, every process's: otherwise two writes read the same
                # newest revision, or a lower one commits after a poller read a higher (``controls_since``), and a
                # replica that polled between never sees it.
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _CONTROLS_LOCK})
            conn.execute(text(_SET_CONTROLS), controls_params(job, controls, now))
            revision = conn.execute(text("SELECT revision FROM job_controls WHERE job=:job"), {"job": job}).scalar_one()
            return int(revision)

        with self._writing():
            return self.transactions.run(replace)

    def remember_warm_plan(self, row: WarmPlanRow) -> None:
        """Keep ``row`` as the plan the next job of its model, device and size starts from."""
        self._write(_REMEMBER_WARM, warm_params(row))

    def save_learned(self, *, job: str, rank: int, state: dict[str, object], now: float) -> None:
        """What a rank's controller learned, kept beside its plan history for a restarted service."""
        self._write(_SAVE_LEARNED, {"job": job, "rank": rank, "state": dumps(state), "updated_at": now})
