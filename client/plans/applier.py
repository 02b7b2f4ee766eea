"""Plans in, block modes out: the plan in force and the one waiting for the next step."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence

from rematd.client.blocks.switchable import SwitchableBlock
from rematd.client.parallel.agreement import leanest
from rematd.client.plans.sources import Pricer
from rematd.planner import Mode, Plan, Shape, blocks_of, letters
from rematd.planner.plan import entry_for
from rematd.planner.reasons import lossy_note

log = logging.getLogger("rematd.client")

NO_PLAN = Plan(
    version=0,
    blocks=(),
    checkpoint_every=0,
    predicted_peak_bytes=0,
    predicted_overhead_ratio=0.0,
    target_bytes=0,
    reason="profiling: every block recomputes until the planner's first plan",
)

OTHER_MODES = "the blocks ran other modes than the plan's"


class PlanApplier:
    """Receives plans from any thread; applies the newest at a step boundary only."""

    def __init__(self, blocks: list[SwitchableBlock]) -> None:
        self.blocks = blocks
        self._lock = threading.Lock()
        self.plan = NO_PLAN
        self._pending: Plan | None = None
        self._superseded: list[Plan] = []
        """Plans a newer one replaced while they waited for a step: they go into the history with it."""
        self.history: list[Plan] = []
        """Every plan received, in order: each applied, and each a newer one replaced before a step ran it."""
        self.pinned: tuple[Mode, ...] | None = None
        """Modes fixed by hand (benchmarks, experiments); they win over any plan."""
        self.lean_after: int | None = None
        """While set, a budget cut waits for a plan newer than this version: every block keeps the least it can."""
        self._awaiting = False
        """A budget cut the planner's thread has not taken in yet: every block keeps the least it can until it has
        (its plan for the cut, or its word that the plan in force fits, comes first)."""
        self._lean_past: tuple[int, int, int] | None = None
        """The largest length and tokens a step past the table ran at its leanest, and the plan version then."""
        self._applied: tuple[object, ...] | None = None
        """What the blocks' modes were last set from: the same again needs no work."""
        self.price: Pricer = lambda modes, version, reason, shape: None
        """Prices a pin as a plan (the backend's planner, once it opens)."""
        self._pin_plan: Plan | None = None
        self._lean: tuple[Mode, ...] | None = None
        """The leanest modes when the last step ran them for want of a plan that covers it, with why; else None."""
        self._lean_why = ""
        self._shape = Shape()
        """The shape the blocks' modes were last set for."""
        self._shown: tuple[tuple[object, ...], Plan] | None = None
        self.ran_why = ""
        """Why the blocks run other modes than the plan's this step, when something after the plan set them."""
        self.group_version: int | None = None
        """Where ranks agree on one plan each step: the newest plan version any rank of the group put forward
        this step, which the plan in force shows as its version (the ranks' planners number their plans apart)."""

    def invalidate(self) -> None:
        """The blocks' modes were set by other means (safe mode, a pin): set them at the next step."""
        self._applied = None

    def _ran_plan(self, ran: tuple[Mode, ...]) -> Plan:
        """:meth:`in_force` without a pin, for the blocks' modes ``ran``."""
        if self._lean is None:
            plan = self.plan.at(self._shape)
            why = ""
        else:
            plan, why = self.plan, self._lean_why
        if plan.version and ran != (self._lean if self._lean is not None else plan.modes):
            # Set after the plan's: the ranks agreed on leaner modes, or recovery from an out-of-memory error.
            why = f"{self.ran_why or OTHER_MODES}: {letters(ran)}"
        if ran == plan.modes and not why:
            return plan
        # Modes of no table entry: priced by the profile at the step's shape where the planner is open.
        priced = self.price(ran, plan.version, plan.reason, self._shape) if plan.version else None
        figures = (priced.predicted_peak_bytes, priced.predicted_overhead_ratio) if priced is not None else (0, 0.0)
        return plan.running(ran, predicted_peak_bytes=figures[0], overhead=figures[1], why=why)

    def profiled_as(self, modes: tuple[Mode, ...]) -> None:
        """The profiling step runs ``modes`` (set by the step cycle, not from a plan)."""
        why = "this step profiles the blocks, each as it recomputes" if self.plan.version else ""
        self._lean, self._lean_why, self._shape = modes, why, Shape()
        self.invalidate()

    def pin(self, modes: Sequence[Mode] | None) -> None:
        """Fix every block's mode from the next step on (None: follow the plans again)."""
        if modes is not None and len(modes) != len(self.blocks):
            raise ValueError(f"pin_modes needs {len(self.blocks)} modes, one per block, got {len(modes)}")
        self.pinned = None if modes is None else tuple(modes)
        self.invalidate()

    def in_force(self) -> Plan:
        """The plan in force for the current (or last) step: the planner's, its table's entry for the step's
        length in its own fields (the modes that run, that length's prediction); a plan of the leanest modes,
        saying why, where the step ran them for want of a plan; or under a pin a plan of the pinned modes (the
        planner's version, priced by the profile once there is one; lossy, and saying so, when some block
        compresses)."""
        pins = self.pinned
        if pins is None:
            ran = tuple(b.mode for b in self.blocks)
            key = (self.plan.version, self._shape, ran, self._lean, self._lean_why, self.ran_why, self.group_version)
            if self._shown is not None and self._shown[0] == key:
                return self._shown[1]  # read each step (the budget watch): the same again costs nothing
            plan = self._as_group(self._ran_plan(ran))
            self._shown = (key, plan)
            return plan
        return self._as_group(self._pinned_plan(pins))

    def _as_group(self, plan: Plan) -> Plan:
        """``plan`` under the version the ranks that agree show (itself where none agree)."""
        shown = self.group_version
        if shown is None or shown == plan.version:
            return plan
        why = f"v{shown} is the newest plan of the ranks that run one plan (this rank's planner's: v{plan.version})"
        return dataclasses.replace(plan, version=shown, reason=f"{plan.reason}; {why}")

    def _pinned_plan(self, pins: tuple[Mode, ...]) -> Plan:
        """:meth:`in_force` under a pin."""
        version = self.plan.version
        cached = self._pin_plan
        if cached is not None and cached.version == version and cached.modes == pins:
            return cached
        reason = (
            f"pinned in the training process (h.pin_modes): modes {letters(pins)}; the planner's own plan "
            f"(v{version}) comes back with h.pin_modes(None)"
        )
        priced = self.price(pins, version, reason, None)
        if priced is not None:
            self._pin_plan = priced
            return priced
        lossy = lossy_note(pins, ())
        return Plan(
            version=version,
            blocks=blocks_of(pins),
            checkpoint_every=0,
            predicted_peak_bytes=0,
            predicted_overhead_ratio=0.0,
            target_bytes=self.plan.target_bytes,
            reason=f"{reason} (not priced before the profiling step ends)" + (f"; {lossy}" if lossy else ""),
            modes=pins,
        )

    def receive(self, plan: Plan) -> None:
        """Called by the planner's side (any thread): keep the newest plan for the next step."""
        with self._lock:
            if plan.version > (self._pending or self.plan).version:
                if self._pending is not None:
                    self._superseded.append(self._pending)
                self._pending = plan

    def has_pending(self) -> bool:
        with self._lock:
            return self._pending is not None

    def apply_pending(self, shape: Shape | None = None) -> Plan | None:
        """Called by the training thread at a step boundary: take the newest plan and set
        each block's mode for this step's ``shape`` from the plan's table."""
        applied = self._applied
        if (
            self._pending is None  # read without the lock: a plan that arrives now is taken at the next step
            and applied is not None
            and shape is self._shape
            and applied[1] == self.plan.version
            and applied[0] is self.pinned
            and applied[3] == self.lean_after
            and applied[4] == self._awaiting
        ):
            return None  # the modes set for the last step stand: nothing to take, nothing to set
        with self._lock:
            plan, self._pending = self._pending, None
            superseded, self._superseded = self._superseded, []
            awaiting = self._awaiting
        n = len(self.blocks)
        if plan is not None:
            bad = [i for i in plan.blocks if i >= n]
            if bad:
                log.warning(
                    "rematd: plan %d names blocks %s beyond the model's %d; ignoring them", plan.version, bad, n
                )
            if plan.modes and len(plan.modes) != n:
                log.warning("rematd: plan %d has %d modes for %d blocks; ignoring it", plan.version, len(plan.modes), n)
                plan = None
        if plan is not None:
            self.plan = plan
            self.history += [*superseded, plan]
            if self.lean_after is not None and plan.version > self.lean_after:
                self.lean_after = None  # the planner answered the new budget
        shape = shape or Shape()
        key = (self.pinned, self.plan.version, shape, self.lean_after, awaiting)
        if key == self._applied:
            self._shape = shape  # an equal shape in a new object: the next step's check finds it by identity
            return plan
        self._applied = key
        self._shape, self._lean = shape, None
        if self.pinned is not None:
            modes = self.pinned
        elif self.lean_after is not None or awaiting or not self.plan.version or self._beyond(shape):
            # No plan yet (a service answers the profile a step or more later), a budget cut not yet
            # answered, or a step past the table: every block keeps the least it can.
            modes = tuple(leanest(b.offer) for b in self.blocks)
            self._lean = modes
            self._lean_why = (
                ""  # the profiling plan's reason says it
                if not self.plan.version
                else f"this step runs every block at its leanest: the budget was cut after v{self.plan.version}"
                if self.lean_after is not None or awaiting
                else f"this step runs every block at its leanest: length {shape.seq_len} is past the plan's table"
            )
        else:
            modes = self.plan.modes_for(shape, n)
        for b, mode in zip(self.blocks, modes, strict=False):
            b.mode = mode
        return plan

    def _beyond(self, shape: Shape) -> bool:
        """Whether a step of ``shape`` runs every block at its leanest: it is longer, or holds more tokens,
        than any entry of the plan's table covers, and so more than the longest entry was fitted to (a step
        8 times as long as the longest seen, a larger batch). The planner extends the table after it. Where
        a newer plan still does not cover such a step (its ladder capped, entries planned for a smaller
        batch), steps no larger than one it has seen run the longest entry again, as before."""
        table = self.plan.shape_plans
        if not table or not shape.seq_len or any(e.covers(shape) for e in table):
            return False
        seen = self._lean_past
        if seen is not None and shape.seq_len <= seen[0] and shape.tokens <= seen[1] and self.plan.version != seen[2]:
            return False
        longest, most = (seen[0], seen[1]) if seen is not None else (0, 0)
        self._lean_past = (max(shape.seq_len, longest), max(shape.tokens, most), self.plan.version)
        return True

    def hold_until_answered(self, shape: Shape, target_bytes: int) -> bool:
        """A budget cut handed to the planner's thread: when the newest plan (in force, or waiting for the next
        step) is not predicted to fit ``target_bytes`` at ``shape``, or there is none yet (the first may be
        made for the old budget as this runs), every block keeps the least it can from the next step until
        :meth:`answered`. Returns whether it does."""
        with self._lock:
            newest = self._pending or self.plan
            self._awaiting = not newest.version or self._predicted(newest, shape) > target_bytes
            held = self._awaiting
        self.invalidate()
        return held

    def answered(self) -> None:
        """The planner's thread has taken in the budget cut (its plan for it, if any, is already waiting)."""
        with self._lock:
            self._awaiting = False

    @staticmethod
    def _predicted(plan: Plan, shape: Shape) -> int:
        entry = entry_for(plan.shape_plans, shape) if shape.seq_len else None
        return entry.predicted_peak_bytes if entry is not None else plan.predicted_peak_bytes

    def hold_lean(self, shape: Shape, target_bytes: int) -> bool:
        """A budget cut the planner has not answered yet (a service plans from the next step's statistics):
        when the plan in force is not predicted to fit ``target_bytes`` at ``shape``, every block keeps the
        least it can from the next step until a newer plan arrives. Returns whether it does."""
        predicted = self._predicted(self.plan, shape)
        with self._lock:
            newest = (self._pending or self.plan).version
        self.lean_after = newest if self.plan.version and predicted > target_bytes else None
        self.invalidate()
        return self.lean_after is not None
