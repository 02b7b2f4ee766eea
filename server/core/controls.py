"""An operator's controls of a job: pins, margin and budget overrides, ending it; kept in the store
and picked up from there by every other worker and replica."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from typing_extensions import TypedDict, Unpack

from rematd.planner import ControllerConfig, Mode, Plan, PlannerSession
from rematd.planner.messages import JOB_ID_RE, InvalidMessage
from rematd.server.core.errors import JobNotFound
from rematd.server.core.plan_policy import mode_names, modes_of, pinned_plan
from rematd.server.core.sessions import ENDED, RankSession, Sessions
from rematd.server.store.rows import ControlsRow, JobRow
from rematd.server.store.store import Store


class PinTarget(TypedDict, total=False):
    """The plan an operator pins, one of three ways, named as the controls keep them (``ControlsRow``)."""

    pin_every: int | None
    """Every k-th block recomputing (0: none)."""
    pin_blocks: list[int] | None
    """These blocks recomputing, the rest storing."""
    pin_modes: Sequence[str] | None
    """One mode per block."""


@dataclass(slots=True)
class Controls:
    """An operator's overrides for one job (persisted; shared by every worker through the store)."""

    pin_blocks: tuple[int, ...] | None = None
    pin_every: int | None = None
    margin_ratio: float | None = None
    budget_bytes: int | None = None
    ended_at: float | None = None
    pin_modes: tuple[Mode, ...] | None = None

    @property
    def pinned(self) -> bool:
        return self.pin_blocks is not None or self.pin_every is not None or self.pin_modes is not None

    def as_row(self, job: str) -> ControlsRow:
        return ControlsRow(
            job=job,
            pin_blocks=list(self.pin_blocks) if self.pin_blocks is not None else None,
            pin_modes=mode_names(self.pin_modes) if self.pin_modes is not None else None,
            pin_every=self.pin_every,
            margin_ratio=self.margin_ratio,
            budget_bytes=self.budget_bytes,
            ended_at=self.ended_at,
        )

    @classmethod
    def of_row(cls, row: ControlsRow) -> Controls:
        return cls(
            pin_blocks=tuple(row["pin_blocks"]) if row["pin_blocks"] is not None else None,
            pin_modes=modes_of(list(row["pin_modes"]), "pin_modes") if row["pin_modes"] is not None else None,
            pin_every=row["pin_every"],
            margin_ratio=row["margin_ratio"],
            budget_bytes=row["budget_bytes"],
            ended_at=row["ended_at"],
        )


def require_job(store: Store, job: str) -> JobRow:
    row = store.job(job) if JOB_ID_RE.fullmatch(job) else None
    if row is None:
        raise JobNotFound(job)
    return row


def tune_planner(planner: PlannerSession, controls: Controls | None) -> None:
    """A new rank's planner with its job's margin override (not yet shared: no lock needed)."""
    if controls is not None and controls.margin_ratio is not None:
        planner.controller.config = dataclasses.replace(planner.controller.config, margin_ratio=controls.margin_ratio)


class OperatorControls:
    """Every job's controls, as this worker last read or wrote them."""

    def __init__(self, store: Store, sessions: Sessions) -> None:
        self.store = store
        self.sessions = sessions
        self.by_job: dict[str, Controls] = {}
        self.revision = 0

    def get(self, job: str) -> Controls | None:
        return self.by_job.get(job)

    def pinned(self, session: RankSession) -> Plan | None:
        """The plan an operator pinned for the rank's job, versioned as what the rank has; None unpinned."""
        c = self.by_job.get(session.hello.job_id)
        if c is None or not c.pinned:
            return None
        return pinned_plan(
            session.planner,
            session.sent.version,
            len(session.hello.blocks),
            pin_modes=c.pin_modes,
            pin_every=c.pin_every,
            pin_blocks=c.pin_blocks,
        )

    def job_controls(self, job: str) -> ControlsRow:
        return (self.by_job.get(job) or Controls()).as_row(job)

    def reopen(self, job: str, now: float) -> None:
        """A job an operator ended comes back as a new run under the same name (a hello; not under a lock)."""
        c = self.by_job.get(job)
        if c is None or c.ended_at is None:
            return
        c = dataclasses.replace(c, ended_at=None)
        self.store.set_controls(job, c.as_row(job), now)
        with self.sessions.lock:
            self.by_job[job] = c

    def _copy(self, job: str) -> Controls:
        """The job's controls to change, as the store has them now: a pin another replica wrote since this one's
        last poll is kept by a tune written here (an operator's requests may reach a different replica each)."""
        self.refresh()
        return dataclasses.replace(self.by_job.get(job) or Controls())

    def _set(self, job: str, controls: Controls) -> None:
        # The revision polled from stays: a revision below this write's, of another process, may not have been read
        # yet (the next poll reads this write back too, the same controls).
        self.store.set_controls(job, controls.as_row(job), time.time())
        with self.sessions.lock:
            self.by_job[job] = controls
            retune = self._apply(job, controls)
        self._retune(retune)

    def pin(self, job: str, **target: Unpack[PinTarget]) -> ControlsRow:
        """Pin a job's plan until unpinned: every k-th block or a set of blocks recomputing, or one mode per block
        (named as the controls keep them, :class:`~rematd.server.store.rows.ControlsRow`)."""
        row = require_job(self.store, job)
        n = int(row["num_blocks"])
        pin_every, blocks, modes = target.get("pin_every"), target.get("pin_blocks"), target.get("pin_modes")
        if sum(x is not None for x in (pin_every, blocks, modes)) != 1:
            raise InvalidMessage("body", "give exactly one of pin_every, pin_blocks or pin_modes")
        pinned_modes: tuple[Mode, ...] | None = None
        if modes is not None:
            if len(modes) != n:
                raise InvalidMessage("pin_modes", f"give one mode per block: {n} for this job, got {len(modes)}")
            pinned_modes = modes_of(list(modes), "pin_modes")
            for s in self.sessions.of_job(job):
                options = s.planner.profile.options_at(None)
                missing = [i for i, (m, opts) in enumerate(zip(pinned_modes, options, strict=True))
                           if not any(o.mode == m for o in opts)]  # fmt: skip
                if missing:
                    raise InvalidMessage(
                        "pin_modes", f"blocks {missing} of rank {s.hello.rank} do not offer the modes asked for them"
                    )
        if pin_every is not None and not 0 <= pin_every <= n:
            raise InvalidMessage("pin_every", f"must be in 0-{n} for a job of {n} blocks, got {pin_every}")
        pinned: tuple[int, ...] | None = None
        if blocks is not None:
            bad = [b for b in blocks if not 0 <= b < n]
            if bad:
                raise InvalidMessage("pin_blocks", f"indices {bad} are outside 0-{n - 1}")
            pinned = tuple(sorted(set(blocks)))
        c = self._copy(job)
        c.pin_every, c.pin_blocks, c.pin_modes = pin_every, pinned, pinned_modes
        self._set(job, c)
        return self.job_controls(job)

    def unpin(self, job: str) -> ControlsRow:
        require_job(self.store, job)
        c = self._copy(job)
        c.pin_every, c.pin_blocks, c.pin_modes = None, None, None
        self._set(job, c)
        return self.job_controls(job)

    def tune(self, job: str, changes: Mapping[str, object]) -> ControlsRow:
        """Override a job's margin or budget (a value of None clears the override)."""
        require_job(self.store, job)
        c = self._copy(job)
        if "margin_ratio" in changes:
            m = changes["margin_ratio"]
            if m is not None and not (isinstance(m, (int, float)) and math.isfinite(m) and 0.0 <= m < 1.0):
                raise InvalidMessage("margin_ratio", f"must be in [0, 1), got {m!r}")
            c.margin_ratio = float(m) if isinstance(m, (int, float)) else None
        if "budget_bytes" in changes:
            b = changes["budget_bytes"]
            if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
                raise InvalidMessage("budget_bytes", f"must be a positive integer, got {b!r}")
            c.budget_bytes = b if isinstance(b, int) else None
        self._set(job, c)
        return self.job_controls(job)

    def end_job(self, job: str) -> None:
        """Mark a job ended: its series go, its live streams are refused at their next message."""
        require_job(self.store, job)
        now = time.time()
        c = self._copy(job)
        c.ended_at = now
        self.store.end_job(job, now)
        self.store.set_rank_state(job=job, state=ENDED)
        self._set(job, c)

    def refresh(self) -> None:
        """Pick up controls another worker or replica wrote to the shared store."""
        changed = self.store.controls_since(self.revision)
        if not changed:
            return
        retune: list[tuple[RankSession, float]] = []
        with self.sessions.lock:
            for row in changed:
                job = row["job"]
                c = Controls.of_row(row)
                self.by_job[job] = c
                self.revision = max(self.revision, int(row["revision"]))
                retune.extend(self._apply(job, c))
        self._retune(retune)

    def _apply(self, job: str, c: Controls) -> list[tuple[RankSession, float]]:
        """Under the registry's lock: drop an ended job; returns the job's ranks and the margin each now plans with."""
        if c.ended_at is not None and job in self.sessions.by_job:
            for s in self.sessions.by_job[job].values():
                s.revoked = True
            self.sessions.drop_job(job)
            return []
        return [
            (
                s,
                c.margin_ratio
                if c.margin_ratio is not None
                else (s.hello.margin_ratio or ControllerConfig().margin_ratio),
            )
            for s in self.sessions.by_job.get(job, {}).values()
        ]

    @staticmethod
    def _retune(margins: list[tuple[RankSession, float]]) -> None:
        """Change ranks' planners under their own planning lock (a planning thread may be using them),
        after the registry's lock is let go: planning can take a while, and the two locks never nest this way."""
        for s, margin in margins:
            with s.planning:
                if s.planner.controller.config.margin_ratio != margin:
                    s.planner.controller.config = dataclasses.replace(s.planner.controller.config, margin_ratio=margin)
