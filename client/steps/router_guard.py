"""Plans that follow the router: a step whose experts receive more tokens than its plan assumed keeps less in the
blocks still to come, before its forward crosses the budget.

A plan is chosen before the step's forward, and what a mixture of experts' block keeps depends on a choice made
inside it: the rows the router sends each rank's experts (:mod:`rematd.client.blocks.experts`). Under expert
parallel a batch whose tokens pick one expert sends the rank holding it up to the whole group's tokens. The
profile measured, per block and mode, the bytes with a row per routed token; each bank's forward hook reads the
rows it received, and the step's projected peak is the plan's prediction with those bytes at the rows seen (a
block still to come at the most any block has seen this step, over its typical rows: the median of recent steps').
The projection follows the planner's model of a peak in backward order (:func:`rematd.planner.peak_in_order`), and
what it leaves out (static memory, the model's error for these modes) is the larger of the plan's figure and the
steps': those that ran these modes, or for modes not run yet (a new plan's first step) the most any recent step
left out. Past the point halfway from the plan's target to the budget, the blocks that have not run yet switch to
leaner modes of their profile's (the most bytes for the least recomputation first) until the projection is back
under the target; the next step starts from the plan again.

Ranks that run one plan (sharded ranks, and so expert parallel inside them) decide together, after the first
expert bank's block of every step: each puts forward its own modes and all run the leanest any rank put forward
(the same fixed-size all-reduce as at the step's start), so a recomputation replays every all-to-all on every
rank. Ranks that plan alone look at every bank. A pin is left as it is. The step's report carries the bytes the
routing added, so the planner does not take a skewed step for an error of its own.
"""

from __future__ import annotations

import functools
import logging
import statistics
from collections import deque
from typing import Protocol

import torch

from rematd.client.blocks.experts import watch_rows
from rematd.client.blocks.profiling import BlockMeasure
from rematd.client.blocks.switchable import SwitchableBlock
from rematd.client.parallel.agreement import CODES, MODES
from rematd.client.parallel.base import SetUp
from rematd.client.plans.applier import PlanApplier
from rematd.client.steps.modes_run import RERUN, ModesRun
from rematd.planner import Mode, ModeCost, Shape, letters, peak_in_order

log = logging.getLogger("rematd.client")


class Cycle(Protocol):
    """What the guard reads and sets of the step cycle (:class:`rematd.client.steps.boundaries.StepCycle`)."""

    blocks: list[SwitchableBlock]
    shape: Shape
    budget_bytes: int | None
    applier: PlanApplier
    run: ModesRun
    setup: SetUp
    step: int
    errors: int


HISTORY = 15
"""Planned steps whose rows make a bank's typical step (their median: a skewed step now and then moves it little)."""
SKEWED = 1.25
"""A step is skewed where a bank received this many times its typical rows, and more than :data:`SPREAD` times
their usual spread above them (a balanced router's rows vary from step to step, the more so the fewer they are):
a block still to come is then projected at the most rows any bank received this step, if that is more (a batch
of one kind of token sends each layer's router the same way), and the step reports what its routing added."""
SPREAD = 4.0
"""Robust standard deviations (1.4826 times the median absolute deviation) above typical that skewed rows pass."""
TYPICAL = -1.0
"""The load that sizes every block at its typical rows, whether or not it has run (:meth:`RouterGuard._rows`); a
load of None sizes them at the profile's, as the planner does."""
RESIDUALS = 64
"""Modes whose steps' residuals (:meth:`RouterGuard.step_ends`) are kept at once; past it they start again."""
SLACK = 0.5
"""How far past the plan's target, as a share of the way to the budget, a projection must go before blocks switch:
the margin below the target absorbs the ordinary spread of a balanced router's rows from step to step."""


class RouterGuard:
    """Reads each expert bank's rows as the step's forward runs, and keeps the step under the budget."""

    def __init__(self, cycle: Cycle) -> None:
        self.cycle = cycle
        blocks = cycle.blocks
        self.banks = [b.index for b in blocks if b.bank is not None]
        self.rows = [0] * len(blocks)
        """Rows each block's bank received in this step's first forward."""
        self._seen = [False] * len(blocks)
        """Whether each block's bank (or, for the decision, the block) has run in this step's first forward."""
        self.armed = False
        """Whether this step may switch blocks (a planned step, no pin)."""
        self.agreeing = False
        """Whether this step's ranks decide together after the first bank's block (every rank, every step the
        step's start agrees: a collective all must reach)."""
        self.load = 0.0
        """The most rows any bank received this step, over its typical step's."""
        self.skewed = False
        """Whether some bank received skewed rows this step (:data:`SKEWED`)."""
        self.routed_bytes = 0
        """What the step's routing added to its peak over typical rows, by the profile's measure, under the modes
        that ran (an estimate, high rather than low where the peak is in backward: a planner learns from such a
        step only that its model is short)."""
        self._failed = False
        self._decided = False
        """Whether the ranks decided this step (the first bank's block runs again in a later microbatch)."""
        self._sized: dict[tuple[int, Mode], tuple[int, int]] = {}
        """Per block and mode, its (kept, held) bytes at typical rows for :attr:`_sized_shape`."""
        self._sized_shape: Shape | None = None
        self._most = 0
        """The most rows any bank received this step."""
        self._outside = (0, 1.0)
        """The last step's memory outside the blocks where the planner models it apart (0 where it is held
        throughout backward, as on CUDA: then it is in the residual), and the share of it backward holds."""
        self._placed: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        """Per block, the microbatches alive at once at the peak and the stage of the rank's it runs in."""
        self._residuals: dict[tuple[Shape, tuple[Mode, ...]], deque[int]] = {}
        """Per shape and modes run, the recent steps' peaks less their projection at the rows they received."""
        self._recent: deque[tuple[Shape, int]] = deque(maxlen=HISTORY)
        """The recent steps' shapes and residuals, whatever their modes."""
        self.history: dict[int, deque[float]] = {i: deque(maxlen=HISTORY) for i in self.banks}
        """Per bank, the rows it received per token of the step, over the last steps."""
        self._typical: dict[int, tuple[float, float]] = {}
        """Per bank, the median and the robust spread of :attr:`history` (once it has any)."""
        self.hooks = [
            watch_rows(bank, functools.partial(self.seen, b.index)) for b in blocks if (bank := b.bank) is not None
        ]
        # After each bank's block has run (its forward hook, before the next block is called): the blocks still
        # to come may switch. A block's hook fires whether or not its bank received any rows.
        self.hooks += [blocks[i].module.register_forward_hook(functools.partial(self._ran, i)) for i in self.banks]

    def remove(self) -> None:
        """Take the hooks off the banks and blocks (the handle closes): no later forward reaches the guard."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.armed = self.agreeing = False

    def step_begins(self, armed: bool, agreeing: bool) -> None:
        """``armed``: the step may switch blocks; ``agreeing``: its ranks decide together (the step's start
        agreed), whether or not this one is armed."""
        self.armed = armed and not self._failed
        self.agreeing = agreeing
        self._decided = False
        self.skewed = False
        self.load = 0.0
        self._most = 0
        self.routed_bytes = 0
        rows, seen = self.rows, self._seen
        for i in self.banks:
            rows[i] = 0
            seen[i] = False

    def step_ends(self, peak: int, outside: int = 0, in_backward: float = 1.0) -> int:
        """The step ended at ``peak`` (what the budget caps), ``outside`` of it outside the blocks (where counted
        apart), ``in_backward`` of that held while their backward runs; returns :attr:`routed_bytes`."""
        if self._failed:
            return 0
        try:
            self._outside = (outside, in_backward)
            modes = tuple(b.mode for b in self.cycle.blocks)
            self.skewed = self.skewed or any(self._skewed(i) for i in self.banks if self._seen[i])
            if all(b.measure is not None for b in self.cycle.blocks):
                projected = self._project(modes, max(self.load, 1.0))
                if self.skewed:
                    # Only a skewed step's: the ordinary spread of the rows, above typical and below, is the
                    # planner's to learn like any other.
                    self.routed_bytes = max(0, projected - self._project(modes, TYPICAL))
                if peak:
                    self._note_residual(modes, peak - projected)
            tokens = self.cycle.shape.tokens
            if tokens:
                for i in self.banks:
                    if self._seen[i]:
                        self.history[i].append(self.rows[i] / tokens)
                        self._typical[i] = _median_and_spread(self.history[i])
        except Exception:
            self._fail()
        return self.routed_bytes

    def seen(self, index: int, rows: int) -> None:
        """Block ``index``'s bank received ``rows`` (its forward hook)."""
        if self._seen[index]:
            return  # a second microbatch: the step's first forward decides
        self._seen[index] = True
        self.rows[index] = rows
        self._most = max(self._most, rows)

    def _ran(self, index: int, _m: object, _args: object, _out: object) -> None:
        """Block ``index`` (one with a bank) ran its forward: the blocks after it may switch."""
        if not torch.is_grad_enabled() or not (self.armed or self.agreeing):
            return
        first = index == self.banks[0]
        if self.agreeing:
            if first and not self._decided:
                self._decided = True
                self._agree(index)
            return
        try:
            self._look(index)
        except Exception:
            self._fail()

    def _note_residual(self, modes: tuple[Mode, ...], residual: int) -> None:
        """What the step's peak held beyond the projection of ``modes`` at the rows its banks received: static
        memory, and the model's error for these modes (which differs from modes to modes by a share of it)."""
        shape = self.cycle.shape
        key = (shape, modes)
        kept = self._residuals.get(key)
        if kept is None:
            if len(self._residuals) >= RESIDUALS:
                self._residuals.clear()
            kept = self._residuals[key] = deque(maxlen=HISTORY)
        kept.append(residual)
        self._recent.append((shape, residual))

    def _residual(self, modes: tuple[Mode, ...]) -> int | None:
        """What a step of ``modes`` at this shape holds beyond their projection, by the steps: the most the
        recent ones that ran them left out, or, where none did, the most any recent step left out (a plan's
        first step: its modes' own error is not known yet). None before any step of this shape."""
        shape = self.cycle.shape
        own = self._residuals.get((shape, modes))
        if own:
            return max(own)
        return max((r for s, r in self._recent if s == shape), default=None)

    def _fail(self) -> None:
        self._failed, self.armed = True, False
        self.cycle.errors += 1
        log.exception("rematd: following the router's choices failed; plans no longer react to them")

    # -- the projection -------------------------------------------------------

    def _expected(self, index: int) -> float:
        """The rows block ``index``'s bank receives on a typical step of this shape: the median, per token, of
        the last :data:`HISTORY` steps' (the profile's before it has seen any)."""
        now = self.cycle.shape.tokens
        typical = self._typical.get(index)
        if typical is not None and now:
            return typical[0] * now
        return self._profiled_rows(index)

    def _cost(self, measure: BlockMeasure, mode: Mode) -> ModeCost | None:
        return next((c for c in measure.modes if c.mode is mode), None)

    def _block(self, index: int, mode: Mode, load: float | None) -> tuple[int, int]:
        """(kept, held while recomputing) bytes of block ``index`` in ``mode`` at the rows :meth:`_rows` gives."""
        b = self.cycle.blocks[index]
        measure = b.measure
        assert measure is not None
        now = self.cycle.shape
        if now is not self._sized_shape:
            self._sized, self._sized_shape = {}, now
        sized = self._sized.get((index, mode))
        if sized is None:
            cost = self._cost(measure, mode)
            profiled = b.profile_shape
            if cost is None:
                sized = (0, 0)
            else:
                # While it rematerialises the block holds its transient less what its backward has released.
                held = cost.transient.at(profiled, now) - cost.released.at(profiled, now)
                sized = (cost.kept.at(profiled, now), max(0, held))
            self._sized[(index, mode)] = sized
        kept, held = sized
        if load is None or not measure.routed_rows:
            return kept, held
        # The profile's sizes hold its rows, scaled with the tokens: the rows the planner's model assumes.
        extra = (self._rows(index, load) - self._profiled_rows(index)) / measure.routed_rows
        routed_kept, routed_held = measure.routed.get(mode, (0, 0))
        return max(0, kept + int(routed_kept * extra)), max(0, held + int(routed_held * extra))

    def _profiled_rows(self, index: int) -> float:
        """The rows the profile's sizes of block ``index`` hold at this step's shape."""
        b = self.cycle.blocks[index]
        assert b.measure is not None
        profiled, now = b.profile_shape.tokens, self.cycle.shape.tokens
        return b.measure.routed_rows * (now / profiled if profiled and now else 1.0)

    def _rows(self, index: int, load: float) -> float:
        """The rows block ``index`` is sized at: its typical rows with ``load`` :data:`TYPICAL`; otherwise those
        it received this step, or where it has not run yet ``load`` times its typical rows (at least them, and
        on a skewed step at least the most any bank received)."""
        if load == TYPICAL:
            return self._expected(index)
        if self._seen[index]:
            return self.rows[index]
        return max(self._expected(index) * max(load, 1.0), self._most if self.skewed else 0)

    def _project(self, modes: tuple[Mode, ...], load: float | None) -> int:
        """The step's peak under ``modes`` less static memory, by the planner's model of a peak in backward
        order: the blocks' bytes (at ``load`` as :meth:`_block` sizes them) and the memory outside them."""
        flights, stages = self._placement()
        moments = []
        for i, mode in enumerate(modes):
            kept, held = self._block(i, mode, load)
            moments.append((kept, held, (flights[i] - 1) * kept, stages[i]))
        outside, in_backward = self._outside
        return peak_in_order(moments, outside_bytes=outside, outside_in_backward=in_backward)

    def _placement(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per block, the microbatches alive at once at the peak, and the stage of the rank's it runs in."""
        placed = self._placed
        if placed is None:
            count = len(self.cycle.blocks)
            setup = self.cycle.setup
            placed = self._placed = (setup.in_flight(count), setup.stages(count))
        return placed

    # -- the decision ---------------------------------------------------------

    def _proposal(self, index: int) -> tuple[tuple[Mode, ...], str]:
        """The modes this rank would run for the rest of the step after block ``index``, and why."""
        blocks = self.cycle.blocks
        modes = tuple(b.mode for b in blocks)
        if not self._note_load(index) or any(b.measure is None for b in blocks):
            return modes, ""
        plan = self.cycle.applier.in_force()
        return self._leaner(index, modes, plan.predicted_peak_bytes, plan.target_bytes)

    def _note_load(self, index: int) -> bool:
        """Take block ``index``'s rows into the step's load; whether this rank may propose after it."""
        measure = self.cycle.blocks[index].measure
        if not self.armed or measure is None or not measure.routed_rows:
            return False
        if self._seen[index]:
            self.load = max(self.load, self.rows[index] / max(1.0, self._expected(index)))
            self.skewed = self.skewed or self._skewed(index)
        return True

    def _skewed(self, index: int) -> bool:
        """Whether block ``index``'s bank received skewed rows this step (:data:`SKEWED`)."""
        expected = self._expected(index)
        typical = self._typical.get(index)
        spread = SPREAD * typical[1] * self.cycle.shape.tokens if typical is not None else 0.0
        return self.rows[index] > expected + max((SKEWED - 1.0) * expected, spread)

    def _look(self, index: int) -> None:
        """A rank that plans alone: after the first bank's block every step (the last step's peak may say the
        plan no longer fits), after the others where the step's rows run above typical."""
        if not self._note_load(index) or (index != self.banks[0] and not self.skewed):
            return
        proposed, why = self._proposal(index)
        if proposed != tuple(b.mode for b in self.cycle.blocks):
            self._switch(proposed, why)

    def _agree(self, index: int) -> None:
        """Ranks that run one plan: each puts forward its proposal (its modes as they are where it cannot
        propose), and all run the leanest any put forward, so that every rank's recomputation replays the same
        collectives."""
        cycle = self.cycle
        agreement = cycle.setup.agreement
        assert agreement is not None
        modes = tuple(b.mode for b in cycle.blocks)
        try:
            proposed, why = self._proposal(index)
        except Exception:
            self._fail()
            proposed, why = modes, ""
        own = [CODES[m] for m in proposed]
        chosen, _ = agreement.agree(own, cycle.applier.plan.version)
        if chosen != own:
            proposed = tuple(MODES[c] for c in chosen)
            why = why or "another rank's experts received more tokens than its plan assumed"
        if proposed != modes:
            self._switch(proposed, why)

    def _leaner(self, index: int, modes: tuple[Mode, ...], predicted: int, target: int) -> tuple[tuple[Mode, ...], str]:
        """The modes to run for the rest of the step, and why (the same modes, and no reason, where they fit)."""
        budget = self.cycle.budget_bytes or 0
        if not predicted or not budget:
            return modes, ""
        target = min(target or budget, budget)
        other = predicted - self._project(modes, None)
        residual = self._residual(modes)
        if residual is not None:
            other = max(other, residual)
        before = other + self._project(modes, self.load)
        if before <= target + SLACK * (budget - target):
            return modes, ""
        blocks = self.cycle.blocks
        current = list(modes)
        choices = []
        for j in range(index + 1, len(blocks)):
            best = self._best(j, modes[j])
            if best is not None:
                choices.append(best)
        # The most bytes for the least recomputation first.
        choices.sort(key=lambda c: c[0], reverse=True)
        projected = before
        for _, j, mode in choices:
            if projected <= target:
                break
            current[j] = mode
            projected = other + self._project(tuple(current), self.load)
        proposed = tuple(current)
        changed = [blocks[j].name for j in range(len(blocks)) if proposed[j] is not modes[j]]
        if not changed:
            return modes, ""
        mib = 2**20
        why = (
            f"the router sent block {blocks[index].name}'s experts {self.rows[index]} token rows, {self.load:.2f}x "
            f"a typical step's: {', '.join(changed)} keep less this step ({letters(proposed)}), the projected "
            f"peak {before / mib:.1f} -> {projected / mib:.1f} MiB against the target {target / mib:.1f} MiB"
        )
        return proposed, why

    def _best(self, index: int, mode: Mode) -> tuple[float, int, Mode] | None:
        """Block ``index``'s leaner mode with the most bytes saved per second added, at this step's rows:
        (bytes per second, index, mode), or None where it has none."""
        b = self.cycle.blocks[index]
        measure = b.measure
        assert measure is not None
        now = self._cost(measure, mode)
        if now is None:
            return None
        kept_now = self._block(index, mode, self.load)[0]
        best: tuple[float, int, Mode] | None = None
        for cost in measure.modes:
            if cost.mode is mode or cost.mode not in b.offer or cost.mode is Mode.OFFLOAD:
                continue
            saved = kept_now - self._block(index, cost.mode, self.load)[0]
            if saved <= 0:
                continue
            score = saved / max(1e-6, cost.extra_seconds - now.extra_seconds)
            if best is None or score > best[0]:
                best = (score, index, cost.mode)
        return best

    def _switch(self, modes: tuple[Mode, ...], why: str) -> None:
        """The blocks still to come run ``modes`` for the rest of this step."""
        cycle = self.cycle
        for b, mode in zip(cycle.blocks, modes, strict=True):
            if mode is not b.mode:
                b.run_bare(False)  # a block running bare would not see the change
                b.mode = mode
        run = cycle.run
        run.modes, run.ran = modes, modes
        run.rerun = tuple(m in RERUN for m in modes)
        cycle.setup.step_begins(run.rerun)
        cycle.applier.ran_why = why
        cycle.applier.invalidate()  # the next step sets its modes from the plan again
        log.info("rematd: step %d: %s", cycle.step, why)


def _median_and_spread(values: deque[float]) -> tuple[float, float]:
    """The median of ``values`` and 1.4826 times their median absolute deviation (a standard deviation's
    estimate that a skewed value now and then moves little)."""
    median = statistics.median(values)
    return median, 1.4826 * statistics.median(abs(v - median) for v in values)
