"""The plan table's arithmetic, shared by the controller's decisions: what the profile costs at a
length (with the measured prices), the cheapest plan that fits a target there once corrected by the
measured peaks, an entry of the table, and whether a plan fits."""

from __future__ import annotations

import dataclasses

from rematd.planner.config import ControllerConfig
from rematd.planner.cost import overhead_ratio
from rematd.planner.decision import Decision
from rematd.planner.learned import Learned
from rematd.planner.model import Profile
from rematd.planner.plan import ShapePlan, entry_for
from rematd.planner.reasons import human_bytes
from rematd.planner.shapes import AtShape, Offsets, Scales, at_shape
from rematd.planner.solvers import Choice, solve_prepared
from rematd.planner.stepfit import PRIOR_SPREAD, Posterior, Prior, group_of
from rematd.planner.timing import PRICED, BucketTimes
from rematd.planner.units import Mode, Shape

REPRICE_LOOKS = 16
"""Looks at the table (about one a step) between two re-pricings of a length whose steps were never timed."""
CACHED_CHOICES = 128
"""Solved plans kept before the cache starts over: each length's, under the correction and the scales in
force there (each bucket's scales move on their own, so several per length stay in use)."""


def as_corrected(peak: int, static: int, corr: float) -> tuple[int, str]:
    """A predicted ``peak`` as the measured peaks correct it (``corr`` scales what is not ``static``), and the
    words a reason says it with ("" where the correction is about 1)."""
    said = f" as the measured peaks correct it (x{corr:.3f})" if abs(corr - 1.0) > 0.005 else ""
    return static + int((peak - static) * corr), said


class TablePricing:
    """Prices and solves the plan table of one profile under what has been learned from measurements."""

    def __init__(self, profile: Profile, config: ControllerConfig | None = None) -> None:
        self.profile = profile
        self.config = config or ControllerConfig()
        ref = profile.shape
        offered = {o.mode for b in profile.blocks for o in b.mode_costs()}
        allowed = self.config.allowed_modes
        self._learned = Learned(
            config=self.config,
            batch=ref.batch or 1,
            seqs={ref.seq_len} if ref.seq_len else set(),
            dwell=self.config.loosen_after_steps,
            fitted=tuple(m for m in PRICED if m in offered and (allowed is None or m in allowed)),
        )
        self._cache: dict[tuple[int, int, int, int, int, int | None, Scales, Offsets], Choice] = {}
        self.table: tuple[ShapePlan, ...] = ()
        self.handed_out: tuple[ShapePlan, ...] = ()
        """The table of the last decision: :attr:`table` with a trial's entry in its place while one runs, what
        the steps ran and what a plan's reason says it changed from."""
        self._entries: dict[tuple[Choice, int, int, int, Scales, Offsets], ShapePlan] = {}
        self._priors: dict[tuple[int, int, Scales], Prior] = {}
        self._offset_cache: dict[tuple[int, int, int, Scales], Offsets] = {}
        self._ratios: dict[tuple[int, int], float] = {}
        self._looks = 0
        """Looks at the whole table so far (:meth:`_desired`)."""
        self._unmeasured: dict[tuple[int, int, int, int, int, int | None], tuple[int, Choice, Scales]] = {}
        """The choices at lengths never timed: by what decides their fit, the look they were priced at and the
        scales they were priced by."""
        self._repriced_later = False
        """Whether the last look kept a choice at a length never timed whose scales have moved since."""

    @property
    def timing(self) -> BucketTimes:
        """What the modes are measured to cost, against the profile, per length bucket and pooled."""
        return self._learned.timing

    @property
    def loosening_pending(self) -> bool:
        """Whether steps with room are being counted towards a looser plan."""
        return self._learned.headroom_steps > 0

    def bucket_of(self, seq: int) -> int:
        """The top of the bucket ``seq`` falls in: a rung of a geometric ladder."""
        return self._learned.bucket_of(seq)

    def correction(self, seq: int, *, pessimistic: bool = False) -> float:
        """Measured/predicted for a bucket: its second-largest recent ratio (the largest when
        ``pessimistic``), at least 1. Buckets never measured borrow the largest of any bucket.
        """
        return self._learned.correction(seq, pessimistic=pessimistic)

    # -- planning -------------------------------------------------------------

    def _at(
        self,
        shape: Shape | None,
        *,
        restricted: bool = False,
        per_block: bool = False,
        offsets: Offsets | None = None,
    ) -> AtShape:
        """The profile prepared at ``shape``, its seconds as measured at that length (:meth:`_scales`) and
        as the steps there showed (:meth:`_offsets`; not with ``per_block``; ``offsets`` instead where
        given); ``restricted`` limits the options to the configured modes (what the solver may pick),
        unrestricted ones price any plan, including one made under other settings."""
        seq = shape.seq_len if shape is not None else 0
        if offsets is None:
            offsets = () if per_block else self._offsets(seq)
        return at_shape(
            self.profile,
            shape if seq else None,
            self.config.allowed_modes if restricted else None,
            self._scales(seq),
            prune=restricted,
            offsets=offsets,
        )

    # -- step-level prices ----------------------------------------------------

    def _prior(self, top: int) -> Prior:
        """The per-block prices at the top of a bucket as the step-level fit's prior: per mode and
        position group, the mean per-block price of the group's blocks (recomputing's where a block
        does not offer the mode), give or take a block's recomputation."""
        scales = self._scales(top)
        key = (top, self._learned.batch, scales)
        hit = self._priors.get(key)
        if hit is not None:
            return hit
        options = self._at(self._shape(top), per_block=True).options
        groups, n = self.config.price_groups, len(options)
        members: list[list[int]] = [[] for _ in range(groups)]
        for i in range(n):
            members[group_of(i, n, groups)].append(i)
        mean, spread = [], []
        for mode, g in self._learned.steps.params:
            prices, recompute = [], []
            for i in members[g] or range(n):
                by_mode = {o.mode: o.seconds for o in options[i]}
                rec = by_mode.get(Mode.RECOMPUTE, max(by_mode.values()))
                prices.append(by_mode.get(mode, rec))
                recompute.append(rec)
            mean.append(sum(prices) / len(prices))
            spread.append(max(1e-9, PRIOR_SPREAD * sum(recompute) / len(recompute)))
        prior = Prior(tuple(mean), tuple(spread), groups, self._learned.steps.modes)
        if len(self._priors) > CACHED_CHOICES:
            self._priors.clear()
        self._priors[key] = prior
        return prior

    def _posterior(self, seq: int) -> tuple[Posterior, float] | None:
        """The step-level fit of the bucket of ``seq`` and the factor that takes its seconds (at the
        bucket's top) to ``seq``; None where that bucket's steps were never timed."""
        if not seq:
            return None
        top = self.bucket_of(seq)
        post = self._learned.steps.posterior(top, self._prior(top))
        if post is None:
            return None
        return post, self._from_top(seq)

    def _from_top(self, seq: int) -> float:
        """How a step's seconds at the top of ``seq``'s bucket scale to ``seq`` (the profile's time ratio)."""
        top = self.bucket_of(seq)
        if top == seq:
            return 1.0
        key = (seq, self._learned.batch)
        hit = self._ratios.get(key)
        if hit is None:
            hit = self.profile.time_ratio(self._shape(seq)) / self.profile.time_ratio(self._shape(top))
            if len(self._ratios) > CACHED_CHOICES:
                self._ratios.clear()
            self._ratios[key] = hit
        return hit

    def _offsets(self, seq: int) -> Offsets:
        """What the steps at ``seq``'s bucket add to each mode's per-block price, per position group (seconds
        a block at ``seq``); () where they do not say enough yet, or agree with the per-block prices."""
        if not seq:
            return ()
        top = self.bucket_of(seq)
        fit = self._learned.steps.fit(top)
        if fit is None or not fit.informed:
            return ()
        scales = self._scales(top)
        key = (seq, self._learned.batch, fit.version, scales)
        hit = self._offset_cache.get(key)
        if hit is not None:
            return hit
        added = self._learned.steps.offsets(top, self._prior(top))
        out: Offsets = ()
        if added is not None:
            ratio = self._from_top(seq)
            by_mode: dict[Mode, list[float]] = {}
            for (mode, _g), d in zip(self._learned.steps.params, added, strict=True):
                by_mode.setdefault(mode, []).append(round(d * ratio, 12))
            out = tuple((m, tuple(v)) for m, v in by_mode.items() if any(v))
        if len(self._offset_cache) > CACHED_CHOICES:
            self._offset_cache.clear()
        self._offset_cache[key] = out
        return out

    def _contrast(self, old: tuple[Mode, ...], new: tuple[Mode, ...], seq: int) -> tuple[float, float]:
        """What running ``new`` instead of ``old`` at ``seq`` saves a step by the step-level fit, and its
        standard deviation (seconds); (0, 0) where the bucket's steps were never timed."""
        found = self._posterior(seq)
        if found is None:
            return 0.0, 0.0
        post, ratio = found
        steps = self._learned.steps
        dx = [a - b for a, b in zip(steps.features(old), steps.features(new), strict=True)]
        mean, sd = post.contrast(dx)
        return mean * ratio, sd * ratio

    def _scales(self, seq: int) -> Scales:
        """The measured/profiled seconds that price length ``seq`` (its bucket's, else the pooled ones;
        0: the pooled ones)."""
        return self._learned.timing.scales_at(seq)

    def _shape(self, seq: int) -> Shape:
        batch = self._learned.batch
        return Shape(batch=batch, seq_len=seq, tokens=batch * seq)

    def _target_at(self, target: int, seq: int) -> int:
        """The target at length ``seq``: ``target`` where its peaks have not settled on the model, else
        the same budget under the smaller margin they earned (:meth:`ControllerConfig.settled_target`)."""
        return self.config.settled_target(target) if self._learned.settled(seq) else target

    def _solve_at(
        self, shape: Shape, target: int, static: int, *, per_block: bool = False, offsets: Offsets | None = None
    ) -> Choice:
        """The cheapest plan that fits ``target`` at ``shape`` once corrected by the measured peaks, priced
        as measured (``per_block``: by the per-block prices alone; ``offsets``: with these step-level
        prices instead of the fitted ones)."""
        # The budget the target keeps its margin under (before a settled length narrows the margin).
        budget = self.config.budget_of(target)
        target = self._target_at(target, shape.seq_len)
        corr = self._learned.correction(shape.seq_len) if shape.seq_len else 1.0
        ceiling = self._learned.ceiling(shape.seq_len)
        seq = shape.seq_len
        if offsets is None:
            offsets = () if per_block else self._offsets(seq)
        key = (shape.batch, seq, target, round(corr * 100), static, ceiling, self._scales(seq), offsets)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        at = self._at(shape, restricted=True, offsets=offsets)
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
            choice = dataclasses.replace(choice, note=self._missed(choice, target, budget, static, corr))
        if len(self._cache) > CACHED_CHOICES:
            self._cache.clear()
        self._cache[key] = choice
        return choice

    @staticmethod
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

    def _entry(self, seq: int, choice: Choice, static: int) -> ShapePlan:
        key = (choice, seq, self._learned.batch, static, self._scales(seq), self._offsets(seq))
        hit = self._entries.get(key)
        if hit is not None:
            return hit
        shape = self._shape(seq)
        at = self._at(shape)
        peak, extra = at.cost(choice.modes)
        entry = ShapePlan(
            max_seq_len=seq,
            max_tokens=shape.tokens,
            modes=choice.modes,
            predicted_peak_bytes=static + at.other_bytes + peak,
            predicted_overhead_ratio=overhead_ratio(extra, at.forward_seconds),
        )
        if len(self._entries) > 64:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    def _choose(self, shape: Shape, target: int, static: int) -> Choice:
        """The plan an entry at ``shape`` should run for ``target``: the cheapest that fits."""
        return self._solve_at(shape, target, static)

    def _desired(self, target: int, static: int, *, fresh: bool = False) -> list[tuple[ShapePlan, Choice]]:
        """Per rung of the length ladder, the entry the table should hold and the choice behind it (``fresh``:
        at the lengths never timed too, re-priced now, in the same look)."""
        if not fresh:
            self._looks += 1
        self._repriced_later = False
        timed = set(self._learned.timing.buckets)
        out = []
        for seq in self._learned.ladder():
            shape = self._shape(seq)
            if self.bucket_of(seq) in timed:
                choice = self._choose(shape, target, static)
            else:
                choice = self._unmeasured_choice(shape, target, static, fresh=fresh)
            out.append((self._entry(seq, choice, static), choice))
        return out

    def _unmeasured_choice(self, shape: Shape, target: int, static: int, *, fresh: bool = False) -> Choice:
        """:meth:`_choose` at a length none of whose steps were timed, re-priced every ``REPRICE_LOOKS`` looks
        only (``fresh``: now), or with the rest of the table where another entry changes: it is priced by the
        scales pooled over every length, which move with each length's steps, and its plan serves no step
        until its length comes (its fit to the budget is re-checked every look)."""
        seq = shape.seq_len
        key = (
            shape.batch,
            seq,
            self._target_at(target, seq),
            round(self._learned.correction(seq) * 100) if seq else 100,
            static,
            self._learned.ceiling(seq),
        )
        held = self._unmeasured.get(key)
        scales = self._scales(seq)
        if held is not None and not fresh and self._looks - held[0] < REPRICE_LOOKS:
            if held[2] != scales:
                self._repriced_later = True
            return held[1]
        choice = self._choose(shape, target, static)
        if len(self._unmeasured) > CACHED_CHOICES:
            self._unmeasured.clear()
        self._unmeasured[key] = (self._looks, choice, scales)
        return choice

    def _extra(self, modes: tuple[Mode, ...], seq: int, *, per_block: bool = False) -> float:
        """The extra seconds of ``modes`` at ``seq`` as the solvers weigh them (seconds pooled over blocks
        alike), by the step-level prices unless ``per_block``."""
        return self._at(self._shape(seq), per_block=per_block).pooled_seconds(modes)

    def _decision(self, table: list[ShapePlan], shape: Shape, target: int, static: int, reason: str) -> Decision:
        entry = entry_for(table, shape)
        at = self._at(shape)
        modes = entry.modes if entry else (Mode.STORE,) * len(at.options)
        peak, extra = at.cost(modes)
        if shape.seq_len:
            note = self._solve_at(shape, target, static).note
            if note and note not in reason:
                reason = f"{reason}; {note}"
        self.handed_out = tuple(table)
        return Decision(
            modes=modes,
            table=tuple(table),
            predicted_peak_bytes=static + at.other_bytes + peak,
            predicted_overhead_ratio=overhead_ratio(extra, at.forward_seconds),
            target_bytes=target,
            reason=reason,
        )

    def _under_budget(self, modes: tuple[Mode, ...], shape: Shape, target: int, static: int) -> bool:
        """Whether ``modes`` at ``shape`` are predicted under the budget ``target`` keeps its margin under, by the
        model and as the measured peaks correct it (a correction below 1 grants no room past the budget)."""
        at = self._at(shape)
        correction = max(1.0, self._learned.correction(shape.seq_len))
        activations = (at.other_bytes + at.cost(modes)[0]) * correction
        return static + activations <= self.config.budget_of(target)

    def _fits(
        self, modes: tuple[Mode, ...], shape: Shape, target: int, static: int, *, pessimistic: bool = False
    ) -> bool:
        at = self._at(shape)
        target = self._target_at(target, shape.seq_len)
        correction = self._learned.correction(shape.seq_len, pessimistic=pessimistic)
        activations = (at.other_bytes + at.cost(modes)[0]) * correction
        return static + activations <= target
