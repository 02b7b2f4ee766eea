"""The handle's lifecycle: which phase the next step runs in, and every way it may change.

A step is whatever runs between the first grad-enabled forward after a step
boundary and :meth:`Handle.step <rematd.client.Handle.step>`. What rematd
does at a step's start depends on the phase:

========== ================================================================
profiling  every block stores and is measured; a complete profile opens the
           planner (``profiled``) and steps follow its plans
planned    the newest plan waiting is applied at each step's start
retry      an out-of-memory error happened: the next step runs with every
           block recomputed, whatever plan is waiting
safe       every block keeps recomputing until the planner's next plan
           (``plan_applied``)
closed     detached: nothing happens any more
========== ================================================================

Whether the planner has a profile is kept beside the phase: an error in the
profiling step leads to ``retry`` and ``safe`` before any profile, and a
profile completed there (borrowing the largest block's measure) does not end
safe mode by itself.

An event the table does not allow raises :class:`IllegalTransition` (a
``ValueError``) naming the event and the phase, and leaves the state as it
was: the handle's hooks log it and training goes on.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    # Hashed by identity, as members are unique: looked up twice a step in the transitions, where Enum's own
    # hash (of the name, in Python) would be a call each time.
    __hash__ = object.__hash__

    PROFILING = "profiling"
    PLANNED = "planned"
    RETRY = "retry"
    SAFE = "safe"
    CLOSED = "closed"


class Event(enum.Enum):
    __hash__ = object.__hash__

    BEGIN_STEP = "begin_step"
    END_STEP = "end_step"
    PROFILED = "profiled"
    PLAN_APPLIED = "plan_applied"
    OOM = "oom"
    CLOSE = "close"


class IllegalTransition(ValueError):
    """An event the lifecycle does not allow in its current phase."""


P, E = Phase, Event
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (P.PROFILING, E.BEGIN_STEP): P.PROFILING,
    (P.PROFILING, E.END_STEP): P.PROFILING,
    (P.PROFILING, E.PROFILED): P.PLANNED,
    (P.PROFILING, E.OOM): P.RETRY,
    (P.PROFILING, E.CLOSE): P.CLOSED,
    (P.PLANNED, E.BEGIN_STEP): P.PLANNED,
    (P.PLANNED, E.END_STEP): P.PLANNED,
    (P.PLANNED, E.PLAN_APPLIED): P.PLANNED,
    (P.PLANNED, E.OOM): P.RETRY,
    (P.PLANNED, E.CLOSE): P.CLOSED,
    # The retry is the step that begins next: it runs in safe mode.
    (P.RETRY, E.BEGIN_STEP): P.SAFE,
    (P.RETRY, E.PROFILED): P.RETRY,
    (P.RETRY, E.OOM): P.RETRY,
    (P.RETRY, E.CLOSE): P.CLOSED,
    (P.SAFE, E.BEGIN_STEP): P.SAFE,
    (P.SAFE, E.END_STEP): P.SAFE,
    (P.SAFE, E.PROFILED): P.SAFE,
    (P.SAFE, E.PLAN_APPLIED): P.PLANNED,
    (P.SAFE, E.OOM): P.RETRY,
    (P.SAFE, E.CLOSE): P.CLOSED,
    # An error after close is the training job's own: rematd is detached and stays so.
    (P.CLOSED, E.OOM): P.CLOSED,
    (P.CLOSED, E.CLOSE): P.CLOSED,
}
"""(phase, event) -> the phase after it; a pair not here is an illegal transition."""
del P, E


class Lifecycle:
    """The handle's phase, whether the planner has a profile, and whether a step is running."""

    def __init__(self) -> None:
        self.phase = Phase.PROFILING
        self.has_profile = False
        """The planner was given a complete profile (it happens once)."""
        self.in_step = False
        """A step has begun and not yet ended (nor failed)."""

    def __repr__(self) -> str:
        step = ", in step" if self.in_step else ""
        profile = ", profiled" if self.has_profile else ""
        return f"Lifecycle({self.phase.value}{profile}{step})"

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @property
    def safe(self) -> bool:
        """Every block recomputes: after an out-of-memory error, until the planner's next plan."""
        return self.phase in (Phase.RETRY, Phase.SAFE)

    def _fire(self, event: Event) -> Phase:
        after = TRANSITIONS.get((self.phase, event))
        if after is None:
            raise IllegalTransition(f"rematd lifecycle: {event.value} is not allowed while {self.phase.value}")
        self.phase = after
        return after

    def begin_step(self) -> Phase:
        """A step begins; returns the phase it runs in (``RETRY`` for the step after an error)."""
        if self.in_step:
            raise IllegalTransition("rematd lifecycle: begin_step while a step is running")
        runs_in = self.phase
        if runs_in is not Phase.PLANNED:  # planned steps stay planned: no look at the table, every step
            self._fire(Event.BEGIN_STEP)
        self.in_step = True
        return runs_in

    def end_step(self) -> None:
        """The running step ended normally."""
        if not self.in_step:
            raise IllegalTransition("rematd lifecycle: end_step without a running step")
        if self.phase is not Phase.PLANNED:
            self._fire(Event.END_STEP)
        self.in_step = False

    def profiled(self) -> None:
        """The planner was given the profile: from profiling, steps follow its plans."""
        if self.has_profile:
            raise IllegalTransition("rematd lifecycle: profiled twice")
        self._fire(Event.PROFILED)
        self.has_profile = True

    def plan_applied(self) -> None:
        """A plan from the planner was applied at a step's start: it ends safe mode."""
        self._fire(Event.PLAN_APPLIED)

    def oom(self) -> None:
        """A step ran out of memory: it is over, and the next one is the retry."""
        self._fire(Event.OOM)
        self.in_step = False

    def close(self) -> bool:
        """Detach; False when already closed."""
        was_closed = self.closed
        self._fire(Event.CLOSE)
        self.in_step = False
        return not was_closed
