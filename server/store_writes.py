"""The record's writes: a rank's hello and state, plans, statistics, OOM events, controls, warm plans,
what controllers learned; and the thread that writes the statistics buffer behind.

Plans, OOM events and operator controls are written at once (a restart loses none); step statistics
go through the write-behind buffer (``rematd.server.writebehind``), flushed at least every
``flush_seconds``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from sqlalchemy import text

from rematd.server.record import RecordAccess
from rematd.server.rows import controls_params, dumps, pack_table, packed, plan_params

log = logging.getLogger("rematd.server")

_UPSERT_JOB = """INSERT INTO jobs (job, created_at, updated_at, world_size, num_blocks, budget_bytes,
        model_fingerprint, device, ended_at)
    VALUES (:job, :now, :now, :ws, :nb, :b, :fp, :dev, NULL)
    ON CONFLICT(job) DO UPDATE SET updated_at=excluded.updated_at, world_size=excluded.world_size,
    num_blocks=excluded.num_blocks, budget_bytes=excluded.budget_bytes,
    model_fingerprint=excluded.model_fingerprint, device=excluded.device, ended_at=NULL"""
_UPSERT_RANK = """INSERT INTO ranks (job, rank, device, state) VALUES (:job, :rank, :device, :state)
    ON CONFLICT(job, rank) DO UPDATE SET device=excluded.device, state=excluded.state"""
_ADD_PLAN = """INSERT INTO plans (job, rank, version, checkpoint_every, blocks, predicted_peak_bytes,
    predicted_overhead_ratio, target_bytes, reason, created_at, modes, shape_plans)
    VALUES (:job, :rank, :version, :every, :blocks, :peak, :overhead, :target, :reason, :now, :modes, :table)"""
_ADD_OOM = """INSERT INTO oom_events (job, rank, step, time, seq_len, batch, plan_version, message)
    VALUES (:job, :rank, :step, :time, :seq_len, :batch, :plan_version, :message)"""
_OOM_COLUMNS = ("step", "time", "seq_len", "batch", "plan_version", "message")
_SET_CONTROLS = """INSERT INTO job_controls (job, pin_blocks, pin_every, margin_ratio, budget_bytes, ended_at,
    revision, updated_at, pin_modes) VALUES (:job, :pb, :pe, :mr, :bb, :ea, :rev, :now, :pm)
    ON CONFLICT(job) DO UPDATE SET pin_blocks=excluded.pin_blocks, pin_every=excluded.pin_every,
    pin_modes=excluded.pin_modes, margin_ratio=excluded.margin_ratio, budget_bytes=excluded.budget_bytes,
    ended_at=excluded.ended_at, revision=excluded.revision, updated_at=excluded.updated_at"""
_REMEMBER_WARM = """INSERT INTO warm_plans (model_fingerprint, device, shape_bucket, job, blocks, num_blocks,
    budget_bytes, updated_at, modes, shape_plans)
    VALUES (:fp, :dev, :bucket, :job, :blocks, :nb, :budget, :now, :modes, :table)
    ON CONFLICT(model_fingerprint, device, shape_bucket) DO UPDATE SET job=excluded.job,
    blocks=excluded.blocks, num_blocks=excluded.num_blocks, budget_bytes=excluded.budget_bytes,
    updated_at=excluded.updated_at, modes=excluded.modes, shape_plans=excluded.shape_plans"""
_SAVE_LEARNED = """INSERT INTO learned_state VALUES (:job, :rank, :state, :now)
    ON CONFLICT(job, rank) DO UPDATE SET state=excluded.state, updated_at=excluded.updated_at"""


class StoreWrites(RecordAccess):
    """What the core writes to the record."""

    _closed: threading.Event

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
        plan: dict[str, Any] | None = None,
    ) -> None:
        """A rank's hello, in one transaction: its job, the rank as connected, the plan it starts on."""
        with self._writing(), self._lock, self.engine.begin() as conn:
            conn.execute(
                text(_UPSERT_JOB),
                {"job": job, "now": now, "ws": world_size, "nb": num_blocks, "b": budget_bytes, "fp": fingerprint,
                 "dev": device},
            )  # fmt: skip
            conn.execute(text(_UPSERT_RANK), {"job": job, "rank": rank, "device": device, "state": "connected"})
            if plan is not None:
                conn.execute(text(_ADD_PLAN), plan_params(job, rank, plan, now))

    def set_rank_state(self, *, job: str, rank: int | None = None, state: str) -> None:
        if rank is None:
            self._write("UPDATE ranks SET state=:state WHERE job=:job", {"state": state, "job": job})
        else:
            self._write(
                "UPDATE ranks SET state=:state WHERE job=:job AND rank=:rank",
                {"state": state, "job": job, "rank": rank},
            )

    def end_job(self, job: str, now: float) -> None:
        self._write("UPDATE jobs SET ended_at=:now WHERE job=:job", {"now": now, "job": job})

    def end_job_if_done(self, job: str, now: float) -> None:
        """Mark the job ended when every rank the record has of it said goodbye (on any worker or replica)."""
        self._write(
            """UPDATE jobs SET ended_at=:now WHERE job=:job AND ended_at IS NULL AND NOT EXISTS
               (SELECT 1 FROM ranks WHERE ranks.job=:job AND ranks.state <> 'ended')""",
            {"now": now, "job": job},
        )

    def add_plan(self, *, job: str, rank: int, plan: dict[str, Any], now: float) -> None:
        self._write(_ADD_PLAN, plan_params(job, rank, plan, now))

    def add_stats(self, *, job: str, rank: int, row: dict[str, Any]) -> None:
        """Buffer one step's statistics; written within ``flush_seconds``. ``row["oom_risk"]`` is kept when
        present."""
        if self.buffer.add(job=job, rank=rank, row=row):
            self.flush()

    def add_oom(self, *, job: str, rank: int, row: dict[str, Any]) -> None:
        self._write(_ADD_OOM, {**{k: row[k] for k in _OOM_COLUMNS}, "job": job, "rank": rank})

    def set_controls(self, job: str, controls: dict[str, Any], now: float) -> int:
        """Replace a job's operator controls; returns their new revision."""
        with self._writing(), self._lock, self.engine.begin() as conn:
            rev = int(conn.execute(text("SELECT COALESCE(MAX(revision), 0) FROM job_controls")).scalar() or 0) + 1
            conn.execute(text(_SET_CONTROLS), controls_params(job, controls, rev, now))
            return rev

    def remember_warm_plan(
        self,
        *,
        fingerprint: str,
        device: str,
        bucket: int,
        job: str,
        blocks: Sequence[int],
        num_blocks: int,
        budget_bytes: int,
        now: float,
        modes: Sequence[str] | None = None,
        shape_plans: Sequence[dict[str, Any]] = (),
    ) -> None:
        self._write(
            _REMEMBER_WARM,
            {"fp": fingerprint, "dev": device, "bucket": bucket, "job": job, "blocks": dumps(list(blocks)),
             "nb": num_blocks, "budget": budget_bytes, "now": now, "modes": packed(modes),
             "table": pack_table(shape_plans)},
        )  # fmt: skip

    def save_learned(self, *, job: str, rank: int, state: dict[str, Any], now: float) -> None:
        """What a rank's controller learned, kept beside its plan history for a restarted service."""
        self._write(_SAVE_LEARNED, {"job": job, "rank": rank, "state": dumps(state), "now": now})

    def _flush_loop(self) -> None:
        """The write-behind thread: writes the buffer every ``flush_seconds`` until the store closes."""
        failing = False
        while not self._closed.wait(self.config.flush_seconds):
            try:
                self.check_file()
                self.flush()
            except Exception:  # the next round tries again; a lost database must not kill the thread
                if not failing:  # once per outage, not four times a second
                    log.error("writing step reports to the record failed (%s); retrying", self.last_failure)
                failing = True
            else:
                if failing and self.failing_since is None:
                    log.info("the record takes writes again")
                    failing = False
