"""What a rank is sent, decided without a server or a store: pins, warm starts, versions, fit checks.

Every function here is pure over its arguments (a rank's planner is read, never changed), so the
policy is tested on its own; the core supplies the operator's controls, the warm-start row the
store holds and the plan the rank has, and writes what is decided.
"""

from __future__ import annotations

import dataclasses
from typing import cast

from typing_extensions import TypedDict

from rematd.planner import (
    MODES_BY_LABEL,
    Mode,
    Plan,
    PlannerSession,
    Shape,
    ShapePlan,
    every_k_blocks,
    letters,
)
from rematd.planner.cost import overhead_ratio
from rematd.planner.messages import MAX_INT, InvalidMessage

# The rule folds a rank's steady steps alike in the service and in the training process.
from rematd.planner.quiet import QUIET_RISK as QUIET_RISK
from rematd.planner.quiet import report_interval as report_interval
from rematd.planner.shapes import at_shape
from rematd.server.store.rows import ModeName, PlanRow, ShapePlanRow, WarmPlanRow

WARM_BUDGET_TOLERANCE = 0.10
"""A warm start is taken only from a job whose budget is within this fraction of the new job's (of the larger
of the two): a plan made for another budget is too lean, or too loose, to start from."""


def mode_names(modes: tuple[Mode, ...]) -> list[ModeName]:
    return [cast(ModeName, m.label) for m in modes]


def modes_of(names: list[str], field_name: str) -> tuple[Mode, ...]:
    bad = sorted({n for n in names if n not in MODES_BY_LABEL})
    if bad:
        raise InvalidMessage(field_name, f"unknown mode(s) {bad}; use {', '.join(MODES_BY_LABEL)}")
    return tuple(MODES_BY_LABEL[n] for n in names)


def recompute(blocks: tuple[int, ...], n: int) -> tuple[Mode, ...]:
    chosen = set(blocks)
    return tuple(Mode.RECOMPUTE if i in chosen else Mode.STORE for i in range(n))


def shape_plan_row(entry: ShapePlan) -> ShapePlanRow:
    return ShapePlanRow(
        max_seq_len=entry.max_seq_len,
        max_tokens=entry.max_tokens,
        modes=mode_names(entry.modes),
        predicted_peak_bytes=entry.predicted_peak_bytes,
        predicted_overhead_ratio=entry.predicted_overhead_ratio,
    )


def shape_plan_of(row: ShapePlanRow) -> ShapePlan:
    return ShapePlan(
        max_seq_len=int(row["max_seq_len"]),
        max_tokens=int(row["max_tokens"]),
        modes=modes_of(list(row["modes"]), "shape_plans.modes"),
        predicted_peak_bytes=int(row["predicted_peak_bytes"]),
        predicted_overhead_ratio=float(row["predicted_overhead_ratio"]),
    )


def plan_row(plan: Plan, num_blocks: int, seq_len: int | None = None) -> PlanRow:
    """A plan as the store and the REST API keep it: every block's mode and the per-length table, and the
    length of the step it was made at."""
    return PlanRow(
        version=plan.version,
        checkpoint_every=plan.checkpoint_every,
        blocks=list(plan.blocks),
        modes=mode_names(plan.block_modes(num_blocks)),
        shape_plans=[shape_plan_row(e) for e in plan.shape_plans],
        predicted_peak_bytes=plan.predicted_peak_bytes,
        predicted_overhead_ratio=plan.predicted_overhead_ratio,
        target_bytes=plan.target_bytes,
        reason=plan.reason,
        seq_len=seq_len or None,
    )


class TableEntry(TypedDict):
    """What one length of a plan runs (``max_seq_len`` None: the plan's own modes, without a table)."""

    max_seq_len: int | None
    modes: list[ModeName]
    predicted_peak_bytes: int
    predicted_overhead_ratio: float


def entry_in_force(plan: PlanRow, seq_len: int | None, tokens: int | None = None) -> TableEntry:
    """Of a recorded plan, what a step of ``seq_len`` runs: the first table entry covering it, the
    longest past the table, the plan's own modes without a table (or without a length)."""
    table = plan.get("shape_plans") or []
    entry = None
    if table and seq_len:
        entry = next(
            (e for e in table if seq_len <= e["max_seq_len"] and (tokens is None or tokens <= e["max_tokens"])),
            table[-1],
        )
    source: PlanRow | ShapePlanRow = plan if entry is None else entry
    return TableEntry(
        max_seq_len=None if entry is None else entry["max_seq_len"],
        modes=source["modes"],
        predicted_peak_bytes=source["predicted_peak_bytes"],
        predicted_overhead_ratio=source["predicted_overhead_ratio"],
    )


def shape_bucket(tokens: int) -> int:
    """Power-of-two bucket of tokens per batch: plans learnt at one size serve sizes within 2x."""
    return int(tokens).bit_length()


def check_fits(plan: Plan, cause: str) -> None:
    """Refuse, naming the field that led to it, a plan with numbers the store cannot hold.

    Every field is bounded on arrival, but sizes scale with the shape and add up over blocks,
    and versions count up: an absurd profile or shape must cost its own stream, not the store.
    """
    if plan.version > MAX_INT:
        raise InvalidMessage("hello.plan_version", f"plan versions would pass {MAX_INT}")
    peak = max(plan.predicted_peak_bytes, plan.target_bytes, *(e.predicted_peak_bytes for e in plan.shape_plans))
    if peak > MAX_INT:
        raise InvalidMessage(
            cause, f"the profile's sizes and static_bytes predict a peak of {peak} bytes, more than {MAX_INT}"
        )


def pinned_plan(
    planner: PlannerSession,
    version: int,
    num_blocks: int,
    *,
    pin_modes: tuple[Mode, ...] | None,
    pin_every: int | None,
    pin_blocks: tuple[int, ...] | None,
) -> Plan | None:
    """The plan an operator's pin makes for a rank of ``num_blocks`` blocks; None when nothing is pinned."""
    n = num_blocks
    if pin_modes is not None:
        modes = (pin_modes + (Mode.STORE,) * n)[:n]
        reason = f"pinned by an operator: modes {letters(modes)}"
    elif pin_every is not None:
        blocks = every_k_blocks(n, pin_every)
        modes = recompute(blocks, n)
        reason = (
            f"pinned by an operator: every {pin_every} block(s) recompute"
            if blocks
            else "pinned by an operator: every block stores"
        )
    elif pin_blocks is not None:
        blocks = tuple(b for b in pin_blocks if b < n)
        modes = recompute(blocks, n)
        reason = f"pinned by an operator: blocks {list(blocks)} recompute"
    else:
        return None
    return planner.plan_of(modes, version=version, reason=reason)


def next_plan(want: Plan, sent: Plan, num_blocks: int, *, always: bool = False) -> Plan | None:
    """``want`` versioned after ``sent`` when the rank must hear of it (``always``: whatever it changes), else
    None.

    Modes and the table, not just which blocks checkpoint: selective to recompute, or an entry for
    another length, is a change the rank must hear of.
    """
    n = num_blocks
    if not always and (want.block_modes(n), want.shape_plans) == (sent.block_modes(n), sent.shape_plans):
        return None
    return dataclasses.replace(want, version=sent.version + 1)


def overhead_at(planner: PlannerSession, modes: tuple[Mode, ...], shape: Shape) -> float:
    """The recompute overhead predicted for a step of ``shape`` that runs ``modes`` (0 where they are not priced)."""
    try:
        at = at_shape(planner.profile, shape if shape.seq_len else None)
        return overhead_ratio(at.cost(modes)[1], at.forward_seconds)
    except ValueError:
        return 0.0


def predicted_at(planner: PlannerSession, plan: Plan, shape: Shape, static_bytes: int, num_blocks: int) -> int:
    """The peak predicted for one step: the modes ``plan`` runs at its shape, priced at that shape."""
    try:
        at = at_shape(planner.profile, shape if shape.seq_len else None)
        return static_bytes + at.other_bytes + at.cost(plan.modes_for(shape, num_blocks))[0]
    except ValueError:
        return plan.predicted_peak_bytes


def warm_start_plan(
    warm: WarmPlanRow | None, *, job: str, num_blocks: int, planner: PlannerSession, version: int
) -> Plan | None:
    """The plan an earlier job of the same model left (``warm``, as the store keeps it), for a new
    rank of ``job``; None when it is this job's own, of another size, for a budget more than
    ``WARM_BUDGET_TOLERANCE`` away, unreadable, or does not fit.

    Raises ValueError only for a row it cannot read (the caller logs that and plans from the profile).
    """
    n = num_blocks
    if warm is None or warm["num_blocks"] != n or warm["job"] == job:
        return None
    budgets = (int(warm["budget_bytes"]), planner.budget_bytes)
    if abs(budgets[0] - budgets[1]) > WARM_BUDGET_TOLERANCE * max(budgets):
        return None
    try:
        modes = modes_of(list(warm["modes"]), "warm_plans.modes")
        table = tuple(shape_plan_of(e) for e in warm["shape_plans"])
    except (InvalidMessage, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"the warm-start plan of job {warm['job']} is unreadable") from err
    if len(modes) != n or any(len(e.modes) != n for e in table):
        return None
    planned = planner.plan
    if modes == planned.block_modes(n) and table == planned.shape_plans:
        reason = f"warm start from job {warm['job']} (same as planned)"
    else:
        # Only when it fits this job's target by the profile it sent, at every length of its
        # table (or, where nothing fits, is as lean as any plan): another budget may not hold it.
        target = planned.target_bytes
        static = planner.static_bytes
        profile = planner.profile
        try:
            at = at_shape(profile, None)
            if static + at.other_bytes + at.cost(modes)[0] > target:
                return None
            for e in table:
                at = at_shape(profile, Shape(batch=profile.shape.batch, seq_len=e.max_seq_len, tokens=e.max_tokens))
                peak = at.cost(e.modes)[0]
                if static + at.other_bytes + peak > target and peak > at.knapsack.least_peak()[0]:
                    return None
        except ValueError:  # a mode this profile does not offer
            return None
        reason = f"warm start from job {warm['job']}"
    return planner.plan_of(modes, version=version, reason=reason, table=table)
