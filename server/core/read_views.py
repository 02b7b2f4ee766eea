"""What the REST API reads: jobs with their ranks and the plan in force, and a job's plans, statistics
and OOM events, shaped (``views``) from the store and the live sessions.

A rank whose stream this process holds is read from memory; any other from the store's latest rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

from typing_extensions import Unpack

from rematd.planner import Plan, Shape
from rematd.planner.messages import InvalidMessage
from rematd.server.core.controls import require_job
from rematd.server.core.paging import JOBS_PAGE, ROWS_PAGE, Page, decode, encode
from rematd.server.core.plan_policy import entry_in_force, mode_names
from rematd.server.core.sessions import CONNECTED, ENDED, Sessions
from rematd.server.core.views import (
    JOB_STATES,
    MODES_PER_BLOCK,
    PAGE_MODES,
    STATS_ROWS,
    InForce,
    JobState,
    JobView,
    ModePrice,
    RankView,
    StatsQuery,
)
from rematd.server.figures import headroom_ratio, job_oom_risk, job_peak
from rematd.server.store.rows import (
    ControlsRow,
    JobRow,
    LastStepRow,
    ModeName,
    RankRow,
    StoredOomRow,
    StoredPlanRow,
    StoredStepRow,
)
from rematd.server.store.store import Store


@dataclass(frozen=True, slots=True)
class _Live:
    """A live rank's plan and risk, as read under the registry's lock."""

    sent: Plan
    """The plan the rank is sent (it applies it at its next step)."""
    num_blocks: int
    oom_risk: float
    prices: list[dict[str, object]]
    ran: Plan | None = None
    """The plan its last step ran, at that step's length; None before its first step."""

    def modes(self, last: LastStepRow | None) -> list[ModeName]:
        """What the rank's last step ran: the plan it ran; before any step, the plan it has."""
        if self.ran is not None:
            return mode_names(self.ran.modes)
        if not last or not last["seq_len"]:
            return mode_names(self.sent.block_modes(self.num_blocks))
        tokens = last["seq_len"] * (last["batch"] or 1)
        shape = Shape(batch=last["batch"] or 1, seq_len=last["seq_len"], tokens=tokens)
        return mode_names(self.sent.modes_for(shape, self.num_blocks))


def _job_state(row: JobRow, ranks: list[RankRow]) -> JobState:
    states = {r["state"] for r in ranks}
    if row["ended_at"] is not None or (states and states == {ENDED}):
        return "ended"
    return "running" if CONNECTED in states else "disconnected"


def _rank_view(r: RankRow, live: _Live | None, own_plan: StoredPlanRow | None, ended: bool) -> RankView:
    """One rank: from memory where this process holds its stream, else from the store (its last step, and the
    newest plan it was sent, which is written before it is sent)."""
    last = r["last_stats"]
    modes: list[ModeName] | None = None
    if last and last.get("modes"):
        modes = last["modes"]  # it ran modes of its own (a pin in its process, or its job's agreed plan)
    elif live is not None:
        modes = live.modes(last)
    elif own_plan is not None:
        # Not live: what the rank's own last plan runs (the job's newest may be another rank's).
        seq = last["seq_len"] if last else None
        modes = entry_in_force(own_plan, seq, seq * (last["batch"] or 1) if last and seq else 0)["modes"]
    return RankView(
        rank=r["rank"],
        connected=r["state"] == CONNECTED,
        state=r["state"],
        device=r["device"],
        last_stats=last,
        plan_version=_plan_version(live, own_plan, last),
        modes=modes,
        checkpointed_blocks=[i for i, m in enumerate(modes) if m != "store"] if modes is not None else None,
        # An ended job carries no live risk: what it last measured is history.
        oom_risk=None if ended else (live.oom_risk if live else (last.get("oom_risk") if last else None)),
        prices=cast("list[ModePrice]", live.prices) if live else None,
        served_here=live is not None,
        figures_at=last["time"] if last else None,
    )


def _plan_version(live: _Live | None, own_plan: StoredPlanRow | None, last: LastStepRow | None) -> int | None:
    if live is not None:
        return (live.ran or live.sent).version
    if own_plan is not None:
        return int(own_plan["version"])
    return last["plan_version"] if last else None


def _newest_step(ranks: list[RankRow]) -> LastStepRow | None:
    """The job's newest step over its ranks (by step, then time)."""
    steps = [r["last_stats"] for r in ranks if r["last_stats"]]
    return max(steps, key=lambda s: (s["step"], s["time"])) if steps else None


def _in_force(
    plan: StoredPlanRow | None, newest: LastStepRow | None, by_version: dict[int, StoredPlanRow]
) -> InForce | None:
    """What the job's newest step ran: the plan of the version it reported (of ``by_version``; the job's newest
    plan, ``plan``, when it is not among them), at its length."""
    if plan is None:
        return None
    if newest is not None and newest["plan_version"]:
        plan = by_version.get(newest["plan_version"], plan)
    seq = newest["seq_len"] if newest else None
    ran = newest.get("modes") if newest else None
    if newest is not None and ran is not None:
        # The ranks ran modes of their own: those are in force, with what they were predicted to keep.
        return InForce(
            version=newest["plan_version"],
            seq_len=seq,
            max_seq_len=None,
            modes=ran,
            predicted_peak_bytes=newest["predicted_peak_bytes"],
            predicted_overhead_ratio=newest.get("predicted_overhead_ratio", 0.0),
            lossy="compress" in ran,
            source="ranks",
        )
    tokens = seq * (newest["batch"] or 1) if newest and seq else None
    entry = entry_in_force(plan, seq, tokens)
    return InForce(
        version=int(plan["version"]), seq_len=seq, lossy="compress" in entry["modes"], source="plan", **entry
    )


class ReadViews:
    """Reads of the store joined with what the live sessions hold now.

    ``settle`` is called before each read: it waits for the writes handed over before the read, so
    that a read sees what the streams sent until then.
    """

    def __init__(
        self,
        store: Store,
        sessions: Sessions,
        *,
        job_controls: Callable[[str], ControlsRow],
        settle: Callable[[], object],
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.job_controls = job_controls
        self.settle = settle

    def _require_job(self, job: str) -> JobRow:
        self.settle()
        return require_job(self.store, job)

    def list_jobs(self, state: str | None = None) -> list[JobView]:
        return self.jobs_page(state, limit=None).rows

    def jobs_page(
        self, state: str | None = None, *, limit: int | None = JOBS_PAGE, cursor: str | None = None
    ) -> Page[JobView]:
        """Jobs in the order they were created: ``limit`` of them after ``cursor`` (all with ``limit`` None)."""
        if state is not None and state not in JOB_STATES:
            raise InvalidMessage("state", f"must be one of {JOB_STATES}, got {state!r}")
        after = decode(cursor, list)
        self.settle()
        ranks: dict[str, list[RankRow]] = {}
        for r in self.store.all_ranks():
            ranks.setdefault(r["job"], []).append(r)
        plans = self.store.latest_plans()
        rank_plans: dict[str, dict[int, StoredPlanRow]] = {}
        for (job, rank), p in self.store.latest_rank_plans().items():
            rank_plans.setdefault(job, {})[rank] = p
        ooms = self.store.oom_counts()
        views: list[JobView] = []
        last: list[float | str] = []
        for row in self.store.jobs():
            position: list[float | str] = [row["created_at"], row["job"]]
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

    def get_job(self, job: str) -> JobView:
        row = self._require_job(job)
        plans = self.store.plans(job)
        own = {int(p["rank"]): p for p in plans}  # in the order they were made: each rank's last wins
        return self.job_view(
            row, self.store.ranks(job), plans[-1] if plans else None, len(self.store.ooms(job)), own, plans
        )

    def job_view(
        self,
        row: JobRow,
        ranks: list[RankRow],
        plan: StoredPlanRow | None,
        ooms: int,
        rank_plans: dict[int, StoredPlanRow],
        plans: list[StoredPlanRow] | None = None,
    ) -> JobView:
        """A job as the REST API shows it; ``plan`` is the job's newest, ``rank_plans`` each rank's own newest,
        ``plans`` (when read) every plan it kept, among them the one its newest step ran."""
        job = row["job"]
        state = _job_state(row, ranks)
        ended = state == "ended"
        live = self._live(job)
        rank_views = [_rank_view(r, live.get(r["rank"]), rank_plans.get(r["rank"]), ended) for r in ranks]
        peak = job_peak(r["last_stats"]["peak_bytes"] if r["last_stats"] else None for r in ranks)
        return JobView(
            job=job,
            state=state,
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            ended_at=row["ended_at"],
            world_size=row["world_size"],
            num_blocks=row["num_blocks"],
            budget_bytes=row["budget_bytes"],
            model_fingerprint=row["model_fingerprint"],
            device=row["device"],
            ranks=rank_views,
            plan=plan,
            in_force=_in_force(plan, _newest_step(ranks), {int(p["version"]): p for p in plans or ()}),
            peak_bytes=peak,
            headroom_ratio=headroom_ratio(row["budget_bytes"], peak),
            oom_risk=job_oom_risk((v["oom_risk"] for v in rank_views), ended=ended),
            oom_events=ooms,
            recompiles=sum(r["last_stats"].get("recompiles_total", 0) for r in ranks if r["last_stats"]),
            controls=self.job_controls(job),
        )

    def _live(self, job: str) -> dict[int, _Live]:
        """What the job's ranks streaming to this process hold now, copied under the lock: HTTP reads run on
        a thread pool while the event loop adds ranks. A rank whose stream went (resumable here, or moved to
        another worker or replica since) is read from the store, which has its newest step and plan."""
        with self.sessions.lock:
            return {
                s.hello.rank: _Live(s.sent, len(s.hello.blocks), s.planner.oom_risk, s.planner.prices(), s.ran)
                for s in self.sessions.by_job.get(job, {}).values()
                if s.streams > 0
            }

    def job_plans(self, job: str) -> list[StoredPlanRow]:
        self._require_job(job)
        return self.store.plans(job)

    def plans_page(self, job: str, *, limit: int = ROWS_PAGE, cursor: str | None = None) -> Page[StoredPlanRow]:
        """A job's plans, oldest first: ``limit`` of them after ``cursor``, fewer for a wide model (at most about
        ``PAGE_MODES`` modes a page: a plan holds a mode per block at each length of its table)."""
        after = decode(cursor, int) or 0
        row = self._require_job(job)
        limit = min(limit, max(1, PAGE_MODES // (max(1, int(row["num_blocks"])) * MODES_PER_BLOCK)))
        return _by_id(self.store.plans(job, after=after, limit=limit + 1), limit)

    def job_stats(self, job: str, **query: Unpack[StatsQuery]) -> list[StoredStepRow]:
        """A job's latest ``limit`` steps (``STATS_ROWS`` unless given), within ``since``-``until`` and of
        ``rank`` where given."""
        self._require_job(job)
        since, until = query.get("since"), query.get("until")
        if since is not None and until is not None and since > until:
            raise InvalidMessage("since", f"since ({since}) is after until ({until})")
        return self.store.stats(job, query.get("limit", STATS_ROWS), since=since, until=until, rank=query.get("rank"))

    def job_ooms(self, job: str) -> list[StoredOomRow]:
        self._require_job(job)
        return self.store.ooms(job)

    def ooms_page(self, job: str, *, limit: int = ROWS_PAGE, cursor: str | None = None) -> Page[StoredOomRow]:
        """A job's OOM events, oldest first: ``limit`` of them after ``cursor``."""
        after = decode(cursor, int) or 0
        self._require_job(job)
        return _by_id(self.store.ooms(job, after=after, limit=limit + 1), limit)


_Paged = TypeVar("_Paged", StoredPlanRow, StoredOomRow)


def _by_id(rows: list[_Paged], limit: int) -> Page[_Paged]:
    """A page of rows read one past ``limit``, without the row ids a paged read of the store adds to them."""
    more = len(rows) > limit
    rows = rows[:limit]
    ids = [cast(dict[str, int], r).pop("id") for r in rows]
    return Page(rows, encode(ids[-1] if ids else 0) if more else None)
