"""The record's reads, for the core, the REST views and a restarted service.

Reads of what the write-behind buffer holds (statistics, ranks' last steps, jobs) write it first,
so they see every write before them; other reads do not wait on it.
"""

from __future__ import annotations

from typing import Any

from rematd.server.record import RecordAccess
from rematd.server.rows import controls_out, decoded, loads, plan_out, warm_plan_out

# A plan's rows, with the job's block count for plans recorded before modes were kept.
_PLANS = "SELECT plans.*, jobs.num_blocks AS job_blocks FROM plans JOIN jobs ON jobs.job = plans.job"
_NOT_ID_JOB = ("id", "job")


class StoreReads(RecordAccess):
    """What the record holds, as dicts of plain values."""

    def jobs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._read("SELECT * FROM jobs ORDER BY created_at, job")]

    def job(self, job: str) -> dict[str, Any] | None:
        rows = self._read("SELECT * FROM jobs WHERE job=:job", {"job": job})
        return dict(rows[0]) if rows else None

    def all_ranks(self) -> list[dict[str, Any]]:
        return [decoded(r, json_columns=("last_stats",)) for r in self._read("SELECT * FROM ranks ORDER BY job, rank")]

    def ranks(self, job: str) -> list[dict[str, Any]]:
        rows = self._read("SELECT * FROM ranks WHERE job=:job ORDER BY rank", {"job": job})
        return [decoded(r, json_columns=("last_stats",)) for r in rows]

    def last_rank_stats(self, job: str, rank: int) -> dict[str, Any] | None:
        """A rank's last statistics: the buffer's newest if it holds one, else the record's. The buffer is
        not written first: a hello must not wait for other jobs' rows."""
        pending = self.buffer.last(job, rank)
        if pending is not None:
            return pending
        rows = self._read(
            "SELECT last_stats FROM ranks WHERE job=:job AND rank=:rank", {"job": job, "rank": rank}, fresh=False
        )
        found: dict[str, Any] | None = loads(rows[0]["last_stats"]) if rows else None
        return found

    def plans(self, job: str, *, after: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        """A job's plans, oldest first: all, or ``limit`` of those recorded after row ``after`` (each with its
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

    def latest_rank_plans(self) -> dict[tuple[str, int], dict[str, Any]]:
        """Each rank's newest plan, by (job, rank)."""
        rows = self._read(f"{_PLANS} WHERE plans.id IN (SELECT MAX(id) FROM plans GROUP BY job, rank)", fresh=False)
        out = {}
        for r in rows:
            d = plan_out(r, ("id",))
            out[(d.pop("job"), int(d["rank"]))] = d
        return out

    def latest_plans(self) -> dict[str, dict[str, Any]]:
        """Each job's newest plan."""
        rows = self._read(f"{_PLANS} WHERE plans.id IN (SELECT MAX(id) FROM plans GROUP BY job)", fresh=False)
        out = {}
        for r in rows:
            d = plan_out(r, ("id",))
            out[d.pop("job")] = d
        return out

    def last_plan_version(self, job: str, rank: int) -> int:
        rows = self._read(
            "SELECT MAX(version) AS v FROM plans WHERE job=:job AND rank=:rank",
            {"job": job, "rank": rank},
            fresh=False,
        )
        return int(rows[0]["v"] or 0)

    def last_plan(self, job: str, rank: int) -> dict[str, Any] | None:
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
    ) -> list[dict[str, Any]]:
        """A job's latest ``limit`` steps, oldest first; ``oom_risk`` is None on rows that did not carry it."""
        where = ["job=:job"]
        params: dict[str, Any] = {"job": job, "limit": limit}
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
        return [decoded(r, drop=_NOT_ID_JOB) for r in rows]

    def count_stats(self, job: str | None = None) -> int:
        if job is None:
            rows = self._read("SELECT COUNT(*) AS n FROM stats")
        else:
            rows = self._read("SELECT COUNT(*) AS n FROM stats WHERE job=:job", {"job": job})
        return int(rows[0]["n"])

    def ooms(self, job: str, *, after: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        """A job's OOM events, oldest first: all, or ``limit`` of those recorded after row ``after`` (each with
        its row ``id`` then)."""
        if limit is None:
            rows = self._read("SELECT * FROM oom_events WHERE job=:job ORDER BY id", {"job": job}, fresh=False)
            return [decoded(r, drop=_NOT_ID_JOB) for r in rows]
        rows = self._read(
            "SELECT * FROM oom_events WHERE job=:job AND id > :after ORDER BY id LIMIT :n",
            {"job": job, "after": after, "n": limit},
            fresh=False,
        )
        return [decoded(r, drop=("job",)) for r in rows]

    def oom_counts(self) -> dict[str, int]:
        return {
            r["job"]: int(r["n"])
            for r in self._read("SELECT job, COUNT(*) AS n FROM oom_events GROUP BY job", fresh=False)
        }

    def controls_since(self, revision: int) -> list[dict[str, Any]]:
        """Controls changed after ``revision`` (every worker and replica polls this)."""
        rows = self._read(
            "SELECT * FROM job_controls WHERE revision > :r ORDER BY revision", {"r": revision}, fresh=False
        )
        return [controls_out(r) for r in rows]

    def warm_plan(self, *, fingerprint: str, device: str, bucket: int) -> dict[str, Any] | None:
        rows = self._read(
            "SELECT * FROM warm_plans WHERE model_fingerprint=:fp AND device=:dev AND shape_bucket=:bucket",
            {"fp": fingerprint, "dev": device, "bucket": bucket},
            fresh=False,
        )
        return warm_plan_out(rows[0]) if rows else None

    def learned(self, *, job: str, rank: int) -> dict[str, Any] | None:
        rows = self._read(
            "SELECT state FROM learned_state WHERE job=:job AND rank=:rank", {"job": job, "rank": rank}, fresh=False
        )
        state = loads(rows[0]["state"]) if rows else None
        return state if isinstance(state, dict) else None
