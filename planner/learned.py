"""What the adaptive controller learns from measurements, and how it is saved and restored.

Per sequence-length bucket: recent measured/predicted peak ratios, the boost out-of-memory events
gave, the remembered largest ratio of a step that crossed the target, and the cap an out-of-memory
event set. Besides: the dwell before loosening, the lengths and batch seen, the modes' measured prices
(per length bucket and pooled, :class:`~rematd.planner.timing.BucketTimes`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rematd.planner.config import ControllerConfig
from rematd.planner.model import Profile
from rematd.planner.restoring import whole_number
from rematd.planner.shapes import at_shape
from rematd.planner.stepfit import StepPrices
from rematd.planner.steps import StepObservation
from rematd.planner.timing import PRICED, BucketTimes
from rematd.planner.units import Mode, Shape

# Steps over which the memory of a target crossing fades by half.
CROSSING_HALF_LIFE_STEPS = 256

HELD_LENGTHS = 3
"""Lengths held for a phase that get table entries of their own."""

NEVER = -(10**9)
"""The step of a loosening that never happened."""

MAX_SEQ_LEN = 2**32 - 1
"""The longest length a plan's table may name (the wire's ``uint32``): the ladder stops there."""


@dataclass(slots=True)
class Bucket:
    ratios: deque[float]
    boost: float = 1.0
    crossing: float = 0.0
    """The largest ratio measured on a step that crossed the target (0: none); it fades slowly."""
    crossing_step: int = 0
    ceiling: int | None = None
    """Predicted activation bytes of a plan that ran out of memory here: later plans stay below."""

    def record(self, ratio: float, *, crossed: bool, step: int, floor: float) -> None:
        """One step's measured/predicted ``ratio``; ``floor``: the least correction, where a faded
        crossing ends."""
        self.ratios.append(ratio)
        if crossed:
            # A crossing is evidence, not an outlier: make it count twice.
            self.ratios.append(ratio)
            self.crossing, self.crossing_step = max(self.crossing, ratio), step
        elif self.crossing > floor:
            age = step - self.crossing_step
            self.crossing = floor + (self.crossing - floor) * 0.5 ** (age / CROSSING_HALF_LIFE_STEPS)
            self.crossing_step = step


@dataclass(slots=True, kw_only=True)
class Learned:
    config: ControllerConfig
    batch: int
    seqs: set[int]
    timing: BucketTimes = field(init=False)
    """What the modes are measured to cost, against the profile, per length bucket (:meth:`bucket_of`)."""
    steps: StepPrices = field(init=False)
    """What the modes cost the whole step, per length bucket and position group, fitted to step times."""
    buckets: dict[int, Bucket] = field(default_factory=dict)
    headroom_steps: int = 0
    dwell: int = 0
    last_loosen_step: int = NEVER
    held: deque[int] = field(default_factory=lambda: deque(maxlen=HELD_LENGTHS))
    """Lengths held for a phase (``loosen_after_steps`` steps in a row), most recent last: each gets an
    entry of its own, planned at that length rather than at the top of its bucket."""
    run: tuple[int, int] = (0, 0)
    """The length of the last steps and how many steps in a row had it."""
    fitted: tuple[Mode, ...] = PRICED
    """The modes whose step-level prices are fitted: those of :data:`PRICED` the profile offers."""

    def __post_init__(self) -> None:
        self.timing = BucketTimes(self.bucket_of)
        self.steps = StepPrices(self.config.price_groups, self.fitted)

    def note_shape(self, shape: Shape) -> None:
        if shape.batch:
            self.batch = shape.batch
        seq = shape.seq_len
        if seq:
            self.seqs.add(seq)
            if len(self.seqs) > 64:
                self.seqs = {min(self.seqs), max(self.seqs)}
            self.run = (seq, self.run[1] + 1 if self.run[0] == seq else 1)
            if self.run[1] == self.config.loosen_after_steps and seq not in self.held:
                self.held.append(seq)

    def learn_seconds(self, profile: Profile, obs: StepObservation, modes: tuple[Mode, ...]) -> None:
        """Measured rematerialisation seconds against the profile's for the blocks that ran each mode, pooled
        and in the bucket of the step's length."""
        unscaled = at_shape(profile, obs.shape if obs.shape.seq_len else None)
        totals: dict[Mode, list[float]] = {}
        for opts, mode in zip(unscaled.options, modes, strict=False):
            for o in opts:
                if o.mode == mode:
                    pair = totals.setdefault(mode, [0.0, 0.0])
                    # The steps time a rematerialisation, not the checkpoint's work around it.
                    pair[0] += o.scaled_seconds
                    pair[1] += 1
        forward = unscaled.forward_seconds / max(1, len(unscaled.options))
        self.timing.observe(
            obs.mode_seconds,
            {m: secs / n for m, (secs, n) in totals.items() if n},
            forward_per_block=forward,
            seq=obs.shape.seq_len,
            step=obs.step,
        )

    # -- buckets --------------------------------------------------------------

    def bucket_of(self, seq: int) -> int:
        """The top of the bucket ``seq`` falls in: a rung of a geometric ladder."""
        if seq <= 8:
            return 8
        rung = math.ceil(math.log(seq / 8, self.config.bucket_ratio) - 1e-9)
        # Rounded down, so that a bucket's top falls in its own bucket.
        return max(seq, math.floor(8 * self.config.bucket_ratio**rung + 1e-9))

    def bucket(self, seq: int) -> Bucket:
        """The bucket of ``seq``, created empty when new."""
        return self.buckets.setdefault(self.bucket_of(seq), Bucket(deque(maxlen=self.config.correction_window)))

    def ladder(self) -> list[int]:
        if not self.seqs:
            return []
        lo, hi = self.bucket_of(min(self.seqs)), min(MAX_SEQ_LEN, self.bucket_of(4 * max(self.seqs)))
        rungs = [min(MAX_SEQ_LEN, lo)]
        held = [q for q in self.held if q != self.bucket_of(q)]
        while rungs[-1] < hi:
            rungs.append(min(MAX_SEQ_LEN, self.bucket_of(rungs[-1] + 1)))
        # Past the table a step has no plan of its own; below its shortest rung a step runs that rung's plan,
        # made for more activations than it saves. Where the rungs are too many, the shortest go.
        room = max(1, self.config.max_entries - len(held))
        return sorted({*rungs[-room:], *held})

    def correction(self, seq: int, *, pessimistic: bool = False) -> float:
        """Measured/predicted for a bucket: its second-largest recent ratio (the largest when
        ``pessimistic``), within the configured bounds: below 1 where steps measured less than
        predicted. Buckets never measured borrow the largest of any bucket, at least 1.
        """
        bucket = self.buckets.get(self.bucket_of(seq))
        if bucket is None or not bucket.ratios:
            known = [self._measured(b, pessimistic) for b in self.buckets.values() if b.ratios]
            borrowed = max(1.0, *known) if known else 1.0
            return min(self.config.max_correction, borrowed * (bucket.boost if bucket else 1.0))
        return self._measured(bucket, pessimistic)

    def _measured(self, bucket: Bucket, pessimistic: bool) -> float:
        ordered = sorted(bucket.ratios, reverse=True)
        robust = ordered[0] if pessimistic or len(ordered) == 1 else ordered[1]
        if pessimistic:
            # A crossing of the target is remembered far longer than the window: loosening
            # back into a plan that crossed it needs the memory to have faded.
            robust = max(robust, bucket.crossing)
        cfg = self.config
        return min(cfg.max_correction, max(cfg.min_correction, robust) * bucket.boost)

    def spread_sets_pessimistic(self, seq: int) -> bool:
        """Whether the pessimistic correction at ``seq``'s bucket is its largest recent ratio (their spread)
        rather than a remembered crossing of the target (or a bucket never measured)."""
        bucket = self.buckets.get(self.bucket_of(seq))
        return bucket is not None and bool(bucket.ratios) and bucket.crossing <= max(bucket.ratios)

    def settled(self, seq: int) -> bool:
        """Whether the measured peaks at ``seq``'s bucket have settled on the model: a full window of
        measured/predicted ratios within ``settled_spread`` of each other, no remembered crossing of the
        target above them, no out-of-memory event there or at a shorter length."""
        cfg = self.config
        bucket = self.buckets.get(self.bucket_of(seq)) if seq else None
        if bucket is None or len(bucket.ratios) < cfg.correction_window or bucket.boost > 1.0:
            return False
        lo, hi = min(bucket.ratios), max(bucket.ratios)
        return hi <= lo * (1.0 + cfg.settled_spread) and bucket.crossing <= hi and self.ceiling(seq) is None

    def ceiling(self, seq: int) -> int | None:
        """The cap an out-of-memory event set at this length or a shorter one, scaled up to this length."""
        if not seq:
            return None
        here = self.bucket_of(seq)
        caps = [b.ceiling for s, b in self.buckets.items() if b.ceiling is not None and s <= here]
        return min(caps) if caps else None

    # -- across restarts of the service ---------------------------------------

    def export(self) -> dict[str, Any]:
        return {
            "v": 1,
            "buckets": [
                [seq, list(b.ratios), b.boost, b.crossing, b.crossing_step, b.ceiling]
                for seq, b in sorted(self.buckets.items())
            ],
            "headroom_steps": self.headroom_steps,
            "dwell": self.dwell,
            "last_loosen_step": self.last_loosen_step,
            "seqs": sorted(self.seqs),
            "batch": self.batch,
            "timing": self.timing.export_state(),
            "step_prices": self.steps.export(),
        }

    def restored(self, state: dict[str, Any]) -> Learned:
        """This, continued from what :meth:`export` gave; ValueError for anything else."""
        cfg = self.config
        if not isinstance(state, dict) or state.get("v") != 1:
            raise ValueError("state: not a controller state of version 1")
        entries = state.get("buckets", [])
        if not isinstance(entries, list):
            raise ValueError(f"state: buckets must be a list, got {type(entries).__name__}")
        buckets: dict[int, Bucket] = {}
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 6:
                raise ValueError(
                    f"state: a bucket must be [seq, ratios, boost, crossing, step, ceiling], got {entry!r}"
                )
            seq, ratios, boost, crossing, crossing_step, ceiling = entry
            if not isinstance(ratios, list):
                raise ValueError(f"state: ratios must be a list, got {ratios!r}")
            buckets[whole_number(seq, "bucket", lo=1)] = Bucket(
                deque((_num(r, "ratio", hi=cfg.max_correction) for r in ratios), maxlen=cfg.correction_window),
                boost=_num(boost, "boost", lo=1.0, hi=cfg.max_correction),
                crossing=_num(crossing, "crossing", hi=cfg.max_correction),
                crossing_step=whole_number(crossing_step, "crossing_step"),
                ceiling=None if ceiling is None else whole_number(ceiling, "ceiling"),
            )
        seqs = state.get("seqs", [])
        if not isinstance(seqs, list) or len(seqs) > 64:
            raise ValueError("state: seqs must be a list of at most 64 lengths")
        dwell = whole_number(state.get("dwell"), "dwell")
        restored = Learned(
            config=cfg,
            buckets=buckets,
            headroom_steps=whole_number(state.get("headroom_steps", 0), "headroom_steps"),
            dwell=min(cfg.max_loosen_after_steps, max(cfg.loosen_after_steps, dwell)),
            last_loosen_step=whole_number(state.get("last_loosen_step", NEVER), "last_loosen_step", lo=NEVER),
            seqs=self.seqs | {whole_number(q, "seq", lo=1) for q in seqs},
            batch=whole_number(state.get("batch", self.batch), "batch", lo=1),
            fitted=self.fitted,
        )
        if "timing" in state:
            restored.timing.restore_state(state["timing"])
        if "step_prices" in state:
            restored.steps.restore(state["step_prices"])
        return restored


def _num(value: Any, what: str, *, lo: float = 0.0, hi: float = 1e12) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or (isinstance(value, float) and math.isnan(value)) or not lo <= value <= hi:
        raise ValueError(f"state: {what} must be a finite number in [{lo}, {hi}], got {value!r}")
    return float(value)
