"""The adaptive controller: tighten at once, loosen only after sustained headroom."""

from __future__ import annotations

from dataclasses import dataclass

from rematd.planner.cost import predict_peak_bytes
from rematd.planner.model import Profile, StepObservation
from rematd.planner.solvers import Choice, solve_min_recompute


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerConfig:
    """How cautiously the controller trades memory for recomputation."""

    margin_ratio: float = 0.1
    """Fraction of the budget kept free: target = budget x (1 - margin_ratio)."""
    loosen_after_steps: int = 5
    """Consecutive steps with room for a looser plan before the plan loosens."""
    max_correction: float = 4.0
    """Upper bound of the learned measured/predicted correction factor."""
    correction_decay: float = 0.2
    """How fast the correction falls back towards 1 when measurements drop (0-1)."""
    oom_correction_step: float = 1.25
    """Factor by which an out-of-memory event raises the correction."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin_ratio < 1.0:
            raise ValueError(f"margin_ratio must be in [0, 1), got {self.margin_ratio!r}")
        if self.loosen_after_steps < 1:
            raise ValueError(f"loosen_after_steps must be >= 1, got {self.loosen_after_steps!r}")
        if self.max_correction < 1.0:
            raise ValueError(f"max_correction must be >= 1, got {self.max_correction!r}")
        if not 0.0 < self.correction_decay <= 1.0:
            raise ValueError(f"correction_decay must be in (0, 1], got {self.correction_decay!r}")
        if self.oom_correction_step <= 1.0:
            raise ValueError(f"oom_correction_step must be > 1, got {self.oom_correction_step!r}")

    def target_bytes(self, budget_bytes: int) -> int:
        return int(budget_bytes * (1.0 - self.margin_ratio))


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """A change of plan the controller asks for."""

    choice: Choice
    target_bytes: int
    reason: str


def _mib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


class Controller:
    """Turns a stream of step observations into plan changes.

    The correction factor learns how far measured peaks run above the cost
    model (never below 1: a smaller measurement is not trusted to loosen).
    """

    def __init__(self, profile: Profile, config: ControllerConfig | None = None) -> None:
        self.profile = profile
        self.config = config or ControllerConfig()
        self.correction = 1.0
        self._headroom_steps = 0

    def _solve(self, profile: Profile, target: int, static: int) -> Choice:
        effective = int(target / self.correction)
        return solve_min_recompute(profile, effective, static_bytes=int(static / self.correction))

    def initial(self, *, budget_bytes: int, static_bytes: int = 0) -> Decision:
        target = self.config.target_bytes(budget_bytes)
        choice = self._solve(self.profile, target, static_bytes)
        fit = "fits" if choice.fits else "does not fit even with full recomputation"
        return Decision(
            choice=choice,
            target_bytes=target,
            reason=(
                f"initial plan from profile: predicted {_mib(choice.predicted_peak_bytes)} {fit} target {_mib(target)}"
            ),
        )

    def observe(self, obs: StepObservation, current: tuple[int, ...]) -> Decision | None:
        cfg = self.config
        target = cfg.target_bytes(obs.budget_bytes)
        profile = self.profile.scaled_to(obs.shape)
        predicted_now = predict_peak_bytes(profile, frozenset(current), static_bytes=obs.static_bytes)
        if predicted_now > 0 and obs.peak_bytes > 0:
            ratio = min(obs.peak_bytes / predicted_now, cfg.max_correction)
            if ratio >= self.correction:
                self.correction = ratio
            else:
                self.correction = max(1.0, self.correction + cfg.correction_decay * (ratio - self.correction))

        candidate = self._solve(profile, target, obs.static_bytes)
        measured_over = obs.peak_bytes > target
        predicted_over = predicted_now * self.correction > target
        if measured_over or predicted_over:
            self._headroom_steps = 0
            if candidate.blocks == current:
                return None
            if len(candidate.blocks) < len(current):
                # The looser plan only looks better because the estimate lags; stay put.
                return None
            cause = (
                f"measured peak {_mib(obs.peak_bytes)} over target {_mib(target)}"
                if measured_over
                else f"predicted peak {_mib(predicted_now * self.correction)} over target {_mib(target)}"
            )
            return Decision(
                choice=candidate, target_bytes=target, reason=f"tighten: {cause} at seq {obs.shape.seq_len}"
            )

        if len(candidate.blocks) >= len(current):
            self._headroom_steps = 0
            return None
        self._headroom_steps += 1
        if self._headroom_steps < cfg.loosen_after_steps:
            return None
        self._headroom_steps = 0
        return Decision(
            choice=candidate,
            target_bytes=target,
            reason=(
                f"loosen: headroom for {cfg.loosen_after_steps} steps "
                f"(measured {_mib(obs.peak_bytes)} of target {_mib(target)})"
            ),
        )

    def after_oom(self, *, budget_bytes: int, static_bytes: int, current: tuple[int, ...]) -> Decision:
        """An out-of-memory event: distrust the model more and tighten at once."""
        cfg = self.config
        self.correction = min(cfg.max_correction, self.correction * cfg.oom_correction_step)
        self._headroom_steps = 0
        target = cfg.target_bytes(budget_bytes)
        choice = self._solve(self.profile, target, static_bytes)
        if len(choice.blocks) <= len(current) and len(current) < self.profile.num_blocks:
            # Whatever the model says, the plan in force just failed: recompute more.
            choice = solve_min_recompute(self.profile, 0, static_bytes=0)
        return Decision(choice=choice, target_bytes=target, reason="tighten: out-of-memory reported")
