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

from typing import Any

from rematd.planner.config import ControllerConfig
from rematd.planner.cost import overhead_ratio
from rematd.planner.decision import Decision, Moves
from rematd.planner.explore import Explorer, trial_over_reason, trial_reason
from rematd.planner.model import Profile
from rematd.planner.plan import ShapePlan, entry_for
from rematd.planner.reasons import changed, human_bytes, initial_reason, recomputes_less, what_changed
from rematd.planner.risk import usable_bytes
from rematd.planner.shapes import at_shape
from rematd.planner.solvers import Choice
from rematd.planner.step_planning import LOOSEN_SLACK, StepPlanning
from rematd.planner.steps import StepObservation
from rematd.planner.units import Mode, Shape

REPLAN_GAIN = 0.02
"""A cheaper plan replaces one that fits only where it saves more than this fraction of that plan's extra
seconds: less is the wobble of prices measured anew every step."""

__all__ = ["LOOSEN_SLACK", "Controller", "ControllerConfig", "Decision", "human_bytes"]


class Controller(StepPlanning):
    """Turns a stream of step observations into plan-table changes."""

    def __init__(self, profile: Profile, config: ControllerConfig | None = None) -> None:
        super().__init__(profile, config)
        self._explorer = Explorer(self.config)
        self.trial_step = False
        """Whether the last step observed ran a trial's modes (of a mode or of a plan)."""

    def initial(self, *, budget_bytes: int, static_bytes: int = 0) -> Decision:
        target = self.config.target_bytes(budget_bytes)
        ref = self.profile.shape
        if not ref.seq_len:
            choice = self._solve_at(ref, target, static_bytes)
            self.table = ()
            return Decision(
                modes=choice.modes,
                table=(),
                predicted_peak_bytes=choice.predicted_peak_bytes,
                predicted_overhead_ratio=overhead_ratio(
                    self._at(None).cost(choice.modes)[1], self._at(None).forward_seconds
                ),
                target_bytes=target,
                reason=initial_reason(choice, target),
            )
        desired = self._desired(target, static_bytes)
        self.table = tuple(e for e, _ in desired)
        choice = self._solve_at(ref, target, static_bytes)
        return self._decision(list(self.table), ref, target, static_bytes, initial_reason(choice, target))

    # -- one step -------------------------------------------------------------

    def observe(self, obs: StepObservation, measured_modes: tuple[Mode, ...] | None) -> Decision | None:
        """One step's measurements, taken under ``measured_modes``; a decision when the table changes."""
        target = self.config.target_bytes(usable_bytes(obs))
        self._learned.note_shape(obs.shape)
        self._learn(obs, measured_modes, target)
        bucket = self.bucket_of(obs.shape.seq_len) if obs.shape.seq_len else 0
        ran = entry_for(self.table, obs.shape) if bucket else None
        entry_seq = ran.max_seq_len if ran else 0
        mode_trial = self._explorer.note(obs, bucket, entry_seq, measured_modes)
        self.trial_step = self._plans.note(entry_seq, measured_modes) or mode_trial
        moves = self._moves(target, obs.static_bytes)
        # While a plan is on trial its steps move the fit after every pair: a looser or re-balanced plan
        # waits for the trial's verdict, which looks once, at its end (tightening never waits).
        on_trial = self._plans.trial is not None
        change = (
            self._tighten(moves, obs, target)
            or (None if on_trial else self._loosen(moves, obs, target))
            or self._extend(moves, obs, target)
        )
        if change is not None:
            # A new table (made from the table in force, without the trial) overtakes a trial in force.
            self._explorer.stop()
            self._plans.stop()
            return change
        return self._explore(obs, bucket, ran, target)

    def _explore(self, obs: StepObservation, bucket: int, entry: ShapePlan | None, target: int) -> Decision | None:
        """End a trial that has run its steps, or start one on ``entry`` (the one the step ran with: a
        length held for a phase has its own, below its bucket's top) where a mode is unmeasured at this
        length and the budget allows it (:mod:`rematd.planner.explore`), else a trial of a plan where the
        step-level prices are unsure (:mod:`rematd.planner.plan_trials`)."""
        explorer = self._explorer
        if explorer.trial is not None:
            if not explorer.trial_done:
                return None
            over = explorer.stop()
            assert over is not None
            return self._decision(list(self.table), obs.shape, target, obs.static_bytes, trial_over_reason(over))
        if self._plans.trial is not None:
            return self._step_plan_trial(obs, target)
        measured = self._learned.buckets.get(bucket)
        # Only from a settled plan, with this length's peaks measured.
        peaks_measured = measured is not None and len(measured.ratios) >= 2
        tried = self._try_mode(obs, bucket, entry, target) if peaks_measured else None
        return tried or self._start_plan_trial(obs, entry, target, peaks_measured)

    def _try_mode(self, obs: StepObservation, bucket: int, entry: ShapePlan | None, target: int) -> Decision | None:
        """A trial of a mode not measured at this length on ``entry``, where the budget allows one."""
        explorer, static = self._explorer, obs.static_bytes
        # Only from a settled plan that recomputes something.
        if (
            entry is None
            or self._learned.headroom_steps
            or not explorer.may_start()
            or all(m == Mode.STORE for m in entry.modes)
        ):
            return None
        shape = self._shape(entry.max_seq_len)
        options = at_shape(self.profile, shape, self.config.allowed_modes, self._scales(shape.seq_len)).options
        slack = int(target * LOOSEN_SLACK)
        at = self._at(shape)
        # Never past what an out-of-memory event capped this length at.
        ceiling = self._learned.ceiling(entry.max_seq_len)

        def fits(modes: tuple[Mode, ...]) -> bool:
            below = ceiling is None or at.cost(modes)[0] < ceiling
            return below and self._fits(modes, shape, slack, static, pessimistic=True)

        for mode in explorer.untried(bucket, {o.mode for opts in options for o in opts}, obs.step):
            trial = explorer.propose(
                seq=entry.max_seq_len,
                current=entry.modes,
                mode=mode,
                offers=lambda i, m: any(o.mode == m for o in options[i]),
                fits=fits,
            )
            if trial is None:
                continue
            explorer.start(trial)
            tried = self._replaced(entry, trial.modes, static)
            table = [tried if e is entry else e for e in self.table]
            reason = trial_reason(trial, tried.predicted_peak_bytes, target)
            return self._decision(table, obs.shape, target, static, reason)
        return None

    @property
    def exploring(self) -> bool:
        """Whether a trial (of an unmeasured mode, or of a plan) is in force."""
        return self._explorer.trial is not None or self._plans.trial is not None

    @property
    def explorer(self) -> Explorer:
        """Which modes are measured at which lengths, the trial in force and what trials have cost."""
        return self._explorer

    def _learn(self, obs: StepObservation, measured_modes: tuple[Mode, ...] | None, target: int) -> None:
        """The modes' measured seconds, and the measured/predicted peak of the step's bucket."""
        shape = obs.shape
        at = self._at(shape)
        modes = measured_modes or tuple(Mode.STORE for _ in at.options)
        predicted = at.other_bytes + at.cost(modes)[0]
        if obs.mode_seconds:
            self._learned.learn_seconds(self.profile, obs, modes)
        self._learn_step_time(obs, measured_modes)
        if predicted > 0 and obs.peak_bytes > 0 and shape.seq_len:
            activations = max(0, obs.peak_bytes - obs.static_bytes)
            cfg = self.config
            ratio = min(cfg.max_correction, max(cfg.min_correction, activations / predicted))
            crossed = obs.peak_bytes > self._target_at(target, shape.seq_len)
            self._learned.bucket(shape.seq_len).record(ratio, crossed=crossed, step=obs.step, floor=cfg.min_correction)

    def _moves(self, target: int, static: int) -> Moves:
        """Per length, whether the plan the model now prefers is tighter or looser than the one in force."""
        moves = self._weigh(self._desired(target, static), target, static)
        if (moves.tighter or moves.looser) and self._repriced_later:
            # The table changes anyway: the lengths never timed take their fresh prices in the same change,
            # not in one of their own a few steps on.
            moves = self._weigh(self._desired(target, static, fresh=True), target, static)
        return moves

    def _weigh(self, desired: list[tuple[ShapePlan, Choice]], target: int, static: int) -> Moves:
        """:meth:`_moves` for the entries ``desired``."""
        current = {e.max_seq_len: e for e in self.table}
        moves = Moves(current=current, desired={e.max_seq_len: e for e, _ in desired})
        moves.new = [seq for seq in moves.desired if seq not in current]
        for entry, choice in desired:
            seq = entry.max_seq_len
            # Where the peaks have settled, their spread is the slack: the pessimistic correction holds it.
            slack = target if self._learned.settled(seq) else int(target * LOOSEN_SLACK)
            old = current.get(seq)
            if old is None or old.modes == entry.modes:
                continue
            old_shape = Shape(batch=self._learned.batch, seq_len=seq, tokens=entry.max_tokens)
            # Priced as chosen: by the step-level prices where they chose the plan, else per block.
            per_block = not self._by_steps(entry.modes, seq, target, static)
            # Where no plan fits the target, a plan in force under the budget holds: its steps cross the target
            # as every plan's would, and swapping it for another under the budget at each step is flapping.
            holds = self._fits(old.modes, old_shape, target, static) or (
                not choice.fits and self._under_budget(old.modes, old_shape, target, static)
            )
            if not holds and not choice.fits and not self._keeps_less(entry.modes, old.modes, old_shape):
                # Nothing fits there: a plan that keeps no less than the one in force tightens nothing, and
                # trading one for the other as the corrections wobble is flapping.
                continue
            if not holds or self._extra(entry.modes, seq, per_block=per_block) > self._extra(
                old.modes, seq, per_block=per_block
            ):
                moves.tighter.append(seq)
                continue
            leaner = not self._keeps_less(old.modes, entry.modes, old_shape)
            goal = target
            # Loosen only to what fits under the worst recent measurement, with slack: a plan whose own
            # measurements would undo it is never adopted. Short of that, the best plan that does fit.
            if not leaner and not self._fits(entry.modes, old_shape, slack, static, pessimistic=True):
                goal = slack
                entry = self._entry(seq, self._choose(old_shape, slack, static), static)
                per_block = not self._by_steps(entry.modes, seq, slack, static)
                if entry.modes == old.modes:
                    continue
                if not self._fits(entry.modes, old_shape, slack, static, pessimistic=True):
                    continue
                moves.desired[seq] = entry
            # Cheaper, where the plan in force fits: worth a new plan only for a saving above the prices'
            # wobble (measured seconds move a little with every step, and a plan must not follow them
            # back and forth between two plans that cost about the same).
            if not self._saves_enough(old.modes, entry.modes, seq, per_block):
                continue
            # A plan the steps chose stays while they show it surely faster; one they choose waits until
            # they show it surely faster than the plan in force. Both against what the per-block prices
            # choose for the target the entry was chosen for: else a plan chosen under the slack is
            # weighed against the per-block choice of another target, and plans go back and forth.
            if self._held(old.modes, entry.modes, seq, goal, static):
                continue
            moves.looser.append(seq)
        return moves

    def _saves_enough(self, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int, per_block: bool) -> bool:
        """Whether ``new`` costs less than ``old`` at ``seq`` by more than ``REPLAN_GAIN`` of ``old``'s extra
        seconds, priced as ``new`` was chosen."""
        before = self._extra(old, seq, per_block=per_block)
        return self._extra(new, seq, per_block=per_block) < before - REPLAN_GAIN * abs(before)

    def _tighten(self, moves: Moves, obs: StepObservation, target: int) -> Decision | None:
        if not moves.tighter:
            return None
        learned = self._learned
        learned.headroom_steps = 0
        if obs.step - learned.last_loosen_step <= 2 * learned.dwell:
            # The last loosening was undone quickly: wait longer before the next.
            learned.dwell = min(self.config.max_loosen_after_steps, learned.dwell * 2)
        seq = obs.shape.seq_len
        here = self._target_at(target, seq)
        cause = (
            f"a step of length {seq} peaked at {human_bytes(obs.peak_bytes)}, over the target of "
            f"{_target(here, target)}"
            if obs.peak_bytes > here
            else f"steps of {_lengths(moves.tighter)} are predicted to pass the target of {human_bytes(target)}"
        )
        table = moves.table(moves.tighter)
        # "tighten" only when no length's new modes are predicted to keep more than its old ones.
        verb = "tighten" if not self._keeps_more(table) else "re-balance (the new modes are faster)"
        return self._change(table, obs, target, f"{verb}: {cause}")

    def _keeps_less(self, new: tuple[Mode, ...], old: tuple[Mode, ...], shape: Shape) -> bool:
        """Whether ``new`` is predicted to keep less than ``old`` at ``shape``."""
        at = self._at(shape)
        return at.cost(new)[0] < at.cost(old)[0]

    def _keeps_more(self, table: tuple[ShapePlan, ...]) -> bool:
        """Whether some length of ``table`` is predicted to keep more than the plan in force (a trial's entry
        where one runs) keeps there."""
        return any(
            self._keeps_less(old.modes, new.modes, Shape(batch=self._learned.batch, seq_len=seq, tokens=new.max_tokens))
            for seq, old, new in changed(self.handed_out, table)
            if old is not None
        )

    def _loosen(self, moves: Moves, obs: StepObservation, target: int) -> Decision | None:
        learned = self._learned
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
        here = self._target_at(target, seq)
        room = (
            f"{learned.dwell} steps in a row had room under the target (the last, of length {seq}, peaked at "
            f"{human_bytes(obs.peak_bytes)} of {_target(here, target)})"
            if obs.peak_bytes <= here
            else f"steps of {_lengths(moves.looser)} are predicted to fit the target of {human_bytes(target)} with "
            "less recomputation"
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
        table = tuple(self._replaced(e, e.modes, obs.static_bytes) for e in table)
        # Said against what the steps ran: a trial's entry, where one was in force, not the table it stood in.
        before, self.table = self.handed_out, table
        notes = [self._step_note(new, target, obs.static_bytes) for _seq, _old, new in changed(before, table)]
        reason = "; ".join([cause, what_changed(before, table), *(n for n in notes if n)])
        return self._decision(list(table), obs.shape, target, obs.static_bytes, reason)

    def restated(self, shape: Shape, target: int, static_bytes: int, cause: str) -> Decision | None:
        """The table in force, each entry's predictions made again for ``static_bytes`` (its modes kept); None
        where that changes nothing."""
        table = [self._replaced(e, e.modes, static_bytes) for e in self.table]
        if tuple(table) == self.table:
            return None
        self.table = tuple(table)
        return self._decision(table, shape, target, static_bytes, cause)

    def after_oom(self, *, shape: Shape, budget_bytes: int, static_bytes: int) -> Decision:
        """An out-of-memory event: distrust the model at that shape and tighten at once."""
        cfg = self.config
        learned = self._learned
        self._explorer.stop()
        self._plans.stop()
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
            failed_shape = self._shape(self.bucket_of(seq))
            failed = self._at(failed_shape).cost(before.modes)[0]
            floor = self._at(failed_shape, restricted=True).knapsack.least_peak()[0]
            cap = floor + max(0, failed - floor) // 10 + 1
            bucket.ceiling = cap if bucket.ceiling is None else min(bucket.ceiling, cap)
        table = []
        for entry, _ in self._desired(target, static_bytes):
            old = current.get(entry.max_seq_len)
            keep_old = old is not None and self._extra(old.modes, entry.max_seq_len) > self._extra(
                entry.modes, entry.max_seq_len
            )
            table.append(old if keep_old and old is not None else entry)
        was = self.handed_out
        self.table = tuple(table)
        where = f"at length {shape.seq_len}" if shape.seq_len else "(its length not reported)"
        reason = f"tighten: out-of-memory reported {where}; {what_changed(was, self.table)}"
        return self._decision(table, shape, target, static_bytes, reason)

    # -- what it learned, across restarts of the service ----------------------

    def export_state(self) -> dict[str, Any]:
        """What this controller learned from measurements, as plain JSON-able data: per bucket the
        recent measured/predicted ratios, OOM boost, remembered crossing and cap; the dwell and when
        it last loosened; the lengths and batch seen; the modes' measured prices (the sums behind
        :attr:`timing`). ``restore_state`` takes it back."""
        return self._learned.export()

    def restore_state(self, state: dict[str, Any]) -> None:
        """Continue from what ``export_state`` gave (another process's controller over the same profile);
        ValueError, leaving this controller as it was, for anything else."""
        self._learned = self._learned.restored(state)
        self._cache.clear()


def _lengths(seqs: list[int]) -> str:
    """Table lengths as a reason names them: "length 64", "lengths 128 and 256", "lengths 64 to 512"."""
    ordered = sorted(seqs)
    if len(ordered) == 1:
        return f"length {ordered[0]}"
    if len(ordered) == 2:
        return f"lengths {ordered[0]} and {ordered[1]}"
    return f"lengths {ordered[0]} to {ordered[-1]}"


def _target(here: int, target: int) -> str:
    """A length's target as a reason quotes it: the target, or the wider one its settled peaks earned."""
    return human_bytes(here) if here == target else f"{human_bytes(here)} (its peaks settled: a smaller margin)"
