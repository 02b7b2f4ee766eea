"""The plan table's arithmetic: what the profile costs at a length (with the measured prices), the cheapest
plan that fits a target there once corrected by the measured peaks, an entry of the table, and whether a
plan fits."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from rematd.planner.config import ControllerConfig
from rematd.planner.cost import overhead_ratio
from rematd.planner.decision import Decision
from rematd.planner.learned import Learned
from rematd.planner.model import Profile
from rematd.planner.plan import ShapePlan, entry_for
from rematd.planner.reasons import human_bytes
from rematd.planner.shapes import AtShape, Offsets, Scales, at_shape
from rematd.planner.solvers import Choice, solve_prepared
from rematd.planner.step_pricing import StepPricing
from rematd.planner.timing import PRICED, BucketTimes
from rematd.planner.units import Mode, Shape

CACHED_CHOICES = 128
"""Solved plans kept before the cache starts over: each length's, under the correction and the scales in
force there (each bucket's scales move on their own, so several per length stay in use)."""
CACHED_ENTRIES = 64
"""Table entries kept before their cache starts over."""


class SolveKey(NamedTuple):
    """What the cheapest plan that fits at a length depends on."""

    batch: int
    seq: int
    target: int
    correction: int
    """The measured peaks' correction there, in hundredths."""
    static: int
    ceiling: int | None
    scales: Scales
    offsets: Offsets


class EntryKey(NamedTuple):
    """What a table entry's figures depend on."""

    choice: Choice
    seq: int
    batch: int
    static: int
    scales: Scales
    offsets: Offsets


def as_corrected(peak: int, static: int, corr: float) -> tuple[int, str]:
    """A predicted ``peak`` as the measured peaks correct it (``corr`` scales what is not ``static``), and the
    words a reason says it with ("" where the correction is about 1)."""
    said = f" as the measured peaks correct it (x{corr:.3f})" if abs(corr - 1.0) > 0.005 else ""
    return static + int((peak - static) * corr), said


class Pricing:
    """Prices and solves the plan table of one profile under what has been learned from measurements.

    Setting :attr:`config` or :attr:`learned` replaces them here and in :attr:`step_prices` alike."""

    def __init__(self, profile: Profile, config: ControllerConfig | None = None) -> None:
        self.profile = profile
        config = config or ControllerConfig()
        ref = profile.shape
        offered = {o.mode for b in profile.blocks for o in b.mode_costs()}
        allowed = config.allowed_modes
        learned = Learned(
            config=config,
            batch=ref.batch or 1,
            seqs={ref.seq_len} if ref.seq_len else set(),
            dwell=config.loosen_after_steps,
            fitted=tuple(m for m in PRICED if m in offered and (allowed is None or m in allowed)),
        )
        self._config, self._learned = config, learned
        self.step_prices = StepPricing(profile, config, learned)
        """The step-level fit's prices, which the per-block ones take on where they are sure."""
        self._solved: dict[SolveKey, Choice] = {}
        self._entries: dict[EntryKey, ShapePlan] = {}

    @property
    def config(self) -> ControllerConfig:
        return self._config

    @config.setter
    def config(self, config: ControllerConfig) -> None:
        self._config = self.step_prices.config = config

    @property
    def learned(self) -> Learned:
        """What the measurements taught: corrections, caps, measured prices, the step-level fits."""
        return self._learned

    @learned.setter
    def learned(self, learned: Learned) -> None:
        self._learned = self.step_prices.learned = learned

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`Learned.export` gave; ValueError, leaving this as it was, for anything
        else."""
        self.learned = self._learned.restored(state)
        self._solved.clear()

    @property
    def timing(self) -> BucketTimes:
        """What the modes are measured to cost, against the profile, per length bucket and pooled."""
        return self._learned.timing

    def bucket_of(self, seq: int) -> int:
        """The top of the bucket ``seq`` falls in: a rung of a geometric ladder."""
        return self._learned.bucket_of(seq)

    def scales(self, seq: int) -> Scales:
        """The measured/profiled seconds that price length ``seq`` (its bucket's, else the pooled ones;
        0: the pooled ones)."""
        return self._learned.timing.scales_at(seq)

    def shape(self, seq: int) -> Shape:
        """Length ``seq`` at the batch size seen."""
        batch = self._learned.batch
        return Shape(batch=batch, seq_len=seq, tokens=batch * seq)

    def target_at(self, target: int, seq: int) -> int:
        """The target at length ``seq``: ``target`` where its peaks have not settled on the model, else
        the same budget under the smaller margin they earned (:meth:`ControllerConfig.settled_target`)."""
        return self._config.settled_target(target) if self._learned.settled(seq) else target

    def at(
        self,
        shape: Shape | None,
        *,
        restricted: bool = False,
        per_block: bool = False,
        offsets: Offsets | None = None,
    ) -> AtShape:
        """The profile prepared at ``shape``, its seconds as measured at that length (:meth:`scales`) and
        as the steps there showed (:meth:`StepPricing.offsets`; not with ``per_block``; ``offsets`` instead
        where given); ``restricted`` limits the options to the configured modes (what the solver may pick),
        unrestricted ones price any plan, including one made under other settings."""
        seq = shape.seq_len if shape is not None else 0
        if offsets is None:
            offsets = () if per_block else self.step_prices.offsets(seq)
        return at_shape(
            self.profile,
            shape if seq else None,
            self._config.allowed_modes if restricted else None,
            self.scales(seq),
            prune=restricted,
            offsets=offsets,
        )

    def solve(
        self, shape: Shape, target: int, static: int, *, per_block: bool = False, offsets: Offsets | None = None
    ) -> Choice:
        """The cheapest plan that fits ``target`` at ``shape`` once corrected by the measured peaks, priced
        as measured (``per_block``: by the per-block prices alone; ``offsets``: with these step-level
        prices instead of the fitted ones)."""
        # The budget the target keeps its margin under (before a settled length narrows the margin).
        budget = self._config.budget_of(target)
        target = self.target_at(target, shape.seq_len)
        corr = self._learned.correction(shape.seq_len) if shape.seq_len else 1.0
        ceiling = self._learned.ceiling(shape.seq_len)
        seq = shape.seq_len
        if offsets is None:
            offsets = () if per_block else self.step_prices.offsets(seq)
        key = SolveKey(shape.batch, seq, target, round(corr * 100), static, ceiling, self.scales(seq), offsets)
        hit = self._solved.get(key)
        if hit is not None:
            return hit
        at = self.at(shape, restricted=True, offsets=offsets)
        # The correction scales activations, not the static memory.
        other = at.other_bytes

        def corrected(limit: int, ratio: float) -> int:
            room = static + int(max(0, limit - static) / ratio) - other
            return room if ceiling is None else min(room, static + ceiling - 1)

        # Peaks measured below the model let a plan use that room under the target, but never past the budget
        # by the model's own figure: a plan is never predicted over the budget, corrected or not.
        hard = corrected(budget, max(1.0, corr))
        effective = min(corrected(target, corr), hard)
        choice = solve_prepared(
            at.knapsack,
            at.options,
            effective,
            static_bytes=static,
            outside_bytes=other,
            outside_in_backward=self.profile.other_in_backward,
            budget=hard,
        )
        if other:
            # Fits: under the target once corrected (a correction below 1 lets the prediction exceed it).
            choice = dataclasses.replace(
                choice,
                predicted_peak_bytes=choice.predicted_peak_bytes + other,
                fits=choice.predicted_peak_bytes + other <= effective + other,
            )
        if not choice.fits:
            choice = dataclasses.replace(choice, note=_missed(choice, target, budget, static, corr))
        if len(self._solved) > CACHED_CHOICES:
            self._solved.clear()
        self._solved[key] = choice
        return choice

    def entry(self, seq: int, choice: Choice, static: int) -> ShapePlan:
        """The table entry for lengths up to ``seq`` running ``choice``, with its predicted peak and overhead."""
        key = EntryKey(choice, seq, self._learned.batch, static, self.scales(seq), self.step_prices.offsets(seq))
        hit = self._entries.get(key)
        if hit is not None:
            return hit
        shape = self.shape(seq)
        at = self.at(shape)
        peak, extra = at.cost(choice.modes)
        entry = ShapePlan(
            max_seq_len=seq,
            max_tokens=shape.tokens,
            modes=choice.modes,
            predicted_peak_bytes=static + at.other_bytes + peak,
            predicted_overhead_ratio=overhead_ratio(extra, at.forward_seconds),
        )
        if len(self._entries) > CACHED_ENTRIES:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    def replaced(self, entry: ShapePlan, modes: tuple[Mode, ...], static: int) -> ShapePlan:
        """``entry`` running ``modes``, with their predicted peak and overhead."""
        at = self.at(self.shape(entry.max_seq_len))
        peak, extra = at.cost(modes)
        return dataclasses.replace(
            entry,
            modes=modes,
            predicted_peak_bytes=static + at.other_bytes + peak,
            predicted_overhead_ratio=overhead_ratio(extra, at.forward_seconds),
        )

    def extra(self, modes: tuple[Mode, ...], seq: int, *, per_block: bool = False) -> float:
        """The extra seconds of ``modes`` at ``seq`` as the solvers weigh them (seconds pooled over blocks
        alike), by the step-level prices unless ``per_block``."""
        return self.at(self.shape(seq), per_block=per_block).pooled_seconds(modes)

    def decision(self, table: list[ShapePlan], shape: Shape, target: int, static: int, reason: str) -> Decision:
        """``table`` handed out at ``shape``: the modes of its entry there (every block stored past it), their
        predictions, and ``reason`` with why no plan fits there, where none does."""
        entry = entry_for(table, shape)
        at = self.at(shape)
        modes = entry.modes if entry else (Mode.STORE,) * len(at.options)
        peak, extra = at.cost(modes)
        if shape.seq_len:
            note = self.solve(shape, target, static).note
            if note and note not in reason:
                reason = f"{reason}; {note}"
        return Decision(
            modes=modes,
            table=tuple(table),
            predicted_peak_bytes=static + at.other_bytes + peak,
            predicted_overhead_ratio=overhead_ratio(extra, at.forward_seconds),
            target_bytes=target,
            reason=reason,
        )

    def pessimistic_limit(self, target: int, seq: int, static: int) -> int:
        """The target under which a plan chosen by the ordinary correction at ``seq`` also fits ``target``
        under the pessimistic one (both as :meth:`target_at` moves them); ``target`` where they agree."""
        ordinary = self._learned.correction(seq)
        pessimistic = self._learned.correction(seq, pessimistic=True)
        if pessimistic <= ordinary or target <= 0:
            return target
        at = self.target_at(target, seq)
        # target_at scales a target by a constant where the length settled: undo it on the narrowed one.
        scale = at / target
        return int((static + (at - static) * ordinary / pessimistic) / scale)

    def keeps_less(self, new: tuple[Mode, ...], old: tuple[Mode, ...], shape: Shape) -> bool:
        """Whether ``new`` is predicted to keep less than ``old`` at ``shape``."""
        at = self.at(shape)
        return at.cost(new)[0] < at.cost(old)[0]

    def under_budget(self, modes: tuple[Mode, ...], shape: Shape, target: int, static: int) -> bool:
        """Whether ``modes`` at ``shape`` are predicted under the budget ``target`` keeps its margin under, by the
        model and as the measured peaks correct it (a correction below 1 grants no room past the budget)."""
        at = self.at(shape)
        correction = max(1.0, self._learned.correction(shape.seq_len))
        activations = (at.other_bytes + at.cost(modes)[0]) * correction
        return static + activations <= self._config.budget_of(target)

    def fits(
        self, modes: tuple[Mode, ...], shape: Shape, target: int, static: int, *, pessimistic: bool = False
    ) -> bool:
        """Whether ``modes`` at ``shape`` are predicted under ``target`` (as it stands at that length) as the
        measured peaks correct it (``pessimistic``: by the worst recent measurement)."""
        at = self.at(shape)
        target = self.target_at(target, shape.seq_len)
        correction = self._learned.correction(shape.seq_len, pessimistic=pessimistic)
        activations = (at.other_bytes + at.cost(modes)[0]) * correction
        return static + activations <= target


def _missed(choice: Choice, target: int, budget: int, static: int, corr: float) -> str:
    """Why ``choice``, which does not fit ``target``: the limit it was chosen under, in the figures the
    choice was weighed by (its prediction as the measured peaks correct it)."""
    predicted, as_measured = as_corrected(choice.predicted_peak_bytes, static, corr)
    if choice.under_budget:
        return (
            f"no plan fits the target of {human_bytes(target)}: the fastest under the budget of "
            f"{human_bytes(budget)}, {human_bytes(predicted)} predicted{as_measured}"
        )
    if predicted <= budget:
        # Under the budget only as the measured peaks correct it: the model's own figure is the one over,
        # and a plan is never run over the budget by it where a leaner one exists.
        raw = choice.predicted_peak_bytes
        return (
            f"no plan fits the budget of {human_bytes(budget)}: the leanest, {human_bytes(raw)} predicted "
            f"({human_bytes(predicted)}{as_measured}), {human_bytes(raw - budget)} over it"
        )
    return (
        f"no plan fits the budget of {human_bytes(budget)}: the leanest, {human_bytes(predicted)} "
        f"predicted{as_measured}, {human_bytes(predicted - budget)} over it"
    )
