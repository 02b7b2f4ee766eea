"""One (job, rank)'s planning state: the same object serves embedded and served modes."""

from __future__ import annotations

from rematd.planner.controller import Controller, ControllerConfig, Decision
from rematd.planner.cost import predict_overhead_ratio
from rematd.planner.model import Plan, Profile, StepObservation
from rematd.planner.risk import oom_risk
from rematd.planner.solvers import frequency_of


class PlannerSession:
    """Holds the plan in force for one rank and decides when it changes."""

    def __init__(
        self,
        profile: Profile,
        *,
        budget_bytes: int,
        static_bytes: int = 0,
        config: ControllerConfig | None = None,
        first_version: int = 1,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes!r}")
        self.profile = profile
        self.controller = Controller(profile, config)
        self.budget_bytes = budget_bytes
        self.static_bytes = static_bytes
        self.oom_risk = 0.0
        """The rank's out-of-memory risk after the last observation, 0-1."""
        self._last_peak = 0
        self._plan = self._make(
            self.controller.initial(budget_bytes=budget_bytes, static_bytes=static_bytes), first_version
        )

    @property
    def plan(self) -> Plan:
        return self._plan

    def _make(self, decision: Decision, version: int) -> Plan:
        blocks = decision.choice.blocks
        return Plan(
            version=version,
            blocks=blocks,
            checkpoint_every=frequency_of(self.profile.num_blocks, blocks),
            predicted_peak_bytes=decision.choice.predicted_peak_bytes,
            predicted_overhead_ratio=predict_overhead_ratio(self.profile, blocks),
            target_bytes=decision.target_bytes,
            reason=decision.reason,
        )

    def _adopt(self, decision: Decision | None) -> Plan | None:
        if decision is None or decision.choice.blocks == self._plan.blocks:
            return None
        self._plan = self._make(decision, self._plan.version + 1)
        return self._plan

    def observe(self, obs: StepObservation) -> Plan | None:
        """Feed one step's measurements; returns the new plan when it changes."""
        self.budget_bytes = obs.budget_bytes
        self.static_bytes = obs.static_bytes
        plan = self._adopt(self.controller.observe(obs, self._plan.blocks))
        self.oom_risk = oom_risk(
            obs,
            predicted_next_bytes=int(self._plan.predicted_peak_bytes * self.controller.correction),
            capacity_bytes=obs.budget_bytes,
            margin_ratio=self.controller.config.margin_ratio,
            previous_peak_bytes=self._last_peak,
        )
        self._last_peak = obs.peak_bytes
        return plan

    def report_oom(self) -> Plan | None:
        """An out-of-memory event on this rank; returns the tighter plan."""
        self.oom_risk = 1.0
        return self._adopt(
            self.controller.after_oom(
                budget_bytes=self.budget_bytes, static_bytes=self.static_bytes, current=self._plan.blocks
            )
        )
