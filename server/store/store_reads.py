"""The store's reads: jobs, ranks and their last steps, plans, step statistics, OOM events, operator
controls, warm-start plans and what a controller learned.

Reads take no lock. Reads of what the write-behind buffer holds (statistics, ranks' last steps, jobs) write it
first, so they see every write before them; other reads do not wait on it (``StoreConnection._read``).
"""

from __future__ import annotations

from rematd.server.store.columns import Params, as_int, as_row, controls_out, decoded, loads, plan_out, warm_plan_out
from rematd.server.store.connection import StoreConnection
from rematd.server.store.holders import RANK_STATE
from rematd.server.store.rows import (
    JobRow,
    LastStepRow,
    RankRow,
    StoredControlsRow,
    StoredOomRow,
    StoredPlanRow,
    StoredStepRow,
    WarmPlanRow,
)

_PLANS = "SELECT plans.*, jobs.num_blocks AS job_blocks FROM plans JOIN jobs ON jobs.job = plans.job"

_NOT_ID_JOB = ("id", "job")

_RANKS = f"SELECT job, rank, device, {RANK_STATE} AS state, last_stats FROM ranks"


class StoreReads(StoreConnection):
    """What the store reads; the writes are ``StoreWrites``."""

    def jobs(self) -> list[JobRow]:
        return [as_row(JobRow, r) for r in self._read("SELECT * FROM jobs ORDER BY created_at, job")]

    def job(self, job: str) -> JobRow | None:
        rows = self._read("SELECT * FROM jobs WHERE job=:job", {"job": job})
        return as_row(JobRow, rows[0]) if rows else None

    def all_ranks(self) -> list[RankRow]:
        return self._ranks(f"{_RANKS} ORDER BY job, rank", {})

    def ranks(self, job: str) -> list[RankRow]:
        return self._ranks(f"{_RANKS} WHERE job=:job ORDER BY rank", {"job": job})

    def _ranks(self, sql: str, params: Params) -> list[RankRow]:
        """Ranks as read: one its holder left connected when it died reads as disconnected (``holders``)."""
        rows = self._read(sql, {**params, **self._liveness()})
        return [as_row(RankRow, decoded(r, json_columns=("last_stats",))) for r in rows]

    def last_rank_stats(self, job: str, rank: int) -> LastStepRow | None:
        """A rank's last statistics: the buffer's newest if it holds one, else the store's. The buffer is
        not written first: a hello must not wait for other jobs' rows."""
        pending = self.buffer.last(job, rank)
        if pending is not None:
            return pending
        rows = self._read(
            "SELECT last_stats FROM ranks WHERE job=:job AND rank=:rank", {"job": job, "rank": rank}, fresh=False
        )
        found = loads(rows[0]["last_stats"]) if rows else None
        return as_row(LastStepRow, found) if isinstance(found, dict) else None

    def plans(self, job: str, *, after: int = 0, limit: int | None = None) -> list[StoredPlanRow]:
        """A job's plans, oldest first: all, or ``limit`` of those written after row ``after`` (each with its
        row ``id`` then)."""
        if limit is None:
            rows = self._read(f"{_PLANS} WHERE plans.job=:job ORDER BY plans.id", {"job": job}, fresh=False)
            return [plan_out(r) for r in rows]
        rows = self._read(
            f"{_PLANS} WHERE plans.job=:job AND plans.id > :after ORDER BY plans.id LIMIT :n",
            {"job": job, "after": after, "n": limit},
            fresh=False,
        )
        return [plan_out(r, ("job",)) for r in rows]

    def latest_rank_plans(self) -> dict[tuple[str, int], StoredPlanRow]:
        """Each rank's newest plan, by (job, rank)."""
        rows = self._read(f"{_PLANS} WHERE plans.id IN (SELECT MAX(id) FROM plans GROUP BY job, rank)", fresh=False)
        return {(str(r["job"]), p["rank"]): p for r in rows for p in (plan_out(r),)}

    def latest_plans(self) -> dict[str, StoredPlanRow]:
        """Each job's newest plan."""
        rows = self._read(f"{_PLANS} WHERE plans.id IN (SELECT MAX(id) FROM plans GROUP BY job)", fresh=False)
        return {str(r["job"]): plan_out(r) for r in rows}

    def last_plan_version(self, job: str, rank: int) -> int:
        rows = self._read(
            "SELECT MAX(version) AS v FROM plans WHERE job=:job AND rank=:rank",
            {"job": job, "rank": rank},
            fresh=False,
        )
        return as_int(rows[0]["v"] or 0)

    def last_plan(self, job: str, rank: int) -> StoredPlanRow | None:
        rows = self._read(
            f"{_PLANS} WHERE plans.job=:job AND plans.rank=:rank ORDER BY plans.id DESC LIMIT 1",
            {"job": job, "rank": rank},
            fresh=False,
        )
        return plan_out(rows[0]) if rows else None

    def stats(
        self,
        job: str,
        limit: int,
        *,
        since: float | None = None,
        until: float | None = None,
        rank: int | None = None,
    ) -> list[StoredStepRow]:
        """A job's latest ``limit`` steps, oldest first; ``oom_risk`` is None on rows that did not carry it."""
        where = ["job=:job"]
        params: Params = {"job": job, "limit": limit}
        bounds = {"since": ("time >=", since), "until": ("time <=", until), "rank": ("rank =", rank)}
        for name, (condition, value) in bounds.items():
            if value is not None:
                where.append(f"{condition} :{name}")
                params[name] = value
        rows = self._read(
            f"SELECT * FROM (SELECT * FROM stats WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT :limit) t "
            "ORDER BY id",
            params,
        )
        return [as_row(StoredStepRow, decoded(r, drop=_NOT_ID_JOB)) for r in rows]

    def count_stats(self, job: str | None = None) -> int:
        if job is None:
            rows = self._read("SELECT COUNT(*) AS n FROM stats")
        else:
            rows = self._read("SELECT COUNT(*) AS n FROM stats WHERE job=:job", {"job": job})
        return as_int(rows[0]["n"])

    def ooms(self, job: str, *, after: int = 0, limit: int | None = None) -> list[StoredOomRow]:
        """A job's OOM events, oldest first: all, or ``limit`` of those written after row ``after`` (each with
        its row ``id`` then)."""
        if limit is None:
            rows = self._read("SELECT * FROM oom_events WHERE job=:job ORDER BY id", {"job": job}, fresh=False)
            return [as_row(StoredOomRow, decoded(r, drop=_NOT_ID_JOB)) for r in rows]
        rows = self._read(
            "SELECT * FROM oom_events WHERE job=:job AND id > :after ORDER BY id LIMIT :n",
            {"job": job, "after": after, "n": limit},
            fresh=False,
        )
        return [as_row(StoredOomRow, decoded(r, drop=("job",))) for r in rows]

    def oom_counts(self) -> dict[str, int]:
        return {
            str(r["job"]): as_int(r["n"])
            for r in self._read("SELECT job, COUNT(*) AS n FROM oom_events GROUP BY job", fresh=False)
        }

    def controls_since(self, revision: int) -> list[StoredControlsRow]:
        """Controls changed after ``revision`` (every worker and replica polls this)."""
        rows = self._read(
            "SELECT * FROM job_controls WHERE revision > :r ORDER BY revision", {"r": revision}, fresh=False
        )
        return [controls_out(r) for r in rows]

    def warm_plan(self, *, fingerprint: str, device: str, bucket: int) -> WarmPlanRow | None:
        rows = self._read(
            "SELECT * FROM warm_plans WHERE model_fingerprint=:model_fingerprint AND device=:device "
            "AND shape_bucket=:shape_bucket",
            {"model_fingerprint": fingerprint, "device": device, "shape_bucket": bucket},
            fresh=False,
        )
        return warm_plan_out(rows[0]) if rows else None

    def learned(self, *, job: str, rank: int) -> dict[str, object] | None:
        rows = self._read(
            "SELECT state FROM learned_state WHERE job=:job AND rank=:rank", {"job": job, "rank": rank}, fresh=False
        )
        state = loads(rows[0]["state"]) if rows else None
        return state if isinstance(state, dict) else None
