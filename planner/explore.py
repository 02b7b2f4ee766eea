"""Bounded, safe trials of modes whose seconds have not been measured at a length.

Memory is predictable from the profile; time is not always. A mode whose profile misses
costs only a real step shows (offload's copies) is priced pessimistically, which alone
would keep it untried for good. So, where the budget allows it, the controller runs a trial: the
plan in force with a few blocks switched to the untried mode, for a few steps, and
only when the trial's predicted peak, under the worst recent correction, fits the
target with the loosening slack. What trials may cost is bounded: their steps stay
within ``explore_steps + explore_share x steps``. A mode counts as measured at a
length once enough of its blocks were timed there; it is tried again when that
measurement grows stale, at a new length bucket, or in a new process (a warm start
from another job or machine brings prices, not this job's measurements).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rematd.planner.config import ControllerConfig
from rematd.planner.reasons import human_bytes
from rematd.planner.steps import StepObservation
from rematd.planner.timing import MIN_BLOCKS
from rematd.planner.units import Mode, letters

EXPLORED = (Mode.OFFLOAD,)
"""Modes priced pessimistically until measured (:data:`rematd.planner.model.PESSIMISTIC`): the ones worth a
trial. The others are priced from the profile from the start, and the plans that run them measure them."""
GIVE_UP_FACTOR = 4
"""A trial whose length does not come back for this many times its steps is abandoned."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    """A trial in force: the table entry at ``seq`` runs ``modes`` instead of its own."""

    seq: int
    """Longest length of the table entry the trial replaces."""
    mode: Mode
    """The mode being measured."""
    modes: tuple[Mode, ...]
    """The trial's modes, one per block."""
    blocks: tuple[int, ...]
    """The blocks switched to ``mode``."""
    started: int
    """Step at which it was put in force."""


@dataclass(slots=True)
class _Seen:
    blocks: int = 0
    last_step: int = 0


class Explorer:
    """Which modes are measured at which lengths, the trial in force, and what trials have cost."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.trial: Trial | None = None
        self.steps = 0
        """Steps observed."""
        self.trial_steps = 0
        """Steps that ran a trial's modes."""
        self.trials = 0
        """Trials put in force."""
        self._ran = 0
        self._seen: dict[tuple[int, Mode], _Seen] = {}

    def note(self, obs: StepObservation, bucket: int, entry: int, ran: tuple[Mode, ...] | None) -> bool:
        """One step at length bucket ``bucket`` that ran ``ran`` under the table entry up to length
        ``entry``: its timed modes count as measured there. True when the step was a trial's."""
        self.steps += 1
        for m in obs.mode_seconds:
            if m.blocks > 0:
                seen = self._seen.setdefault((bucket, m.mode), _Seen())
                seen.blocks += m.blocks
                seen.last_step = obs.step
        trial = self.trial
        if trial is None or entry != trial.seq or ran != trial.modes:
            return False
        self.trial_steps += 1
        self._ran += 1
        return True

    @property
    def trial_done(self) -> bool:
        """Whether the trial in force has run its steps (or its length stopped coming)."""
        trial = self.trial
        if trial is None:
            return False
        steps = self.config.explore_steps
        return self._ran >= steps or self.steps - trial.started > GIVE_UP_FACTOR * steps

    def untried(self, bucket: int, offered: set[Mode], step: int) -> list[Mode]:
        """The modes worth a trial at ``bucket``: offered, priced pessimistically until measured, and not
        measured there (or measured too long ago)."""
        stale = self.config.explore_stale_steps
        out = []
        for mode in EXPLORED:
            seen = self._seen.get((bucket, mode))
            if mode in offered and (seen is None or seen.blocks < MIN_BLOCKS or step - seen.last_step > stale):
                out.append(mode)
        return out

    def may_start(self) -> bool:
        """Whether a new trial keeps trial steps within ``explore_steps + explore_share x steps``."""
        cfg = self.config
        if cfg.explore_share <= 0 or self.trial is not None:
            return False
        # A trial starts only while trials have had no more than their share: with its own steps, they
        # stay within explore_steps + explore_share x steps.
        return self.trial_steps <= cfg.explore_share * self.steps

    def propose(
        self,
        *,
        seq: int,
        current: tuple[Mode, ...],
        mode: Mode,
        offers: Callable[[int, Mode], bool],
        fits: Callable[[tuple[Mode, ...]], bool],
    ) -> Trial | None:
        """A trial of ``mode`` on up to ``explore_blocks`` blocks of ``current``: recomputing blocks first
        (the untried mode keeps more than recomputing and less than storing), then stored ones, each
        switch kept only if the plan still ``fits``; None when no block can switch safely."""
        modes = list(current)
        switched: list[int] = []
        for source in (Mode.RECOMPUTE, Mode.STORE):
            for i, m in enumerate(current):
                if len(switched) >= self.config.explore_blocks:
                    break
                if m != source or not offers(i, mode):
                    continue
                modes[i] = mode
                if fits(tuple(modes)):
                    switched.append(i)
                else:
                    modes[i] = m
        if not switched:
            return None
        return Trial(seq=seq, mode=mode, modes=tuple(modes), blocks=tuple(switched), started=self.steps)

    def start(self, trial: Trial) -> None:
        self.trial, self._ran = trial, 0
        self.trials += 1

    def stop(self) -> Trial | None:
        """End the trial in force (run, abandoned or overtaken by a tighter plan); the trial, if any."""
        trial, self.trial, self._ran = self.trial, None, 0
        return trial


def trial_reason(trial: Trial, peak: int, target: int) -> str:
    """What a trial is and what it measures, for the plan's reason."""
    blocks = ", ".join(str(b) for b in trial.blocks)
    name = trial.mode.name.lower()
    return (
        f"trial: {name} on block{'s' if len(trial.blocks) > 1 else ''} {blocks} at lengths up to {trial.seq} "
        f"({letters(trial.modes)}), to measure what {name} costs there (not yet measured at this length); "
        f"predicted {human_bytes(peak)} of the {human_bytes(target)} target"
    )


def trial_over_reason(trial: Trial) -> str:
    name = trial.mode.name.lower()
    return f"trial over: {name} was timed at lengths up to {trial.seq}; its measured seconds now price the plans"
