"""The in-process planner that stands in while the service cannot be reached.

It plans from the same profile with the same planner; its plan versions
continue from the plan in force. One that keeps failing is given up: the plan
in force stays until the service answers again.
"""

from __future__ import annotations

import logging

from rematd.planner import Plan, PlannerSession
from rematd.planner.messages import Hello, OomReport, StepStats, observation, open_planner

log = logging.getLogger("rematd.client")

# Failures in a row after which the in-process planner is given up until the service answers again.
FALLBACK_MAX_FAILURES = 3


class LocalPlanner:
    """One rank's fallback planner: started when the service has been gone long enough, dropped when it is back."""

    def __init__(self) -> None:
        self._session: PlannerSession | None = None
        self.failures = 0
        """Failures in a row (a failure to start included)."""
        self.given_up = False
        """It failed ``FALLBACK_MAX_FAILURES`` times in a row: not tried again until the service answers."""

    @property
    def active(self) -> bool:
        """Plans come from here now."""
        return self._session is not None

    def start(self, hello: Hello, *, next_version: int) -> Plan:
        """Open the planner from ``hello``; returns its first plan."""
        if hello.plan is not None:
            # Go on from the plan in force rather than from one made afresh, which could be looser.
            session = open_planner(hello, first_version=hello.plan_version)
            session.continue_from(hello.plan)
        else:
            session = open_planner(hello, first_version=next_version)
        self._session = session
        return session.plan

    def take(self, item: StepStats | OomReport, hello: Hello) -> Plan | None:
        """A store the service would have had; the new plan it leads to, if any."""
        assert self._session is not None, "start() first"
        if isinstance(item, StepStats):
            return self._session.observe(observation(hello, item))
        return self._session.report_oom(item.shape)

    def succeeded(self) -> None:
        self.failures = 0

    def failed(self) -> None:
        """One more failure in a row; at the limit the planner is given up."""
        self.failures += 1
        if self.failures >= FALLBACK_MAX_FAILURES:
            # A planner that keeps failing would only fail again: keep the plan in force instead.
            log.error(
                "rematd: the in-process planner failed %d times in a row; the plan in force stays "
                "until the service answers again",
                self.failures,
            )
            self._session = None
            self.given_up = True

    def stop(self) -> None:
        """The service answers again: its plans take over."""
        if self._session is not None:
            log.info("rematd service is back; its plans replace the in-process planner's")
        self._session = None
        self.failures = 0
        self.given_up = False
