"""What the core writes of a rank, and on which thread: all of it through one ``StoreWriter``, in
the order it was decided, with no lock of the core held.

A step's statistics go into the store's write-behind buffer at once (memory; a read right after the
step sees them); a full buffer, a new plan, an OOM or a plan to remember for warm starts are handed
to the writer, and the stream is answered without waiting for them. A hello and a stream's end wait
for their writes, after everything handed over before them.
"""

from __future__ import annotations

import logging
import threading
import time

from rematd.planner.messages import Hello
from rematd.server.core.plan_policy import mode_names, shape_bucket, shape_plan_row
from rematd.server.core.sessions import DISCONNECTED, ENDED, RankSession
from rematd.server.store.rows import LastStepRow, OomRow, PlanRow, WarmPlanRow
from rematd.server.store.store import Store
from rematd.server.store.writer import StoreWriter

log = logging.getLogger("rematd.server")

DURABLE_SECONDS = 5.0
"""How long a rank's answer waits for its plan or OOM event to reach the store before it goes out anyway."""


def warm_row(session: RankSession, now: float) -> WarmPlanRow | None:
    """What ``Store.remember_warm_plan`` keeps of the plan the rank holds (None without a fingerprint).
    Taken when it is decided: the writer may run after the rank was sent another plan."""
    h = session.hello
    if not h.model_fingerprint:
        return None
    n = len(h.blocks)
    return WarmPlanRow(
        model_fingerprint=h.model_fingerprint,
        device=h.device_name,
        shape_bucket=shape_bucket(h.profile_shape.tokens),
        job=h.job_id,
        blocks=list(session.sent.blocks),
        num_blocks=n,
        budget_bytes=session.planner.budget_bytes,
        modes=mode_names(session.sent.block_modes(n)),
        shape_plans=[shape_plan_row(e) for e in session.sent.shape_plans],
        updated_at=now,
    )


class RankWrites:
    """The writes of the training side."""

    def __init__(self, store: Store, writer: StoreWriter) -> None:
        self.store = store
        self.writer = writer
        self._flush_lock = threading.Lock()
        self._flush_queued = False

    def opened(self, hello: Hello, now: float, plan: PlanRow | None) -> None:
        """A rank's hello: its job, the rank as connected, the plan it starts on; waited for (raises)."""
        self.writer.call(
            f"the hello of rank {hello.rank} of job {hello.job_id}",
            lambda: self.store.open_rank(
                job=hello.job_id,
                rank=hello.rank,
                now=now,
                world_size=hello.world_size,
                num_blocks=len(hello.blocks),
                budget_bytes=hello.budget_bytes,
                fingerprint=hello.model_fingerprint,
                device=hello.device_name,
                plan=plan,
            ),
        )

    def stats(self, job: str, rank: int, row: LastStepRow) -> None:
        if self.store.buffer.add(job=job, rank=rank, row=row):
            self._flush_soon()

    def plan(self, session: RankSession, row: PlanRow, now: float) -> None:
        """A plan the rank is sent; the stream waits for it (:meth:`durable`) before it sends it."""
        h = session.hello
        ticket = self.writer.submit(f"plan {row['version']} of rank {h.rank} of job {h.job_id}",
                                    lambda: self._write_plan(session, row, now))  # fmt: skip
        session.unwritten = max(session.unwritten, ticket)

    def remember(self, warm: WarmPlanRow) -> None:
        self.writer.submit(f"the warm-start plan of job {warm['job']}", lambda: self.store.remember_warm_plan(warm))

    def oom(self, session: RankSession, row: OomRow) -> None:
        """An OOM event; the stream waits for it (:meth:`durable`) before it answers the OOM."""
        job, rank = session.hello.job_id, session.hello.rank
        ticket = self.writer.submit(
            f"an OOM of rank {rank} of job {job}", lambda: self.store.add_oom(job=job, rank=rank, row=row)
        )
        session.unwritten = max(session.unwritten, ticket)

    def durable(self, session: RankSession, timeout: float = DURABLE_SECONDS) -> bool:
        """Wait until the plans and OOM events of the rank handed over so far are in the store (or failed,
        logged and counted): what a rank is answered with survives a crash of the service right after.
        False if the store took longer than ``timeout``: the answer goes out all the same, since a rank
        that ran out of memory must not wait on a slow disk for its tighter plan."""
        ticket = session.unwritten
        if self.writer.wait(ticket, timeout):
            return True
        log.warning(
            "job %s rank %d: answered before the store took its plan or OOM event (still queued after %.0f s)",
            session.hello.job_id, session.hello.rank, timeout,
        )  # fmt: skip
        return False

    def ended(self, session: RankSession, *, ended: bool, warm: WarmPlanRow | None) -> None:
        """A stream's end, after everything the stream handed over; waited for (raises)."""
        self.writer.call(f"the end of rank {session.hello.rank} of job {session.hello.job_id}",
                         lambda: self._write_end(session, ended, warm))  # fmt: skip

    # -- on the writer's thread ----------------------------------------------------

    def _flush_soon(self) -> None:
        """Write the full buffer on the writer's thread: once, however many steps find it full meanwhile."""
        with self._flush_lock:
            if self._flush_queued:
                return
            self._flush_queued = True

        def flush() -> None:
            with self._flush_lock:
                self._flush_queued = False
            self.store.flush()

        self.writer.submit("buffered statistics", flush)

    def _write_end(self, session: RankSession, ended: bool, warm: WarmPlanRow | None) -> None:
        job, rank = session.hello.job_id, session.hello.rank
        if warm is not None:
            self.store.remember_warm_plan(warm)
        self.store.set_rank_state(job=job, rank=rank, state=ENDED if ended else DISCONNECTED)
        try:
            self._save_learned(session, time.time())
        except Exception as err:  # the rank's end still counts; the last plan's state stays recorded
            log.warning("job %s rank %d: what its controller learned was not saved: %s", job, rank, err)
        if ended:
            # Every rank said goodbye (here and on other workers): the job ended now.
            self.store.end_job_if_done(job, time.time())

    def _write_plan(self, session: RankSession, row: PlanRow, now: float) -> None:
        self.store.add_plan(job=session.hello.job_id, rank=session.hello.rank, plan=row, now=now)
        self._save_learned(session, now)

    def _save_learned(self, session: RankSession, now: float) -> None:
        """Kept with each plan and when a stream ends: a restarted service continues from it instead of
        relearning by issuing the same loosening (and its undoing) again."""
        with session.planning:
            state = session.planner.controller.export_state()
        self.store.save_learned(job=session.hello.job_id, rank=session.hello.rank, state=state, now=now)
