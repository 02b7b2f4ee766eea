"""The adaptive controller: a plan table keyed by sequence length that tightens
at once and loosens only after sustained headroom.

Each table entry is the cheapest plan that fits the target at the top of its
sequence-length bucket, so a step of a new length gets a plan before it runs.
Measured peaks correct the cost model per bucket, up or down; the correction
ignores a single outlier unless that outlier crossed the target. Where a mode's
seconds are unmeasured at a length and the budget allows it, a short trial
measures them (:mod:`rematd.planner.explore`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rematd.planner.config import ControllerConfig
from rematd.planner.cost import overhead_ratio
from rematd.planner.decision import Decision, Moves
from rematd.planner.explore import Explorer, trial_over_reason, trial_reason
from rematd.planner.learned import Learned
from rematd.planner.mode_trials import start_mode_trial
from rematd.planner.model import Profile
from rematd.planner.plan import ShapePlan, entry_for
from rematd.planner.plan_trials import PlanTrials
from rematd.planner.pricing import Pricing
from rematd.planner.reasons import (
    changed,
    human_bytes,
    initial_reason,
    lengths_named,
    recomputes_less,
    target_named,
    what_changed,
)
from rematd.planner.risk import usable_bytes
from rematd.planner.rungs import Rungs
from rematd.planner.step_planning import LOOSEN_SLACK, StepPlanner
from rematd.planner.steps import StepObservation
from rematd.planner.timing import BucketTimes
from rematd.planner.trial_search import Handed, TrialSearch
from rematd.planner.units import Mode, Shape
from rematd.planner.weigh import weigh

__all__ = ["LOOSEN_SLACK", "Controller", "ControllerConfig", "Decision", "human_bytes"]


class Controller:
    """Turns a stream of step observations into plan-table changes.

    It holds its parts rather than being them: :attr:`pricing` (what a plan costs at a length, and the
    cheapest that fits), :attr:`planner` (the plan an entry should run, the step-level prices in the choice:
    :attr:`rungs` asks its ``choose`` for every rung of the table), :attr:`rungs` (the entries the table
    should hold) and :attr:`trial_search` (trials of plans where the step-level prices are unsure; its
    ``best_candidate`` is the one look for a plan worth a trial). Each is readable alone."""

    def __init__(self, profile: Profile, config: ControllerConfig | None = None) -> None:
        self.profile = profile
        self.pricing = Pricing(profile, config)
        self.planner = StepPlanner(self.pricing)
        self.rungs = Rungs(self.pricing, self.planner)
        self.trial_search = TrialSearch(self.pricing, self.planner)
        self._explorer = Explorer(self.config)
        self.table: tuple[ShapePlan, ...] = ()
        self.handed_out: tuple[ShapePlan, ...] = ()
        """The table of the last decision: :attr:`table` with a trial's entry in its place while one runs, what
        the steps ran and what a plan's reason says it changed from."""
        self.trial_step = False
        """Whether the last step observed ran a trial's modes (of a mode or of a plan)."""

    @property
    def config(self) -> ControllerConfig:
        """The settings. Replacing them (the service's controls do) reaches pricing and planning at once; the
        trials of modes and plans, and what is learned, keep those this controller was made with."""
        return self.pricing.config

    @config.setter
    def config(self, config: ControllerConfig) -> None:
        self.pricing.config = config

    @property
    def learned(self) -> Learned:
        """What the measurements taught (corrections, caps, measured prices, step-level fits)."""
        return self.pricing.learned

    @property
    def timing(self) -> BucketTimes:
        """What the modes are measured to cost, against the profile, per length bucket and pooled."""
        return self.pricing.timing

    @property
    def loosening_pending(self) -> bool:
        """Whether steps with room are being counted towards a looser plan."""
        return self.learned.headroom_steps > 0

    def bucket_of(self, seq: int) -> int:
        """The top of the bucket ``seq`` falls in: a rung of a geometric ladder."""
        return self.pricing.bucket_of(seq)

    def correction(self, seq: int, *, pessimistic: bool = False) -> float:
        """Measured/predicted for a bucket: its second-largest recent ratio (the largest when
        ``pessimistic``), at least 1. Buckets never measured borrow the largest of any bucket.
        """
        return self.learned.correction(seq, pessimistic=pessimistic)

    def step_shares(self, top: int) -> dict[Mode, tuple[tuple[float, ...], tuple[float, ...]]]:
        """Per mode, per position group: what a block in that mode adds to a step at the bucket of ``top``
        by the step-level fit, and by the per-block prices, as fractions of the step; {} where the steps
        there do not yet move any price."""
        return self.pricing.step_prices.shares(top)

    @property
    def plan_trials(self) -> PlanTrials:
        """The plan on trial, if any, and what plan trials have cost."""
        return self.trial_search.plans

    def initial(self, *, budget_bytes: int, static_bytes: int = 0) -> Decision:
        target = self.config.target_bytes(budget_bytes)
        ref = self.profile.shape
        pricing = self.pricing
        if not ref.seq_len:
            choice = pricing.solve(ref, target, static_bytes)
            self.table = ()
            return Decision(
                modes=choice.modes,
                table=(),
                predicted_peak_bytes=choice.predicted_peak_bytes,
                predicted_overhead_ratio=overhead_ratio(
                    pricing.at(None).cost(choice.modes)[1], pricing.at(None).forward_seconds
                ),
                target_bytes=target,
                reason=initial_reason(choice, target),
            )
        desired = self.rungs.desired(target, static_bytes)
        self.table = tuple(e for e, _ in desired)
        choice = pricing.solve(ref, target, static_bytes)
        return self._decision(list(self.table), ref, target, static_bytes, initial_reason(choice, target))

    def _decision(
        self, table: list[ShapePlan], shape: Shape, target: int, static: int, reason: str, *, verdict: bool = False
    ) -> Decision:
        """``table`` handed out (:meth:`Pricing.decision`), as what the steps run from now; ``verdict``: a
        trial's (:attr:`Decision.verdict`)."""
        decision = self.pricing.decision(table, shape, target, static, reason)
        self.handed_out = tuple(table)
        return dataclasses.replace(decision, verdict=True) if verdict else decision

    def _handed(self, handed: Handed, obs: StepObservation, target: int) -> Decision:
        """What a step of plan trials hands out, as a decision, its table in force."""
        self.table = handed.table
        return self._decision(handed.handed, obs.shape, target, obs.static_bytes, handed.reason, verdict=handed.over)

    # -- one step -------------------------------------------------------------

    def observe(self, obs: StepObservation, measured_modes: tuple[Mode, ...] | None) -> Decision | None:
        """One step's measurements, taken under ``measured_modes``; a decision when the table changes."""
        target = self.config.target_bytes(usable_bytes(obs))
        self.learned.note_shape(obs.shape)
        self._learn(obs, measured_modes, target)
        bucket = self.bucket_of(obs.shape.seq_len) if obs.shape.seq_len else 0
        ran = entry_for(self.table, obs.shape) if bucket else None
        entry_seq = ran.max_seq_len if ran else 0
        mode_trial = self._explorer.note(obs, bucket, entry_seq, measured_modes)
        seconds = self.planner.fit_seconds(obs)  # scaled as the fit took it: noise alike
        self.trial_step = self.plan_trials.note(entry_seq, measured_modes, seconds, obs.step) or mode_trial
        # A trial too noisy to teach is void before anything is planned from the fit it moved.
        voided = self.trial_search.void()
        moves = self._moves(target, obs.static_bytes)
        # While a plan is on trial its steps move the fit after every pair: a looser or re-balanced plan
        # waits for the trial's verdict, which looks once, at its end (tightening never waits).
        on_trial = self.plan_trials.trial is not None
        change = (
            self._tighten(moves, obs, target)
            or (None if on_trial else self._loosen(moves, obs, target))
            or self._extend(moves, obs, target)
        )
        if change is not None:
            # A new table (made from the table in force, without the trial) overtakes a trial in force.
            self._explorer.stop()
            ended = voided or self.trial_search.end()
            return dataclasses.replace(change, reason=f"{change.reason}; {ended}") if ended else change
        if voided is not None:
            return self._decision(list(self.table), obs.shape, target, obs.static_bytes, voided, verdict=True)
        return self._explore(obs, bucket, ran, target)

    def _explore(self, obs: StepObservation, bucket: int, entry: ShapePlan | None, target: int) -> Decision | None:
        """End a trial that has run its steps, or start one on ``entry`` (the one the step ran with: a
        length held for a phase has its own, below its bucket's top) where a mode is unmeasured at this
        length and the budget allows it (:mod:`rematd.planner.explore`), else a trial of a plan where the
        step-level prices are unsure (:mod:`rematd.planner.trial_search`)."""
        explorer = self._explorer
        if explorer.trial is not None:
            if not explorer.trial_done:
                return None
            over = explorer.stop()
            assert over is not None
            reason = trial_over_reason(over)
            return self._decision(list(self.table), obs.shape, target, obs.static_bytes, reason, verdict=True)
        if self.plan_trials.trial is not None:
            return self._handed(self.trial_search.step(obs, target, self.table), obs, target)
        measured = self.learned.buckets.get(bucket)
        # Only from a settled plan, with this length's peaks measured.
        peaks_measured = measured is not None and len(measured.ratios) >= 2
        tried = self._try_mode(obs, bucket, entry, target) if peaks_measured else None
        if tried is not None:
            return tried
        started = self.trial_search.start(obs, entry, target, peaks_measured, self.table)
        return self._handed(started, obs, target) if started is not None else None

    def _try_mode(self, obs: StepObservation, bucket: int, entry: ShapePlan | None, target: int) -> Decision | None:
        """A trial of a mode not measured at this length on ``entry``, where the budget allows one."""
        started = start_mode_trial(self._explorer, self.pricing, obs, bucket, entry, target)
        if started is None:
            return None
        trial, tried = started
        table = [tried if e is entry else e for e in self.table]
        reason = trial_reason(trial, tried.predicted_peak_bytes, target)
        return self._decision(table, obs.shape, target, obs.static_bytes, reason)

    @property
    def exploring(self) -> bool:
        """Whether a trial (of an unmeasured mode, or of a plan) is in force."""
        return self._explorer.trial is not None or self.plan_trials.trial is not None

    @property
    def explorer(self) -> Explorer:
        """Which modes are measured at which lengths, the trial in force and what trials have cost."""
        return self._explorer

    def _learn(self, obs: StepObservation, measured_modes: tuple[Mode, ...] | None, target: int) -> None:
        """The modes' measured seconds, and the measured/predicted peak of the step's bucket."""
        shape = obs.shape
        at = self.pricing.at(shape)
        modes = measured_modes or tuple(Mode.STORE for _ in at.options)
        predicted = at.other_bytes + at.cost(modes)[0]
        if obs.mode_seconds:
            self.learned.learn_seconds(self.profile, obs, modes)
        self.planner.learn(obs, measured_modes)
        if predicted > 0 and obs.peak_bytes > 0 and shape.seq_len:
            # What the router's choices added is the step's, not the model's: the next step routes anew.
            peak = max(obs.static_bytes, obs.peak_bytes - obs.routed_bytes)
            activations = peak - obs.static_bytes
            cfg = self.config
            ratio = min(cfg.max_correction, max(cfg.min_correction, activations / predicted))
            if obs.routed_bytes and ratio < self.learned.correction(shape.seq_len):
                # What the routing added is the client's estimate, high where a recomputation's rows set the
                # peak: such a step may show the model short, never long.
                return
            crossed = peak > self.pricing.target_at(target, shape.seq_len)
            self.learned.bucket(shape.seq_len).record(ratio, crossed=crossed, step=obs.step, floor=cfg.min_correction)

    def _moves(self, target: int, static: int) -> Moves:
        """Per length, whether the plan the model now prefers is tighter or looser than the one in force."""
        stands = self.trial_search.stands
        desired = self.rungs.desired(target, static)
        moves = weigh(self.pricing, self.planner, self.table, desired, target, static, stands=stands)
        if (moves.tighter or moves.looser) and self.rungs.repriced_later:
            # The table changes anyway: the lengths never timed take their fresh prices in the same change,
            # not in one of their own a few steps on.
            desired = self.rungs.desired(target, static, fresh=True)
            moves = weigh(self.pricing, self.planner, self.table, desired, target, static, stands=stands)
        return moves

    def _tighten(self, moves: Moves, obs: StepObservation, target: int) -> Decision | None:
        if not moves.tighter:
            return None
        learned = self.learned
        learned.headroom_steps = 0
        if obs.step - learned.last_loosen_step <= 2 * learned.dwell:
            # The last loosening was undone quickly: wait longer before the next.
            learned.dwell = min(self.config.max_loosen_after_steps, learned.dwell * 2)
        seq = obs.shape.seq_len
        here = self.pricing.target_at(target, seq)
        cause = (
            f"a step of length {seq} peaked at {human_bytes(obs.peak_bytes)}, over the target of "
            f"{target_named(here, target)}"
            if obs.peak_bytes > here
            else f"steps of {lengths_named(moves.tighter)} are predicted to pass the target of {human_bytes(target)}"
        )
        table = moves.table(moves.tighter)
        # "tighten" only when no length's new modes are predicted to keep more than its old ones.
        verb = "tighten" if not self._keeps_more(table) else "re-balance (the new modes are faster)"
        return self._change(table, obs, target, f"{verb}: {cause}")

    def _keeps_more(self, table: tuple[ShapePlan, ...]) -> bool:
        """Whether some length of ``table`` is predicted to keep more than the plan in force (a trial's entry
        where one runs) keeps there."""
        return any(
            self.pricing.keeps_less(
                old.modes, new.modes, Shape(batch=self.learned.batch, seq_len=seq, tokens=new.max_tokens)
            )
            for seq, old, new in changed(self.handed_out, table)
            if old is not None
        )

    def _loosen(self, moves: Moves, obs: StepObservation, target: int) -> Decision | None:
        learned = self.learned
        if not moves.looser:
            learned.headroom_steps = 0
            return None
        learned.headroom_steps += 1
        if learned.headroom_steps < learned.dwell:
            return None
        learned.headroom_steps = 0
        learned.last_loosen_step = obs.step
        table = moves.table(moves.looser)
        # "loosen" only when it recomputes less; a move to other modes that cost no more memory
        # but were measured faster is said as what it is.
        seq = obs.shape.seq_len
        here = self.pricing.target_at(target, seq)
        room = (
            f"{learned.dwell} steps in a row had room under the target (the last, of length {seq}, peaked at "
            f"{human_bytes(obs.peak_bytes)} of {target_named(here, target)})"
            if obs.peak_bytes <= here
            else f"steps of {lengths_named(moves.looser)} are predicted to fit the target of {human_bytes(target)} "
            "with less recomputation"
        )
        label = (
            f"loosen: {room}"
            if recomputes_less(self.table, table)
            else "re-balance: the measured step times make these modes cheaper, at no more memory"
        )
        return self._change(table, obs, target, label)

    def _extend(self, moves: Moves, obs: StepObservation, target: int) -> Decision | None:
        if not moves.new:
            return None
        added = ", ".join(f"up to {s}" for s in sorted(moves.new))
        reason = f"new sequence length {obs.shape.seq_len}: plans added for lengths {added}"
        return self._change(moves.table([]), obs, target, reason)

    def _change(self, table: tuple[ShapePlan, ...], obs: StepObservation, target: int, cause: str) -> Decision:
        """Put ``table`` in force; the decision, its reason ``cause``, what changed and where the steps'
        times overruled the per-block prices. Every entry is priced for the static memory of this step, those
        whose modes stay too: a plan's figures are all of one moment."""
        table = tuple(self.pricing.replaced(e, e.modes, obs.static_bytes) for e in table)
        # Said against what the steps ran: a trial's entry, where one was in force, not the table it stood in.
        before, self.table = self.handed_out, table
        notes = [self.planner.note(new, target, obs.static_bytes) for _seq, _old, new in changed(before, table)]
        reason = "; ".join([cause, what_changed(before, table), *(n for n in notes if n)])
        return self._decision(list(table), obs.shape, target, obs.static_bytes, reason)

    def restated(self, shape: Shape, target: int, static_bytes: int, cause: str) -> Decision | None:
        """The table in force, each entry's predictions made again for ``static_bytes`` (its modes kept); None
        where that changes nothing."""
        table = [self.pricing.replaced(e, e.modes, static_bytes) for e in self.table]
        if tuple(table) == self.table:
            return None
        self.table = tuple(table)
        return self._decision(table, shape, target, static_bytes, cause)

    def after_oom(self, *, shape: Shape, budget_bytes: int, static_bytes: int) -> Decision:
        """An out-of-memory event: distrust the model at that shape and tighten at once."""
        cfg = self.config
        learned = self.learned
        self._explorer.stop()
        ended = self.trial_search.end()
        seq = shape.seq_len or self.profile.shape.seq_len
        bucket = learned.bucket(seq)
        learned.headroom_steps = 0
        learned.dwell = min(cfg.max_loosen_after_steps, learned.dwell * 2)
        target = cfg.target_bytes(budget_bytes)
        if seq:
            learned.seqs.add(seq)
        current = {e.max_seq_len: e for e in self.table}
        # The entry the step ran with: the one covering its length; past the table the longest one (the client
        # runs its blocks at their leanest instead until a newer plan, so the cap below is conservative).
        before = entry_for(self.table, shape) if seq and shape.seq_len else None
        bucket.boost = min(cfg.max_correction, bucket.boost * cfg.oom_correction_step)
        if before is not None:
            # The plan that failed was wrong by an unknown amount: cap this length and longer ones
            # close to the least any plan needs, and remember it (a cap only ever comes down).
            failed_shape = self.pricing.shape(self.bucket_of(seq))
            failed = self.pricing.at(failed_shape).cost(before.modes)[0]
            floor = self.pricing.at(failed_shape, restricted=True).knapsack.least_peak()[0]
            cap = floor + max(0, failed - floor) // 10 + 1
            bucket.ceiling = cap if bucket.ceiling is None else min(bucket.ceiling, cap)
        table = []
        for entry, _ in self.rungs.desired(target, static_bytes):
            old = current.get(entry.max_seq_len)
            keep_old = old is not None and self.pricing.extra(old.modes, entry.max_seq_len) > self.pricing.extra(
                entry.modes, entry.max_seq_len
            )
            table.append(old if keep_old and old is not None else entry)
        was = self.handed_out
        self.table = tuple(table)
        where = f"at length {shape.seq_len}" if shape.seq_len else "(its length not reported)"
        reason = f"tighten: out-of-memory reported {where}; {what_changed(was, self.table)}"
        reason = f"{reason}; {ended}" if ended else reason
        return self._decision(table, shape, target, static_bytes, reason)

    # -- what it learned, across restarts of the service ----------------------

    def export_state(self) -> dict[str, Any]:
        """What this controller learned from measurements, as plain JSON-able data: per bucket the
        recent measured/predicted ratios, OOM boost, remembered crossing and cap; the dwell and when
        it last loosened; the lengths and batch seen; the modes' measured prices (the sums behind
        :attr:`timing`). ``restore_state`` takes it back."""
        return self.learned.export()

    def restore_state(self, state: dict[str, Any]) -> None:
        """Continue from what ``export_state`` gave (another process's controller over the same profile);
        ValueError, leaving this controller as it was, for anything else."""
        self.pricing.restore(state)
