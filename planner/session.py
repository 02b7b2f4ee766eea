"""One (job, rank)'s planning state: the same object serves embedded and served modes."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from rematd.planner.controller import Controller, ControllerConfig, Decision
from rematd.planner.cost import overhead_ratio
from rematd.planner.model import Profile
from rematd.planner.plan import Plan, ShapePlan, blocks_of
from rematd.planner.reasons import human_bytes, lossy_note
from rematd.planner.risk import oom_risk, usable_bytes
from rematd.planner.shapes import at_shape
from rematd.planner.solvers import checkpoint_every_of
from rematd.planner.steps import StepObservation
from rematd.planner.units import Mode, Shape, letters

RESTATE_STATIC = 1 / 256
"""A plan is priced again, its modes kept, when the static memory steps start with moved by more than this
fraction of the budget since it was priced (the step in which the target moves)."""


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
        budget_note: str = "",
    ) -> None:
        """``budget_note``: where the budget came from, said after the first plan's reason (a budget nobody
        gave: the device's memory)."""
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes!r}")
        self.profile = profile
        self.controller = Controller(profile, config)
        self.budget_bytes = budget_bytes
        self.capacity_bytes = budget_bytes
        """What the last step could really use of the budget (:func:`usable_bytes`)."""
        self.static_bytes = static_bytes
        self.oom_risk = 0.0
        """The rank's out-of-memory risk after the last observation, 0-1."""
        self._last_peak = 0
        self._priced_static = static_bytes
        """The static memory the plan in force was priced for."""
        self._recent: OrderedDict[int, Plan] = OrderedDict()
        first = self.controller.initial(budget_bytes=budget_bytes, static_bytes=static_bytes)
        if budget_note:
            first = dataclasses.replace(first, reason=f"{first.reason} ({budget_note})")
        self._plan = self._make(first, first_version)

    @property
    def plan(self) -> Plan:
        return self._plan

    def _make(self, decision: Decision, version: int) -> Plan:
        lossy = lossy_note(decision.modes, decision.table)
        plan = Plan(
            version=version,
            blocks=blocks_of(decision.modes),
            checkpoint_every=checkpoint_every_of(decision.modes),
            predicted_peak_bytes=decision.predicted_peak_bytes,
            predicted_overhead_ratio=decision.predicted_overhead_ratio,
            target_bytes=decision.target_bytes,
            reason=f"{decision.reason}; {lossy}" if lossy else decision.reason,
            modes=decision.modes,
            shape_plans=decision.table,
        )
        self._recent[version] = plan
        while len(self._recent) > 8:
            self._recent.popitem(last=False)
        return plan

    def usable(self, modes: tuple[Mode, ...]) -> tuple[Mode, ...]:
        """``modes`` with any a block's profile does not offer replaced by recomputation, which every block has."""
        options = self.profile.options_at(None)
        return tuple(
            m if any(o.mode == m for o in opts) else Mode.RECOMPUTE for m, opts in zip(modes, options, strict=True)
        )

    def plan_of(
        self,
        modes: tuple[Mode, ...],
        *,
        version: int,
        reason: str,
        table: tuple[ShapePlan, ...] = (),
        shape: Shape | None = None,
    ) -> Plan:
        """A plan of given modes (and table) instead of the planner's (a pin, a warm start), priced by the
        profile at ``shape`` (None: the profile's); its reason says when it is lossy, as the planner's own plans
        do."""
        usable = self.usable(modes)
        if usable != modes:
            reason += f" (as {letters(usable)}: the profile offers no such mode for some blocks)"
        at = at_shape(self.profile, shape if shape is not None and shape.seq_len else None)
        peak, extra = at.cost(usable)
        lossy = lossy_note(usable, table)
        return Plan(
            version=version,
            blocks=blocks_of(usable),
            checkpoint_every=checkpoint_every_of(usable),
            predicted_peak_bytes=self.static_bytes + at.other_bytes + peak,
            predicted_overhead_ratio=overhead_ratio(extra, at.forward_seconds),
            target_bytes=self._plan.target_bytes,
            reason=f"{reason}; {lossy}" if lossy else reason,
            modes=usable,
            shape_plans=table,
        )

    def renumber_after(self, version: int) -> Plan:
        """Re-issue the plan in force as ``version + 1`` (a client planned on its own meanwhile
        and is at ``version``: plans must keep going up for it to take them)."""
        if version >= self._plan.version:
            self._plan = dataclasses.replace(self._plan, version=version + 1)
            self._recent[self._plan.version] = self._plan
        return self._plan

    def continue_from(self, plan: Plan) -> Plan:
        """Take ``plan``, the one a reconnecting rank has in force, as this session's plan: the
        controller goes on from its table (tightening at once where it must, loosening only after
        its dwell) instead of from the plan it made from the profile alone."""
        self.controller.table = self.controller.handed_out = plan.shape_plans
        self._plan = plan
        self._recent[plan.version] = plan
        return plan

    def prices(self) -> list[dict[str, object]]:
        """How sure each mode's price is, per mode the profile offers beyond storing: ``measured`` (its
        seconds timed often enough: ``scale`` is measured over profiled), ``trial`` (being measured now)
        or ``estimate`` (untried: priced at no less than recomputing), with the blocks timed so far, over
        the whole job; and ``buckets``, the same per length bucket timed (shortest first), with the scale
        that prices the bucket (its own where measured there, else the pooled one), the step the mode was
        last timed there, and where the step times there moved its price, per position group what a block
        in the mode adds to a step by them (``step_share``) and by the per-block prices (``block_share``),
        as fractions of the step."""
        timing = self.controller.timing
        scales = dict(timing.scales)
        trial = self.controller.explorer.trial
        offered = sorted({m.mode for b in self.profile.blocks for m in b.mode_costs()} - {Mode.STORE})
        out: list[dict[str, object]] = []
        for mode in offered:
            measured = mode in timing.measured_modes
            state = "trial" if trial is not None and trial.mode == mode else "measured" if measured else "estimate"
            out.append(
                {
                    "mode": mode.name.lower(),
                    "state": state,
                    "timed_blocks": timing.timed_blocks(mode),
                    "scale": scales.get(mode, 1.0) if measured else None,
                    "buckets": self._bucket_prices(mode),
                }
            )
        return out

    def _bucket_prices(self, mode: Mode) -> list[dict[str, object]]:
        """:meth:`prices`' ``buckets`` of ``mode``."""
        timing = self.controller.timing
        trial = self.controller.explorer.trial
        trial_at = timing.bucket_of(trial.seq) if trial is not None and trial.mode == mode else None
        out: list[dict[str, object]] = []
        for top in timing.buckets:
            measured = mode in timing.measured_modes_at(top)
            step, block = self.controller.step_shares(top).get(mode, (None, None))
            out.append(
                {
                    "max_seq_len": top,
                    "state": "trial" if top == trial_at else "measured" if measured else "estimate",
                    "timed_blocks": timing.timed_blocks(mode, top),
                    "scale": dict(timing.scales_at(top)).get(mode, 1.0),
                    "last_step": timing.last_timed(mode, top),
                    "step_share": list(step) if step is not None else None,
                    "block_share": list(block) if block is not None else None,
                }
            )
        return out

    @property
    def trial_step(self) -> bool:
        """Whether the last step observed ran a trial of a mode not yet measured at its length."""
        return self.controller.trial_step

    @property
    def trial_outcomes(self) -> dict[str, int]:
        """Plan trials ended so far, by outcome (:data:`~rematd.planner.plan_trials.OUTCOMES`)."""
        return dict(self.controller.plan_trials.outcomes)

    @property
    def steady(self) -> bool:
        """Whether the next steps, if like the last, would change nothing: no loosening under way."""
        return not self.controller.loosening_pending and not self.controller.exploring

    def _adopt(self, decision: Decision | None) -> Plan | None:
        if decision is None:
            return None
        if not decision.verdict and decision.modes == self._plan.modes and decision.table == self._plan.shape_plans:
            return None
        self._plan = self._make(decision, self._plan.version + 1)
        return self._plan

    def _restate(self, obs: StepObservation) -> Plan | None:
        """The plan in force again, its predictions made for the static memory the steps now start with, where
        that moved by more than :data:`RESTATE_STATIC` of the budget since the plan was priced (the first step
        after the profile shows whether the gradients it made stayed): what a plan says it will peak at is
        what its steps will (the modes stay)."""
        priced = self._priced_static
        # The profiling step ran no plan, and started before the optimizer made its state.
        if not obs.plan_version or abs(obs.static_bytes - priced) <= RESTATE_STATIC * max(1, obs.budget_bytes):
            return None
        self._priced_static = obs.static_bytes
        target = self.controller.config.target_bytes(self.capacity_bytes)
        cause = (
            f"re-priced: steps start with {human_bytes(obs.static_bytes)} of static memory, not the "
            f"{human_bytes(priced)} the plan in force was priced for (modes unchanged)"
        )
        return self._adopt(self.controller.restated(obs.shape, target, obs.static_bytes, cause))

    def _priced(self, modes: tuple[Mode, ...]) -> bool:
        """Whether the profile prices each block's mode (a pin may run a mode the planner was not offered)."""
        for block, mode in zip(self.profile.blocks, modes, strict=True):
            offered = {c.mode for c in block.modes} or {Mode.STORE, Mode.RECOMPUTE}
            if mode not in offered:
                return False
        return True

    def observe(self, obs: StepObservation, ran: tuple[Mode, ...] | None = None) -> Plan | None:
        """Feed one step's measurements; returns the new plan when it changes. ``ran``: the modes its plan
        gave the step, where the caller versions the plans it sends itself (a service; ``()``: not known);
        None: the plan of ``obs.plan_version`` among this session's own."""
        self.budget_bytes = obs.budget_bytes
        self.capacity_bytes = usable_bytes(obs)
        self.static_bytes = obs.static_bytes
        n = self.profile.num_blocks
        if ran is None:
            own = self._recent.get(obs.plan_version)
            ran = own.modes_for(obs.shape, n) if own is not None else ()
        measured_modes: tuple[Mode, ...] | None = None
        if len(obs.modes) == n and self._priced(obs.modes):
            measured_modes = obs.modes
        elif len(ran) == n and self._priced(ran):
            measured_modes = ran
        # Unknown (None): priced as storing every block, and no step time taken.
        plan = self._adopt(self.controller.observe(obs, measured_modes))
        if plan is None:
            plan = self._restate(obs)
        else:
            self._priced_static = obs.static_bytes
        # The correction learnt from measured peaks scales the activations, not the static memory.
        activations = max(0, self._plan.predicted_peak_bytes - obs.static_bytes)
        predicted_next = obs.static_bytes + int(activations * self.controller.correction(obs.shape.seq_len))
        self.oom_risk = oom_risk(
            obs,
            predicted_next_bytes=predicted_next,
            capacity_bytes=self.capacity_bytes,
            margin_ratio=self.controller.config.margin_ratio,
            previous_peak_bytes=self._last_peak,
        )
        self._last_peak = obs.peak_bytes
        return plan

    def report_oom(self, shape: Shape | None = None) -> Plan | None:
        """An out-of-memory event on this rank at ``shape``; returns the tighter plan."""
        self.oom_risk = 1.0
        return self._adopt(
            self.controller.after_oom(
                shape=shape or self.profile.shape, budget_bytes=self.capacity_bytes, static_bytes=self.static_bytes
            )
        )
