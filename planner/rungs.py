"""The entries the plan table should hold: per rung of the length ladder, the plan chosen there; at the lengths
never timed, chosen again only now and then (their prices move with every length's steps, and their plans
serve no step until their length comes)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from rematd.planner.plan import ShapePlan
from rematd.planner.pricing import CACHED_CHOICES, Pricing
from rematd.planner.shapes import Scales
from rematd.planner.solvers import Choice
from rematd.planner.units import Shape

REPRICE_LOOKS = 16
"""Looks at the table (about one a step) between two re-pricings of a length whose steps were never timed."""


class Chooser(Protocol):
    def choose(self, shape: Shape, target: int, static: int) -> Choice:
        """The plan an entry at ``shape`` should run for ``target``."""
        ...


class FitKey(NamedTuple):
    """What decides whether a plan fits at a length never timed."""

    batch: int
    seq: int
    target: int
    correction: int
    """The measured peaks' correction there, in hundredths."""
    static: int
    ceiling: int | None


class Priced(NamedTuple):
    """A choice at a length never timed: the look it was made at and the scales it was priced by."""

    look: int
    choice: Choice
    scales: Scales


class Rungs:
    """Per rung of the length ladder, the entry the table should hold, by ``chooser``'s choice there."""

    def __init__(self, pricing: Pricing, chooser: Chooser) -> None:
        self._pricing = pricing
        self._chooser = chooser
        self._looks = 0
        """Looks at the whole table so far (:meth:`desired`)."""
        self._unmeasured: dict[FitKey, Priced] = {}
        self.repriced_later = False
        """Whether the last look kept a choice at a length never timed whose scales have moved since."""

    def desired(self, target: int, static: int, *, fresh: bool = False) -> list[tuple[ShapePlan, Choice]]:
        """Per rung of the length ladder, the entry the table should hold and the choice behind it (``fresh``:
        at the lengths never timed too, re-priced now, in the same look)."""
        if not fresh:
            self._looks += 1
        self.repriced_later = False
        pricing = self._pricing
        timed = set(pricing.timing.buckets)
        out = []
        for seq in pricing.learned.ladder():
            shape = pricing.shape(seq)
            if pricing.bucket_of(seq) in timed:
                choice = self._chooser.choose(shape, target, static)
            else:
                choice = self._unmeasured_choice(shape, target, static, fresh=fresh)
            out.append((pricing.entry(seq, choice, static), choice))
        return out

    def _unmeasured_choice(self, shape: Shape, target: int, static: int, *, fresh: bool = False) -> Choice:
        """The choice at a length none of whose steps were timed, made again every ``REPRICE_LOOKS`` looks
        only (``fresh``: now), or with the rest of the table where another entry changes: it is priced by the
        scales pooled over every length, which move with each length's steps, and its plan serves no step
        until its length comes (its fit to the budget is re-checked every look)."""
        pricing, learned = self._pricing, self._pricing.learned
        seq = shape.seq_len
        key = FitKey(
            shape.batch,
            seq,
            pricing.target_at(target, seq),
            round(learned.correction(seq) * 100) if seq else 100,
            static,
            learned.ceiling(seq),
        )
        held = self._unmeasured.get(key)
        scales = pricing.scales(seq)
        if held is not None and not fresh and self._looks - held.look < REPRICE_LOOKS:
            if held.scales != scales:
                self.repriced_later = True
            return held.choice
        choice = self._chooser.choose(shape, target, static)
        if len(self._unmeasured) > CACHED_CHOICES:
            self._unmeasured.clear()
        self._unmeasured[key] = Priced(self._looks, choice, scales)
        return choice
