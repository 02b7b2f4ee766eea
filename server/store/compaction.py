"""Keeping the store small: old statistics down-sampled, and what is past retention deleted."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sqlalchemy import Connection, TextClause, bindparam, text

from rematd.server.config import StoreConfig
from rematd.server.store.holders import RANK_STATE

# Beyond the latest keep_steps per rank, keep the highest peak of each time bucket.
_DOWNSAMPLE = """DELETE FROM stats WHERE id IN (
    SELECT id FROM (
      SELECT id,
        ROW_NUMBER() OVER (PARTITION BY job, rank ORDER BY step DESC, id DESC) AS age,
        ROW_NUMBER() OVER (PARTITION BY job, rank, CAST(time / :bucket AS BIGINT)
                           ORDER BY peak_bytes DESC, id) AS pick
      FROM stats) t
    WHERE t.age > :keep AND t.pick > 1)"""
# A rank whose holder died (a ghost) keeps its job no more than any lost rank does.
_IDLE_JOBS = f"""SELECT job FROM jobs WHERE updated_at < :c AND job NOT IN :live AND NOT EXISTS
    (SELECT 1 FROM ranks WHERE ranks.job = jobs.job AND {RANK_STATE} = 'connected')"""
# Children before their job: the foreign keys point at it.
_JOB_TABLES = ("stats", "oom_events", "plans", "learned_state", "ranks", "job_controls", "jobs")


def _old(sql: str) -> TextClause:
    return text(sql).bindparams(bindparam("live", expanding=True))


def compact(
    conn: Connection,
    config: StoreConfig,
    now: float,
    live: Collection[str],
    liveness: Mapping[str, object],
) -> dict[str, int]:
    """Down-sample and apply retention in ``conn``'s transaction; returns rows deleted by kind. Nothing of the
    ``live`` jobs (a rank's session open or resumable) is deleted, however old, nor of a job with a rank
    connected to a live process (``liveness``: the parameters of ``RANK_STATE``)."""
    cutoff = now - config.retention_days * 86400.0
    # An empty list would read as NULL in NOT IN, which keeps every row: a name no job can have instead.
    keep = {"c": cutoff, "live": sorted(live) or [""], **liveness}
    sampled = conn.execute(text(_DOWNSAMPLE), {"bucket": config.bucket_seconds, "keep": config.keep_steps}).rowcount
    old_stats = conn.execute(_old("DELETE FROM stats WHERE time < :c AND job NOT IN :live"), keep).rowcount
    old_ooms = conn.execute(_old("DELETE FROM oom_events WHERE time < :c AND job NOT IN :live"), keep).rowcount
    idle = [r[0] for r in conn.execute(_old(_IDLE_JOBS), keep)]
    for job in idle:
        for table in _JOB_TABLES:
            conn.execute(text(f"DELETE FROM {table} WHERE job=:j"), {"j": job})
    conn.execute(text("DELETE FROM warm_plans WHERE updated_at < :c"), {"c": cutoff})
    return {"downsampled": sampled, "expired_stats": old_stats, "expired_ooms": old_ooms, "expired_jobs": len(idle)}
