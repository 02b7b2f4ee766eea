"""Where plans come from: the planner in this process, or a service over gRPC."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

from rematd.client.service.budget_hold import BudgetHold
from rematd.client.service.step_record import StepRecord
from rematd.planner import Mode, Plan, PlannerSession, Shape
from rematd.planner.messages import Hello, OomReport, StepStats, observation, open_planner

log = logging.getLogger("rematd.client")

PlanCallback = Callable[[Plan], None]
Pricer = Callable[[tuple[Mode, ...], int, str, Shape | None], Plan | None]
"""A plan of given modes (a pin), its version and reason, priced by the rank's planner at a shape (None: the
profile's); None before it opens."""


class Backend(Protocol):
    """What a handle needs from a source of plans. No method may block on the network."""

    served: bool
    """Whether the plans come from a service, where every rank's stream meets its job (else from this process)."""
    budget_hold: BudgetHold
    """What the steps run between a budget cut and the plan for it."""

    def open(self, hello: Hello) -> None: ...
    def update_hello(self, **fields: Any) -> None: ...
    def send_stats(self, step: StepRecord) -> None:
        """A step's figures, handed over at its end: the statistics are built off the training thread where a
        thread of the backend's own takes them (:meth:`StepRecord.stats`)."""

    def send_oom(self, oom: OomReport) -> None: ...
    def flush(self, timeout: float) -> bool: ...
    def close(self, timeout: float) -> None: ...
    def plan_of(
        self, modes: tuple[Mode, ...], version: int, reason: str, shape: Shape | None = None
    ) -> Plan | None: ...


class EmbeddedBackend:
    """Runs the planner in-process, on the caller's thread: the training thread's with
    ``attach(planner_thread=False)``, else the planner's own (:mod:`rematd.client.plans.background`)."""

    served = False
    budget_hold = BudgetHold.NONE

    def __init__(self, on_plan: PlanCallback) -> None:
        self._on_plan = on_plan
        self._hello: Hello | None = None
        self._session: PlannerSession | None = None
        self._last: StepStats | None = None

    @property
    def hello(self) -> Hello | None:
        """The hello the planner was opened with (its budget and static memory as updated since)."""
        return self._hello

    @property
    def session(self) -> PlannerSession | None:
        """The rank's planner, once open."""
        return self._session

    def open(self, hello: Hello) -> None:
        self._hello = hello
        self._session = open_planner(hello)
        self._on_plan(self._session.plan)

    def update_hello(self, **fields: Any) -> None:
        if self._hello is None:
            return
        self._hello = dataclasses.replace(self._hello, **fields)
        last = self._last
        if self._session is None or last is None:
            return
        budget = fields.get("budget_bytes", last.budget_bytes)
        static = fields.get("static_bytes", last.static_bytes)
        if (budget, static) != (last.budget_bytes, last.static_bytes):
            self._replan(last, budget, static)

    def _replan(self, last: StepStats, budget: int, static: int) -> None:
        """Plan for a new budget, or static memory other than the last step's, now, so that the very next step
        runs under it.

        The last step is offered again with the new figures, as a step of the plan in force, and none of
        its measurements (no peak, timings, retries or fragmentation; the device's room stays): the planner
        learns nothing twice and only re-decides against the new target.
        """
        assert self._session is not None and self._hello is not None
        again = dataclasses.replace(
            last,
            budget_bytes=budget,
            static_bytes=static,
            plan_version=self._session.plan.version,
            step_seconds=0.0,
            peak_allocated_bytes=0,
            saved_peak_bytes=0,
            mode_seconds=(),
            alloc_retries=0,
            inactive_split_bytes=0,
        )
        self._last = again
        plan = self._session.observe(observation(self._hello, again))
        if plan is not None:
            self._on_plan(plan)

    def send_stats(self, stats: StepStats | StepRecord) -> None:
        if self._session is None or self._hello is None:
            return
        if isinstance(stats, StepRecord):
            stats = stats.stats()
        self._last = stats
        plan = self._session.observe(observation(self._hello, stats))
        if plan is not None:
            self._on_plan(plan)

    def send_oom(self, oom: OomReport) -> None:
        if self._session is not None:
            plan = self._session.report_oom(oom.shape)
            if plan is not None:
                self._on_plan(plan)

    def flush(self, timeout: float) -> bool:
        return True

    def plan_of(self, modes: tuple[Mode, ...], version: int, reason: str, shape: Shape | None = None) -> Plan | None:
        """``modes`` as a plan priced by this rank's planner (a pin in this process), at ``shape`` (else the
        profile's); None before it opens."""
        if self._session is None:
            return None
        return self._session.plan_of(modes, version=version, reason=reason, shape=shape)

    def close(self, timeout: float) -> None:
        self._session = None
