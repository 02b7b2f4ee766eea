"""The adaptive controller: a plan table keyed by sequence length that tightens
at once and loosens only after sustained headroom.

Each table entry is the cheapest plan that fits the target at the top of its
sequence-length bucket, so a step of a new length gets a plan before it runs.
Measured peaks correct the cost model per bucket; the correction ignores a
single outlier unless that outlier crossed the target.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rematd.planner.cost import overhead_ratio
from rematd.planner.model import Mode, Option, Profile, Shape, ShapePlan, StepObservation
from rematd.planner.shapes import AtShape, Scales, at_shape
from rematd.planner.solvers import Choice, solve_prepared
from rematd.planner.timing import TimeScales

# A looser plan must fit this fraction of the target under the worst recent correction.
LOOSEN_SLACK = 0.97
# Steps over which the memory of a target crossing fades by half.
CROSSING_HALF_LIFE_STEPS = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerConfig:
    """How cautiously the controller trades memory for recomputation."""

    margin_ratio: float = 0.1
    """Fraction of the budget kept free: target = budget x (1 - margin_ratio)."""
    loosen_after_steps: int = 5
    """Consecutive steps with room for a looser plan before the plan loosens."""
    max_loosen_after_steps: int = 80
    """Upper bound of the dwell, which doubles each time a loosening is undone soon after."""
    max_correction: float = 4.0
    """Upper bound of the learned measured/predicted correction factor."""
    correction_window: int = 8
    """Recent measured/predicted ratios kept per sequence-length bucket."""
    oom_correction_step: float = 1.25
    """Factor by which an out-of-memory event raises the correction of its bucket."""
    bucket_ratio: float = math.sqrt(2)
    """Ratio between the sequence lengths of neighbouring table entries."""
    max_entries: int = 16
    """Most entries of the plan table."""
    allowed_modes: frozenset[Mode] | None = None
    """Modes the planner may choose besides STORE (None: every mode the profile offers)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin_ratio < 1.0:
            raise ValueError(f"margin_ratio must be in [0, 1), got {self.margin_ratio!r}")
        if self.loosen_after_steps < 1:
            raise ValueError(f"loosen_after_steps must be >= 1, got {self.loosen_after_steps!r}")
        if self.max_loosen_after_steps < self.loosen_after_steps:
            raise ValueError("max_loosen_after_steps must be >= loosen_after_steps")
        if self.max_correction < 1.0:
            raise ValueError(f"max_correction must be >= 1, got {self.max_correction!r}")
        if self.correction_window < 1:
            raise ValueError(f"correction_window must be >= 1, got {self.correction_window!r}")
        if self.oom_correction_step <= 1.0:
            raise ValueError(f"oom_correction_step must be > 1, got {self.oom_correction_step!r}")
        if self.bucket_ratio <= 1.0:
            raise ValueError(f"bucket_ratio must be > 1, got {self.bucket_ratio!r}")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries!r}")

    def target_bytes(self, budget_bytes: int) -> int:
        return int(budget_bytes * (1.0 - self.margin_ratio))


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """A change of plan the controller asks for."""

    modes: tuple[Mode, ...]
    """Modes for the shape just observed (or the profile's shape)."""
    table: tuple[ShapePlan, ...]
    """The plan table."""
    predicted_peak_bytes: int
    predicted_overhead_ratio: float
    target_bytes: int
    reason: str


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


@dataclass(slots=True)
class _Bucket:
    ratios: deque[float]
    boost: float = 1.0
    crossing: float = 1.0
    """The largest ratio measured on a step that crossed the target; it fades slowly."""
    crossing_step: int = 0
    ceiling: int | None = None
    """Predicted activation bytes of a plan that ran out of memory here: later plans stay below."""


_MAX_STEP = 2**53
"""Bound on a restored step count or length: beyond it a float loses whole numbers."""


@dataclass(slots=True)
class _State:
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    headroom_steps: int = 0
    dwell: int = 0
    last_loosen_step: int = -(10**9)


class Controller:
    """Turns a stream of step observations into plan-table changes."""

    def __init__(self, profile: Profile, config: ControllerConfig | None = None) -> None:
        self.profile = profile
        self.config = config or ControllerConfig()
        self._state = _State(dwell=self.config.loosen_after_steps)
        self.timing = TimeScales()
        """What the modes are measured to cost, against the profile."""
        self._cache: dict[tuple[int, int, int, int, int, int | None, Scales], Choice] = {}
        ref = profile.shape
        self._batch = ref.batch or 1
        self._seqs: set[int] = {ref.seq_len} if ref.seq_len else set()
        self.table: tuple[ShapePlan, ...] = ()
        self._entries: dict[tuple[Choice, int, int, int, Scales], ShapePlan] = {}

    @property
    def loosening_pending(self) -> bool:
        """Whether steps with room are being counted towards a looser plan."""
        return self._state.headroom_steps > 0

    # -- buckets --------------------------------------------------------------

    def bucket_of(self, seq: int) -> int:
        """The top of the bucket ``seq`` falls in: a rung of a geometric ladder."""
        if seq <= 8:
            return 8
        rung = math.ceil(math.log(seq / 8, self.config.bucket_ratio) - 1e-9)
        # Rounded down, so that a bucket's top falls in its own bucket.
        return max(seq, math.floor(8 * self.config.bucket_ratio**rung + 1e-9))

    def _ladder(self) -> list[int]:
        if not self._seqs:
            return []
        lo, hi = self.bucket_of(min(self._seqs)), self.bucket_of(4 * max(self._seqs))
        rungs = [lo]
        while rungs[-1] < hi and len(rungs) < self.config.max_entries:
            rungs.append(self.bucket_of(rungs[-1] + 1))
        return rungs

    def correction(self, seq: int, *, pessimistic: bool = False) -> float:
        """Measured/predicted for a bucket: its second-largest recent ratio (the largest when
        ``pessimistic``), at least 1. Buckets never measured borrow the largest of any bucket.
        """
        st = self._state
        bucket = st.buckets.get(self.bucket_of(seq))
        if bucket is None or not bucket.ratios:
            known = [self._measured(b, pessimistic) for b in st.buckets.values() if b.ratios]
            return min(self.config.max_correction, max(known, default=1.0) * (bucket.boost if bucket else 1.0))
        return self._measured(bucket, pessimistic)

    def _measured(self, bucket: _Bucket, pessimistic: bool) -> float:
        ordered = sorted(bucket.ratios, reverse=True)
        robust = ordered[0] if pessimistic or len(ordered) == 1 else ordered[1]
        if pessimistic:
            # A crossing of the target is remembered far longer than the window: loosening
            # back into a plan that crossed it needs the memory to have faded.
            robust = max(robust, bucket.crossing)
        return min(self.config.max_correction, max(1.0, robust) * bucket.boost)

    def _ceiling(self, seq: int) -> int | None:
        """The cap an out-of-memory event set at this length or a shorter one, scaled up to this length."""
        if not seq:
            return None
        here = self.bucket_of(seq)
        caps = [b.ceiling for s, b in self._state.buckets.items() if b.ceiling is not None and s <= here]
        return min(caps) if caps else None

    # -- planning -------------------------------------------------------------

    def _at(self, shape: Shape | None, *, restricted: bool = False) -> AtShape:
        """The profile prepared at ``shape``; ``restricted`` limits the options to the configured
        modes (what the solver may pick), unrestricted ones price any plan, including one made under
        other settings."""
        return at_shape(
            self.profile,
            shape if shape is None or shape.seq_len else None,
            self.config.allowed_modes if restricted else None,
            self.timing.scales,
            prune=restricted,
        )

    def _options(self, shape: Shape | None) -> list[list[Option]]:
        return self._at(shape).options

    def _solve_at(self, shape: Shape, target: int, static: int) -> Choice:
        corr = self.correction(shape.seq_len) if shape.seq_len else 1.0
        ceiling = self._ceiling(shape.seq_len)
        key = (shape.batch, shape.seq_len, target, round(corr * 100), static, ceiling, self.timing.scales)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        at = self._at(shape, restricted=True)
        # The correction scales activations, not the static memory.
        other = at.other_bytes
        effective = static + int(max(0, target - static) / corr) - other
        if ceiling is not None:
            effective = min(effective, static + ceiling - 1)
        choice = solve_prepared(at.knapsack, at.options, effective, static_bytes=static, outside_bytes=other)
        if other:
            choice = dataclasses.replace(
                choice,
                predicted_peak_bytes=choice.predicted_peak_bytes + other,
                fits=choice.predicted_peak_bytes + other <= target,
            )
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[key] = choice
        return choice

    def _entry(self, seq: int, choice: Choice, static: int) -> ShapePlan:
        key = (choice, seq, self._batch, static, self.timing.scales)
        hit = self._entries.get(key)
        if hit is not None:
            return hit
        shape = Shape(batch=self._batch, seq_len=seq, tokens=self._batch * seq)
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

    def _desired(self, target: int, static: int) -> list[tuple[ShapePlan, Choice]]:
        out = []
        for seq in self._ladder():
            shape = Shape(batch=self._batch, seq_len=seq, tokens=self._batch * seq)
            choice = self._solve_at(shape, target, static)
            out.append((self._entry(seq, choice, static), choice))
        return out

    def _extra(self, modes: tuple[Mode, ...], seq: int) -> float:
        shape = Shape(batch=self._batch, seq_len=seq, tokens=self._batch * seq)
        return self._at(shape).cost(modes)[1]

    def _decision(self, table: list[ShapePlan], shape: Shape, target: int, static: int, reason: str) -> Decision:
        entry = _lookup(table, shape)
        at = self._at(shape)
        modes = entry.modes if entry else (Mode.STORE,) * len(at.options)
        peak, extra = at.cost(modes)
        if shape.seq_len:
            note = self._solve_at(shape, target, static).note
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
                reason=_initial_reason(choice, target),
            )
        desired = self._desired(target, static_bytes)
        self.table = tuple(e for e, _ in desired)
        choice = self._solve_at(ref, target, static_bytes)
        return self._decision(list(self.table), ref, target, static_bytes, _initial_reason(choice, target))

    def observe(self, obs: StepObservation, measured_modes: tuple[Mode, ...] | None) -> Decision | None:
        """One step's measurements, taken under ``measured_modes``; a decision when the table changes."""
        cfg = self.config
        st = self._state
        target = cfg.target_bytes(obs.budget_bytes)
        shape = obs.shape
        if shape.batch:
            self._batch = shape.batch
        if shape.seq_len:
            self._seqs.add(shape.seq_len)
            if len(self._seqs) > 64:
                self._seqs = {min(self._seqs), max(self._seqs)}
        at = self._at(shape)
        modes = measured_modes or tuple(Mode.STORE for _ in at.options)
        predicted = at.other_bytes + at.cost(modes)[0]
        if obs.mode_seconds:
            self._learn_seconds(obs, modes)
        measured_over = obs.peak_bytes > target
        if predicted > 0 and obs.peak_bytes > 0 and shape.seq_len:
            activations = max(0, obs.peak_bytes - obs.static_bytes)
            bucket = st.buckets.setdefault(self.bucket_of(shape.seq_len), _Bucket(deque(maxlen=cfg.correction_window)))
            ratio = min(cfg.max_correction, activations / predicted)
            bucket.ratios.append(ratio)
            if measured_over:
                # A crossing is evidence, not an outlier: make it count twice.
                bucket.ratios.append(ratio)
                bucket.crossing, bucket.crossing_step = max(bucket.crossing, ratio), obs.step
            elif bucket.crossing > 1.0:
                age = obs.step - bucket.crossing_step
                bucket.crossing = 1.0 + (bucket.crossing - 1.0) * 0.5 ** (age / CROSSING_HALF_LIFE_STEPS)
                bucket.crossing_step = obs.step

        current = {e.max_seq_len: e for e in self.table}
        desired = self._desired(target, obs.static_bytes)
        by_seq = {e.max_seq_len: e for e, _ in desired}
        tighter, looser = [], []
        slack = int(target * LOOSEN_SLACK)
        for entry, _choice in desired:
            seq = entry.max_seq_len
            old = current.get(seq)
            if old is None or old.modes == entry.modes:
                continue
            old_shape = Shape(batch=self._batch, seq_len=seq, tokens=entry.max_tokens)
            old_fits = self._fits(old.modes, old_shape, target, obs.static_bytes)
            if not old_fits or self._extra(entry.modes, seq) > self._extra(old.modes, seq):
                tighter.append(seq)
                continue
            leaner = self._at(old_shape).cost(entry.modes)[0] <= self._at(old_shape).cost(old.modes)[0]
            # Loosen only to what fits under the worst recent measurement, with slack: a plan whose own
            # measurements would undo it is never adopted. Short of that, the best plan that does fit.
            if not leaner and not self._fits(entry.modes, old_shape, slack, obs.static_bytes, pessimistic=True):
                entry = self._entry(seq, self._solve_at(old_shape, slack, obs.static_bytes), obs.static_bytes)
                if entry.modes == old.modes or self._extra(entry.modes, seq) >= self._extra(old.modes, seq):
                    continue
                if not self._fits(entry.modes, old_shape, slack, obs.static_bytes, pessimistic=True):
                    continue
                by_seq[seq] = entry
            # Else as lean or leaner, and cheaper (measured seconds moved): no memory risk, only the dwell.
            looser.append(seq)
        new_rungs = [e.max_seq_len for e, _ in desired if e.max_seq_len not in current]

        if tighter:
            st.headroom_steps = 0
            if obs.step - st.last_loosen_step <= 2 * st.dwell:
                # The last loosening was undone quickly: wait longer before the next.
                st.dwell = min(cfg.max_loosen_after_steps, st.dwell * 2)
            table = [by_seq[s] if s in tighter or s in new_rungs else current.get(s, by_seq[s]) for s in by_seq]
            cause = (
                f"a step of length {shape.seq_len} peaked at {human_bytes(obs.peak_bytes)}, "
                f"over the target of {human_bytes(target)}"
                if measured_over
                else f"steps of length {shape.seq_len} are predicted to pass the target of {human_bytes(target)}"
            )
            before = self.table
            self.table = tuple(table)
            reason = f"tighten: {cause}; {_what_changed(before, self.table)}"
            return self._decision(table, shape, target, obs.static_bytes, reason)

        if looser:
            st.headroom_steps += 1
            if st.headroom_steps >= st.dwell:
                st.headroom_steps = 0
                st.last_loosen_step = obs.step
                before = self.table
                self.table = tuple(by_seq[s] if s in looser or s in new_rungs else current[s] for s in by_seq)
                # "loosen" only when it recomputes less; a move to other modes that cost no more memory
                # but were measured faster is said as what it is.
                label = (
                    f"loosen: {st.dwell} steps in a row had room under the target "
                    f"(last peak {human_bytes(obs.peak_bytes)} of {human_bytes(target)})"
                    if _recomputes_less(before, self.table)
                    else "re-balance: the measured step times make these modes cheaper, at no more memory"
                )
                return self._decision(
                    list(self.table), shape, target, obs.static_bytes, f"{label}; {_what_changed(before, self.table)}"
                )
        else:
            st.headroom_steps = 0

        if new_rungs:
            before = self.table
            self.table = tuple(by_seq[s] if s in new_rungs else current.get(s, by_seq[s]) for s in by_seq)
            added = ", ".join(f"up to {s}" for s in sorted(new_rungs))
            reason = (
                f"new sequence length {shape.seq_len}: plans added for lengths {added}; "
                f"{_what_changed(before, self.table)}"
            )
            return self._decision(list(self.table), shape, target, obs.static_bytes, reason)
        return None

    def _learn_seconds(self, obs: StepObservation, modes: tuple[Mode, ...]) -> None:
        """Measured rematerialisation seconds against the profile's for the blocks that ran each mode."""
        unscaled = at_shape(self.profile, obs.shape if obs.shape.seq_len else None)
        totals: dict[Mode, list[float]] = {}
        for opts, mode in zip(unscaled.options, modes, strict=False):
            for o in opts:
                if o.mode == mode:
                    pair = totals.setdefault(mode, [0.0, 0.0])
                    pair[0] += o.seconds
                    pair[1] += 1
        forward = unscaled.forward_seconds / max(1, len(unscaled.options))
        self.timing.observe(
            obs.mode_seconds,
            {m: secs / n for m, (secs, n) in totals.items() if n},
            forward_per_block=forward,
        )

    def _fits(
        self, modes: tuple[Mode, ...], shape: Shape, target: int, static: int, *, pessimistic: bool = False
    ) -> bool:
        at = self._at(shape)
        correction = self.correction(shape.seq_len, pessimistic=pessimistic)
        activations = (at.other_bytes + at.cost(modes)[0]) * correction
        return static + activations <= target

    def after_oom(self, *, shape: Shape, budget_bytes: int, static_bytes: int) -> Decision:
        """An out-of-memory event: distrust the model at that shape and tighten at once."""
        cfg = self.config
        st = self._state
        seq = shape.seq_len or self.profile.shape.seq_len
        bucket = st.buckets.setdefault(self.bucket_of(seq), _Bucket(deque(maxlen=cfg.correction_window)))
        st.headroom_steps = 0
        st.dwell = min(cfg.max_loosen_after_steps, st.dwell * 2)
        target = cfg.target_bytes(budget_bytes)
        if seq:
            self._seqs.add(seq)
        current = {e.max_seq_len: e for e in self.table}
        # The entry the step ran with: the one covering its length, the longest one past the table.
        before = _lookup(list(self.table), shape) if seq and shape.seq_len else None
        bucket.boost = min(cfg.max_correction, bucket.boost * cfg.oom_correction_step)
        if before is not None:
            # The plan that failed was wrong by an unknown amount: cap this length and longer ones
            # close to the least any plan needs, and remember it (a cap only ever comes down).
            at = self.bucket_of(seq)
            failed_shape = Shape(batch=self._batch, seq_len=at, tokens=self._batch * at)
            failed = self._at(failed_shape).cost(before.modes)[0]
            floor = self._at(failed_shape, restricted=True).knapsack.least_peak()[0]
            cap = floor + max(0, failed - floor) // 10 + 1
            bucket.ceiling = cap if bucket.ceiling is None else min(bucket.ceiling, cap)
        desired = self._desired(target, static_bytes)
        table = []
        for entry, _ in desired:
            old = current.get(entry.max_seq_len)
            keep_old = old is not None and self._extra(old.modes, entry.max_seq_len) > self._extra(
                entry.modes, entry.max_seq_len
            )
            table.append(old if keep_old and old is not None else entry)
        was = self.table
        self.table = tuple(table)
        where = f"at length {shape.seq_len}" if shape.seq_len else "(its length not reported)"
        reason = f"tighten: out-of-memory reported {where}; {_what_changed(was, self.table)}"
        return self._decision(table, shape, target, static_bytes, reason)

    # -- what it learned, across restarts of the service ----------------------

    def export_state(self) -> dict[str, Any]:
        """What this controller learned from measurements, as plain JSON-able data: per bucket the
        recent measured/predicted ratios, OOM boost, remembered crossing and cap; the dwell and when
        it last loosened; the lengths and batch seen; the modes' measured prices (the sums behind
        :attr:`timing`). ``restore_state`` takes it back."""
        st = self._state
        return {
            "v": 1,
            "buckets": [
                [seq, list(b.ratios), b.boost, b.crossing, b.crossing_step, b.ceiling]
                for seq, b in sorted(st.buckets.items())
            ],
            "headroom_steps": st.headroom_steps,
            "dwell": st.dwell,
            "last_loosen_step": st.last_loosen_step,
            "seqs": sorted(self._seqs),
            "batch": self._batch,
            "timing": self.timing.export_state(),
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        """Continue from what ``export_state`` gave (another process's controller over the same profile);
        ValueError, leaving this controller as it was, for anything else."""
        cfg = self.config

        def num(value: Any, what: str, *, lo: float = 0.0, hi: float = 1e12) -> float:
            ok = not isinstance(value, bool) and isinstance(value, (int, float))
            if not ok or (isinstance(value, float) and math.isnan(value)) or not lo <= value <= hi:
                raise ValueError(f"state: {what} must be a finite number in [{lo}, {hi}], got {value!r}")
            return float(value)

        def whole(value: Any, what: str, *, lo: int = 0) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= _MAX_STEP:
                raise ValueError(f"state: {what} must be an integer in [{lo}, {_MAX_STEP}], got {value!r}")
            return value

        if not isinstance(state, dict) or state.get("v") != 1:
            raise ValueError("state: not a controller state of version 1")
        entries = state.get("buckets", [])
        if not isinstance(entries, list):
            raise ValueError(f"state: buckets must be a list, got {type(entries).__name__}")
        buckets: dict[int, _Bucket] = {}
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 6:
                raise ValueError(
                    f"state: a bucket must be [seq, ratios, boost, crossing, step, ceiling], got {entry!r}"
                )
            seq, ratios, boost, crossing, crossing_step, ceiling = entry
            if not isinstance(ratios, list):
                raise ValueError(f"state: ratios must be a list, got {ratios!r}")
            buckets[whole(seq, "bucket", lo=1)] = _Bucket(
                deque((num(r, "ratio", hi=cfg.max_correction) for r in ratios), maxlen=cfg.correction_window),
                boost=num(boost, "boost", lo=1.0, hi=cfg.max_correction),
                crossing=num(crossing, "crossing", lo=1.0, hi=cfg.max_correction),
                crossing_step=whole(crossing_step, "crossing_step"),
                ceiling=None if ceiling is None else whole(ceiling, "ceiling"),
            )
        seqs = state.get("seqs", [])
        if not isinstance(seqs, list) or len(seqs) > 64:
            raise ValueError("state: seqs must be a list of at most 64 lengths")
        restored = _State(
            buckets=buckets,
            headroom_steps=whole(state.get("headroom_steps", 0), "headroom_steps"),
            dwell=min(cfg.max_loosen_after_steps, max(cfg.loosen_after_steps, whole(state.get("dwell"), "dwell"))),
            last_loosen_step=whole(state.get("last_loosen_step", -(10**9)), "last_loosen_step", lo=-(10**9)),
        )
        lengths = {whole(q, "seq", lo=1) for q in seqs}
        batch = whole(state.get("batch", self._batch), "batch", lo=1)
        timing = TimeScales()
        if "timing" in state:
            timing.restore_state(state["timing"])
        self.timing = timing
        self._state = restored
        self._seqs |= lengths
        self._batch = batch
        self._cache.clear()


def _lookup(table: list[ShapePlan], shape: Shape) -> ShapePlan | None:
    if not table:
        return None
    if not shape.seq_len:
        return table[-1]
    for entry in table:
        if entry.covers(shape):
            return entry
    return table[-1]


_LETTERS = {Mode.STORE: ".", Mode.SELECTIVE: "s", Mode.RECOMPUTE: "R", Mode.OFFLOAD: "O"}
# How much of a block's forward runs again in backward: what "recomputes less" counts.
_RECOMPUTED = {Mode.STORE: 0, Mode.OFFLOAD: 0, Mode.SELECTIVE: 1, Mode.RECOMPUTE: 2}


def letters(modes: tuple[Mode, ...]) -> str:
    """Modes one letter a block: . store, s selective, R recompute, O offload."""
    return "".join(_LETTERS[m] for m in modes)


def _changed(
    before: tuple[ShapePlan, ...], after: tuple[ShapePlan, ...]
) -> list[tuple[int, ShapePlan | None, ShapePlan]]:
    old = {e.max_seq_len: e for e in before}
    return [(e.max_seq_len, old.get(e.max_seq_len), e) for e in after if old.get(e.max_seq_len) != e]


def _recomputes_less(before: tuple[ShapePlan, ...], after: tuple[ShapePlan, ...]) -> bool:
    """No length of the table recomputes more than before, and some length recomputes less."""
    less = False
    for _seq, old, new in _changed(before, after):
        if old is None:
            continue
        was = sum(_RECOMPUTED[m] for m in old.modes)
        now = sum(_RECOMPUTED[m] for m in new.modes)
        if now > was:
            return False
        less = less or now < was
    return less


def _what_changed(before: tuple[ShapePlan, ...], after: tuple[ShapePlan, ...], most: int = 4) -> str:
    """The lengths whose modes changed, in the demo's letters, e.g. "length <= 160: RRRsRRRs -> RRRRRRRR"."""
    parts = []
    for seq, old, new in _changed(before, after):
        if old is not None and old.modes == new.modes:
            continue
        parts.append(
            f"length <= {seq}: {letters(old.modes)} -> {letters(new.modes)}"
            if old is not None
            else f"length <= {seq}: {letters(new.modes)} (new)"
        )
    if not parts:
        return "modes unchanged (. store, s selective, R recompute, O offload)"
    shown = parts[:most] + ([f"and {len(parts) - most} more"] if len(parts) > most else [])
    return ", ".join(shown) + " (. store, s selective, R recompute, O offload)"


def _initial_reason(choice: Choice, target: int) -> str:
    fit = "fits" if choice.fits else "does not fit"
    reason = (
        f"initial plan from profile: predicted {human_bytes(choice.predicted_peak_bytes)} "
        f"{fit} target {human_bytes(target)}"
    )
    return f"{reason}; {choice.note}" if choice.note else reason
