"""Weighing the table the measurements call for against the one in force, length by length: which entries
must tighten, which may loosen (once they have had room long enough), which lengths are new."""

from __future__ import annotations

from collections.abc import Callable

from rematd.planner.decision import Moves
from rematd.planner.plan import ShapePlan
from rematd.planner.pricing import Pricing
from rematd.planner.solvers import Choice
from rematd.planner.step_planning import StepPlanner, loosen_limit
from rematd.planner.units import Mode, Shape

REPLAN_GAIN = 0.02
"""A cheaper plan replaces one that fits only where it saves more than this fraction of that plan's extra
seconds: less is the wobble of prices measured anew every step."""


def weigh(
    pricing: Pricing,
    planner: StepPlanner,
    table: tuple[ShapePlan, ...],
    desired: list[tuple[ShapePlan, Choice]],
    target: int,
    static: int,
    *,
    stands: Callable[[tuple[Mode, ...], tuple[Mode, ...], int], bool] | None = None,
) -> Moves:
    """Per length, whether the entry ``desired`` there (with the choice behind it) is tighter or looser than
    the one in force in ``table``, or new. ``stands(old, new, seq)``: whether a trial's verdict keeps the plan
    in force ``old`` at the entry up to ``seq`` against ``new`` on prices (:meth:`TrialSearch.stands`)."""
    current = {e.max_seq_len: e for e in table}
    moves = Moves(current=current, desired={e.max_seq_len: e for e, _ in desired})
    moves.new = [seq for seq in moves.desired if seq not in current]
    for entry, choice in desired:
        seq = entry.max_seq_len
        slack = loosen_limit(pricing, target, seq)
        old = current.get(seq)
        if old is None or old.modes == entry.modes:
            continue
        old_shape = Shape(batch=pricing.learned.batch, seq_len=seq, tokens=entry.max_tokens)
        # Priced as chosen: by the step-level prices where they chose the plan, else per block.
        per_block = not planner.by_steps(entry.modes, seq, target, static)
        # Where no plan fits the target, a plan in force under the budget holds: its steps cross the target
        # as every plan's would, and swapping it for another under the budget at each step is flapping.
        holds = pricing.fits(old.modes, old_shape, target, static) or (
            not choice.fits and pricing.under_budget(old.modes, old_shape, target, static)
        )
        if not holds and not choice.fits and not pricing.keeps_less(entry.modes, old.modes, old_shape):
            # Nothing fits there: a plan that keeps no less than the one in force tightens nothing, and
            # trading one for the other as the corrections wobble is flapping.
            continue
        if not holds or pricing.extra(entry.modes, seq, per_block=per_block) > pricing.extra(
            old.modes, seq, per_block=per_block
        ):
            moves.tighter.append(seq)
            continue
        leaner = not pricing.keeps_less(old.modes, entry.modes, old_shape)
        goal = target
        # Loosen only to what fits under the worst recent measurement, with slack: a plan whose own
        # measurements would undo it is never adopted. Short of that, the best plan that does fit.
        if not leaner and not pricing.fits(entry.modes, old_shape, slack, static, pessimistic=True):
            goal = slack
            # Chosen under the ordinary correction, a plan may fit the slack only under it. Where the
            # ratios' spread sets the pessimistic one, choose under a limit narrowed by the two's ratio (a
            # remembered crossing instead waits to fade: the plan that crossed is not to come back early).
            if pricing.learned.spread_sets_pessimistic(seq):
                goal = pricing.pessimistic_limit(slack, seq, static)
            entry = pricing.entry(seq, planner.choose(old_shape, goal, static), static)
            per_block = not planner.by_steps(entry.modes, seq, goal, static)
            if entry.modes == old.modes:
                continue
            if not pricing.fits(entry.modes, old_shape, slack, static, pessimistic=True):
                continue
            moves.desired[seq] = entry
        # Cheaper, where the plan in force fits: worth a new plan only for a saving above the prices'
        # wobble (measured seconds move a little with every step, and a plan must not follow them
        # back and forth between two plans that cost about the same).
        if not _saves_enough(pricing, old.modes, entry.modes, seq, per_block):
            continue
        # A plan the steps chose stays while they show it surely faster; one they choose waits until
        # they show it surely faster than the plan in force. Both against what the per-block prices
        # choose for the target the entry was chosen for: else a plan chosen under the slack is
        # weighed against the per-block choice of another target, and plans go back and forth.
        if planner.held(old.modes, entry.modes, seq, goal, static):
            continue
        # A plan a trial kept stays against what that trial weighed until trials weigh it again: the fit's
        # prices alone, a few noisy steps on, rest on that trial's pairs.
        if stands is not None and stands(old.modes, entry.modes, seq):
            continue
        moves.looser.append(seq)
    return moves


def _saves_enough(pricing: Pricing, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int, per_block: bool) -> bool:
    """Whether ``new`` costs less than ``old`` at ``seq`` by more than ``REPLAN_GAIN`` of ``old``'s extra
    seconds, priced as ``new`` was chosen."""
    before = pricing.extra(old, seq, per_block=per_block)
    return pricing.extra(new, seq, per_block=per_block) < before - REPLAN_GAIN * abs(before)
