"""The store: jobs, their ranks, plans, step statistics, OOM events, operator controls and warm-start
plans, in SQLite by default or PostgreSQL by URL.

SQLAlchemy Core over hand-written, numbered migrations (``schema``). Every write of this process takes
one lock (SQLite has one writer; PostgreSQL gets the same serialisation per process, which is cheap
because the write-behind buffer turns many small writes into few transactions); reads take none.
Plans, OOM events and operator controls are written at once (a restart loses none); step statistics
go through the write-behind buffer (``write_behind``), written at least every ``flush_seconds``.
Reads of what that buffer holds (statistics, ranks' last steps, jobs) write it first, so they see
every write before them; other reads do not wait on it.

A slow database, for a test without a mock: a ``before_cursor_execute`` listener on
``Store.engine`` runs before every statement the store sends, the write-behind buffer's included.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy import exc as sa_exc

from rematd.server.config import StoreConfig
from rematd.server.store import schema
from rematd.server.store.columns import (
    Params,
    as_int,
    as_row,
    controls_out,
    controls_params,
    decoded,
    dumps,
    loads,
    plan_out,
    plan_params,
    warm_params,
    warm_plan_out,
)
from rematd.server.store.compaction import compact
from rematd.server.store.database import StoreError, database_url, dialect_of, open_engine, unpooled, warm, why
from rematd.server.store.file_watch import FileWatch, Keeper, check_journal, sqlite_file
from rematd.server.store.holders import HOLDER_TIMEOUT_SECONDS, RANK_STATE, gone_here, new_holder
from rematd.server.store.rows import (
    ControlsRow,
    JobRow,
    LastStepRow,
    OomRow,
    PlanRow,
    RankRow,
    StoredControlsRow,
    StoredOomRow,
    StoredPlanRow,
    StoredStepRow,
    WarmPlanRow,
)
from rematd.server.store.tables import JOB_CONTROLS, JOBS, OOM_EVENTS, PLANS, RANKS, WARM_PLANS
from rematd.server.store.write_behind import WriteBehind
from rematd.server.store.write_probe import WriteProbe

log = logging.getLogger("rematd.server")

_PLANS = "SELECT plans.*, jobs.num_blocks AS job_blocks FROM plans JOIN jobs ON jobs.job = plans.job"

_NOT_ID_JOB = ("id", "job")

_UPSERT_JOB = JOBS.insert()
_UPSERT_RANK = RANKS.insert()
_RANKS = f"SELECT job, rank, device, {RANK_STATE} AS state, last_stats FROM ranks"
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


def _rank_lock(job: str, rank: int) -> int:
    """A PostgreSQL advisory lock's key for one (job, rank): hellos of a rank on two replicas, one at a time."""
    digest = hashlib.blake2b(f"{job}\0{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


_ADD_PLAN = PLANS.insert()
_ADD_OOM = OOM_EVENTS.insert()
_SET_CONTROLS = JOB_CONTROLS.insert()
_REMEMBER_WARM = WARM_PLANS.insert()

_SAVE_LEARNED = """INSERT INTO learned_state (job, rank, state, updated_at) VALUES (:job, :rank, :state, :updated_at)
    ON CONFLICT(job, rank) DO UPDATE SET state=excluded.state, updated_at=excluded.updated_at"""


def _opened(url: str, path: str, lock: threading.RLock) -> Engine:
    """An engine on ``url`` with the schema brought up to date; StoreError naming what is wrong."""
    try:
        file = sqlite_file(url)
        if file:
            check_journal(file)
        engine = open_engine(url)
        schema.migrate(engine, path=path, lock=lock)
    except StoreError:
        raise
    except (sa_exc.SQLAlchemyError, OSError, ImportError) as err:
        raise StoreError(why(err)) from err
    return engine


_PROBE = "INSERT INTO write_probe VALUES (1, :t) ON CONFLICT(id) DO UPDATE SET written_at = excluded.written_at"


class Store:
    """Thread-safe access to the store.

    ``engine`` (a SQLAlchemy ``Engine``) is the one every statement goes through; ``buffer`` holds
    step statistics not yet written.
    """

    def __init__(self, db: str | Path | StoreConfig) -> None:
        config = db if isinstance(db, StoreConfig) else StoreConfig(url=database_url(db))
        url = config.url if "://" in config.url else database_url(config.url)
        self.path = str(db) if not isinstance(db, StoreConfig) else url
        self.dialect = dialect_of(url)
        self.config = config
        self._lock = threading.RLock()
        self.engine = _opened(url, self.path, self._lock)
        """The SQLAlchemy engine every statement of the store goes through. Tests may listen to its events:
        ``sqlalchemy.event.listen(store.engine, "before_cursor_execute", slow)`` with a ``slow`` that sleeps
        makes a slow database without a mock (``slow(conn, cursor, statement, parameters, context, many)``)."""
        warm(self.engine)
        self.buffer = WriteBehind(self.engine, self._lock, config.max_buffered)
        file = sqlite_file(url)
        self.watch = FileWatch(file) if file else None
        """The SQLite file the store was opened on (None for PostgreSQL or memory)."""
        self.keeper = Keeper(file) if file else None
        self.failing_since: float | None = None
        """When (monotonic) writes to the store began to fail; None while they succeed."""
        self.last_failure = ""
        self.on_write_failure: Callable[[], None] | None = None
        """Called once per failed write (the core counts them in a metric)."""
        self._last_probe = 0.0
        self._probe_engine = unpooled(self.engine) if self.dialect != "sqlite" else None
        self._server_probe = WriteProbe(self._probe_server) if self.dialect != "sqlite" else None
        """A database server's probe writes, on a thread of their own from the start, each over a new connection
        (None for SQLite)."""
        self.lost = ""
        """Why the store's file is not the store any more ("" while it is): writes stop until it is back."""
        self.holder = new_holder()
        """This process's name on the ranks it opens (``holders``)."""
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="rematd-store-flush", daemon=True)
        self._flusher.start()
        if self._server_probe is not None:
            self._server_probe.start()  # the store's state is whole: a probe may record a failure in it

    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return schema.version(conn, self.path)

    def compact(self, now: float | None = None, live: Collection[str] = ()) -> dict[str, int]:
        """Down-sample old statistics and apply retention, keeping every row of the ``live`` jobs; returns rows
        deleted by kind."""
        self.flush()
        with self._writing(), self._lock, self.engine.begin() as conn:
            return compact(conn, self.config, time.time() if now is None else now, live, self._liveness())

    def close(self) -> None:
        """Write what is buffered and let go of the database; a store that cannot be written loses the
        buffered rows, said in one line of the log, rather than failing the shutdown."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server_probe is not None:
            self._server_probe.close()
        if self._probe_engine is not None:
            self._probe_engine.dispose()
        self._flusher.join(5)
        pending = self.pending()
        try:
            self.flush()
        except Exception as err:
            log.error("the store cannot be written (%s): %d buffered step report(s) are lost", why(err), pending)
        with contextlib.suppress(Exception):
            # A process that stopped holds nothing: a rank it left connected reads as lost at once.
            self._write("DELETE FROM holders WHERE holder=:holder", {"holder": self.holder})
        self.engine.dispose()
        if self.keeper is not None:
            if self.check_file():
                self._journal_aside()  # again: nothing may have reached it since, but nothing must be left
            self.keeper.close()
        if self.watch is not None:
            self.watch.close()

    # -- the health of writes ------------------------------------------------------------

    def check_file(self) -> str:
        """Look at the store's file (deleted, replaced, truncated?); returns why it is lost, or ""."""
        if self.watch is None:
            return ""
        problem = self.watch.problem()
        if problem and not self.lost:
            self._journal_aside()
            log.error(
                "%s; writes stop (step reports are kept in memory, the newest %d) until it is back or the service "
                "restarts",
                problem,
                self.buffer.max_buffered * 4,
            )
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            self.last_failure = problem
        elif self.lost and not problem:
            log.info("the database file %s is back; writes resume", self.watch.path)
        self.lost = problem
        return problem

    def _journal_aside(self) -> None:
        """The file moved away: its journal, which names the path, goes into the file itself now, so that
        whatever takes the path (another application's database) is not handed the store's pages."""
        if self.keeper is None or self.watch is None or not self.watch.moved:
            return
        with self._lock:
            emptied = self.keeper.empty_journal()
        if not emptied:
            log.error("the journal %s-wal could not be emptied into the store's own file", self.watch.path)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Track whether writes succeed: readiness and a metric show a store that cannot be written."""
        try:
            if self.lost:
                # Not into a file no name reaches, nor into a fresh empty one.
                raise StoreError(self.lost)
            yield
        except Exception as err:
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            self.last_failure = why(err)
            if self.on_write_failure is not None:
                self.on_write_failure()
            raise

    def writable(self, probe_every: float = 1.0) -> bool:
        """Whether the store takes writes, answered without waiting on the database. While writes to a SQLite
        file fail, a probe write (at most one per ``probe_every`` seconds) finds out when it takes them again,
        with or without traffic: only the probe clears a failure, since a write that changed nothing succeeds
        on a full disk too. A database server is probed on a thread of its own all the time
        (:class:`WriteProbe`), so that readiness fails while it cannot be reached, or does not answer, even
        when nothing else writes."""
        if self.check_file():
            return False
        if self._server_probe is not None:
            problem, since = self._server_probe.problem()
            if problem:
                if self.failing_since is None:
                    self.failing_since = since if since is not None else time.monotonic()
                self.last_failure = problem
            return not problem and self.failing_since is None
        if self.failing_since is None:
            return True
        now = time.monotonic()
        if now - self._last_probe >= probe_every:
            self._last_probe = now
            with contextlib.suppress(Exception):
                self._probe_write()
        return self.failing_since is None

    def stalled(self) -> str:
        """Why the database server is not answering, known without waiting on it ("" while it answers, and for
        SQLite): work that would wait on it should not start."""
        return self._server_probe.late() if self._server_probe is not None else ""

    def _probe_write(self) -> None:
        """A write of a new value (SQLite skips a write that leaves a row as it was); its success clears a
        failure."""
        with self._writing(), self._lock, self.engine.begin() as conn:
            conn.execute(text(_PROBE), {"t": time.time()})
        self.failing_since = None

    def _probe_server(self) -> None:
        """:meth:`_probe_write` over a connection opened for it, as a hello needs one when the pool must grow:
        a server out of connections refuses it while the pool's own still work, and the store is not ready."""
        assert self._probe_engine is not None
        with self._writing(), self._probe_engine.begin() as conn:
            conn.execute(text(_PROBE), {"t": time.time()})
        self.failing_since = None

    def _write(self, sql: str, params: Params | list[Params]) -> None:
        with self._writing(), self._lock, self.engine.begin() as conn:
            conn.execute(text(sql), params)

    def _read(self, sql: str, params: Params | None = None, *, fresh: bool = True) -> list[Params]:
        """Rows of a query; ``fresh`` (for what the buffer holds) writes the buffer first."""
        if fresh:
            try:
                self.flush()
            except Exception:  # a store that cannot be written can still be read: without the buffered rows
                log.warning("reading the store without its buffered rows: %s", self.last_failure)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql), params or {}).mappings()]

    def pending(self) -> int:
        return self.buffer.pending()

    def flush(self) -> None:
        """Write buffered statistics in one transaction (rows the database refuses are set aside)."""
        if self.buffer.idle():
            return
        if self.lost:
            self.buffer.bound()
        with self._writing():
            self.buffer.flush()

    # -- writes ----------------------------------------------------------------------

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
        with self._writing(), self._lock, self.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # Held to the transaction's end: a second replica's hello reads the rank once this one's is in.
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _rank_lock(job, rank)})
            row = conn.execute(text(_HELD_ELSEWHERE), {"job": job, "rank": rank, **self._liveness()}).first()
            held = str(row[0]) if row is not None and not gone_here(str(row[0])) else None
            if held is None:
                job_row: JobRow = {"job": job, "created_at": now, "updated_at": now, "ended_at": None,
                                   "world_size": world_size, "num_blocks": num_blocks, "budget_bytes": budget_bytes,
                                   "model_fingerprint": fingerprint, "device": device}  # fmt: skip
                conn.execute(text(_UPSERT_JOB), dict(job_row))
                rank_row: RankRow = {"job": job, "rank": rank, "device": device, "state": "connected",
                                     "last_stats": None}  # fmt: skip
                conn.execute(text(_UPSERT_RANK), {**rank_row, "holder": self.holder})
                if plan is not None:
                    conn.execute(text(_ADD_PLAN), plan_params(job, rank, plan, now))
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
        now = time.time() if now is None else now
        with self._writing(), self._lock, self.engine.begin() as conn:
            conn.execute(text(_HEARTBEAT), {"holder": self.holder, "now": now})
            others = conn.execute(
                text("SELECT holder, seen_at FROM holders WHERE holder <> :holder"), {"holder": self.holder}
            ).all()
            gone = [h for h, seen in others if seen < now - HOLDER_TIMEOUT_SECONDS or gone_here(h)]
            for h in gone:
                conn.execute(text("DELETE FROM holders WHERE holder=:h"), {"h": h})
        return gone

    def _liveness(self) -> Params:
        """The parameters of ``RANK_STATE``."""
        return {"holder": self.holder, "alive": time.time() - HOLDER_TIMEOUT_SECONDS}

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
        with self._writing(), self._lock, self.engine.begin() as conn:
            rev = int(conn.execute(text("SELECT COALESCE(MAX(revision), 0) FROM job_controls")).scalar() or 0) + 1
            conn.execute(text(_SET_CONTROLS), controls_params(job, controls, rev, now))
            return rev

    def remember_warm_plan(self, row: WarmPlanRow) -> None:
        """Keep ``row`` as the plan the next job of its model, device and size starts from."""
        self._write(_REMEMBER_WARM, warm_params(row))

    def save_learned(self, *, job: str, rank: int, state: dict[str, object], now: float) -> None:
        """What a rank's controller learned, kept beside its plan history for a restarted service."""
        self._write(_SAVE_LEARNED, {"job": job, "rank": rank, "state": dumps(state), "updated_at": now})

    # -- reads -----------------------------------------------------------------------

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

    def _flush_loop(self) -> None:
        """The write-behind thread: writes the buffer every ``flush_seconds`` until the store closes."""
        failing = False
        while not self._closed.wait(self.config.flush_seconds):
            try:
                self.check_file()
                self.flush()
            except Exception:  # the next round tries again; a lost database must not kill the thread
                if not failing:  # once per outage, not four times a second
                    log.error("writing step reports to the store failed (%s); retrying", self.last_failure)
                failing = True
            else:
                if failing and self.failing_since is None:
                    log.info("the store takes writes again")
                    failing = False
