"""What the REST API reads: jobs with their ranks and the plan in force, and a job's plans,
statistics and OOM events, shaped from the record and the live sessions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rematd.planner import Shape
from rematd.records import InvalidMessage
from rematd.server.controls import require_job
from rematd.server.paging import JOBS_PAGE, ROWS_PAGE, Page, decode, encode
from rematd.server.plan_policy import entry_in_force, mode_names
from rematd.server.sessions import CONNECTED, ENDED, Sessions
from rematd.server.store import Store

JOB_STATES = ("running", "disconnected", "ended")
STATS_ROWS = 2000
"""Rows a read of a job's statistics returns unless it asks for another number."""


class ReadViews:
    """Reads of the record joined with what the live sessions hold now.

    ``settle`` is called before each read: it waits for the writes handed over before the read, so
    that a read sees what the streams sent until then.
    """

    def __init__(
        self,
        store: Store,
        sessions: Sessions,
        *,
        job_controls: Callable[[str], dict[str, Any]],
        settle: Callable[[], object],
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.job_controls = job_controls
        self.settle = settle

    def _require_job(self, job: str) -> dict[str, Any]:
        self.settle()
        return require_job(self.store, job)

    def list_jobs(self, state: str | None = None) -> list[dict[str, Any]]:
        return self.jobs_page(state, limit=None).rows

    def jobs_page(self, state: str | None = None, *, limit: int | None = JOBS_PAGE, cursor: str | None = None) -> Page:
        """Jobs in the order they were created: ``limit`` of them after ``cursor`` (all with ``limit`` None)."""
        if state is not None and state not in JOB_STATES:
            raise InvalidMessage("state", f"must be one of {JOB_STATES}, got {state!r}")
        after = decode(cursor, list)
        self.settle()
        ranks: dict[str, list[dict[str, Any]]] = {}
        for r in self.store.all_ranks():
            ranks.setdefault(r["job"], []).append(r)
        plans = self.store.latest_plans()
        rank_plans: dict[str, dict[int, dict[str, Any]]] = {}
        for (job, rank), p in self.store.latest_rank_plans().items():
            rank_plans.setdefault(job, {})[rank] = p
        ooms = self.store.oom_counts()
        views: list[dict[str, Any]] = []
        last: list[Any] = []
        for row in self.store.jobs():
            position = [row["created_at"], row["job"]]
            if after is not None and position <= after:
                continue
            if limit is not None and len(views) == limit:
                return Page(views, encode(last))
            view = self.job_view(
                row, ranks.get(row["job"], []), plans.get(row["job"]), ooms.get(row["job"], 0),
                rank_plans.get(row["job"], {}),
            )  # fmt: skip
            last = position
            if state is None or view["state"] == state:
                views.append(view)
        return Page(views, None)

    def get_job(self, job: str) -> dict[str, Any]:
        row = self._require_job(job)
        plans = self.store.plans(job)
        own = {int(p["rank"]): p for p in plans}  # in the order they were made: each rank's last wins
        return self.job_view(row, self.store.ranks(job), plans[-1] if plans else None, len(self.store.ooms(job)), own)

    def job_view(
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
        with self.sessions.lock:
            live = {
                s.hello.rank: (s.sent, len(s.hello.blocks), s.planner.oom_risk, s.planner.prices())
                for s in self.sessions.by_job.get(job, {}).values()
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
                    # How sure the planner is of each mode's price (live ranks only).
                    "prices": now[3] if now else None,
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

    def plans_page(self, job: str, *, limit: int = ROWS_PAGE, cursor: str | None = None) -> Page:
        """A job's plans, oldest first: ``limit`` of them after ``cursor``."""
        after = decode(cursor, int) or 0
        self._require_job(job)
        return _by_id(self.store.plans(job, after=after, limit=limit + 1), limit)

    def job_stats(
        self,
        job: str,
        *,
        limit: int = STATS_ROWS,
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

    def ooms_page(self, job: str, *, limit: int = ROWS_PAGE, cursor: str | None = None) -> Page:
        """A job's OOM events, oldest first: ``limit`` of them after ``cursor``."""
        after = decode(cursor, int) or 0
        self._require_job(job)
        return _by_id(self.store.ooms(job, after=after, limit=limit + 1), limit)


def _by_id(rows: list[dict[str, Any]], limit: int) -> Page:
    """A page of rows read one past ``limit``, without their row ids."""
    more = len(rows) > limit
    rows = rows[:limit]
    last = rows[-1]["id"] if rows else 0
    for r in rows:
        del r["id"]
    return Page(rows, encode(last) if more else None)
