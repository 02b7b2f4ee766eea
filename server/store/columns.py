"""How the store's columns hold what the service passes around, both ways.

Lists and dicts are JSON text; a plan's modes are one letter a block; a column a later
migration added reads back as what the rows written before it meant.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import SupportsInt, TypeVar, cast

from rematd.planner import Mode
from rematd.server.store.rows import (
    ControlsRow,
    ModeName,
    PlanRow,
    ShapePlanRow,
    StoredControlsRow,
    StoredPlanRow,
    WarmPlanRow,
)
from rematd.server.store.tables import JOB_CONTROLS, PLANS, WARM_PLANS

STORE, RECOMPUTE = Mode.STORE.label, Mode.RECOMPUTE.label
# Modes are kept one letter a block, as the demo prints them: a plan of 4096 blocks with a table of
# ten lengths is 40 KB of letters, where a JSON list of names would be ten times that.
_LETTER = {m.label: m.letter for m in Mode}
_NAME: dict[str, ModeName] = {m.letter: cast(ModeName, m.label) for m in Mode}

Row = TypeVar("Row")
Params = dict[str, object]
"""A statement's parameters, bound by column name."""


def as_row(kind: type[Row], columns: Mapping[str, object]) -> Row:
    """Columns read back as the row type their table keeps. The one place a read is taken on trust:
    the tests hold each table's columns to its row type (``tables``), and the decoders below turn the
    columns that hold text (JSON, mode letters) back into the fields' types."""
    return cast(Row, dict(columns))


def loads(text: object) -> object:
    """A JSON column's value; None for NULL."""
    return json.loads(_text(text) or "null")


def _text(value: object) -> str | None:
    """A text column's value; None for NULL."""
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"a text column holds a {type(value).__name__}")


def as_int(value: object) -> int:
    """An integer column's value (a count, a maximum, a number of blocks), whatever number type the driver read."""
    if isinstance(value, (SupportsInt, str)):
        return int(value)
    raise TypeError(f"an integer column holds a {type(value).__name__}")


def dumps(value: object) -> str | None:
    """What a JSON column holds of ``value``; NULL for None."""
    return json.dumps(value) if value is not None else None


def decoded(r: Mapping[str, object], *, json_columns: Iterable[str] = (), drop: Iterable[str] = ()) -> Params:
    """A row's columns, its JSON columns decoded, without the columns in ``drop``."""
    d = dict(r)
    for k in drop:
        d.pop(k, None)
    for k in json_columns:
        d[k] = loads(d[k])
    return d


def pack_modes(names: Sequence[str]) -> str:
    return "".join(_LETTER[n] for n in names)


def unpack_modes(letters: object) -> list[ModeName]:
    return [_NAME[c] for c in _text(letters) or ""]


def packed(names: Sequence[str] | None) -> str | None:
    """Modes as stored, NULL for none."""
    return pack_modes(names) if names is not None else None


def derived_modes(blocks: Sequence[int], num_blocks: int) -> list[ModeName]:
    """The modes of a plan recorded with blocks only: those recompute, the others store."""
    chosen = set(blocks)
    return ["recompute" if i in chosen else "store" for i in range(num_blocks)]


def pack_table(table: Sequence[ShapePlanRow]) -> str:
    return json.dumps([{**e, "modes": pack_modes(e["modes"])} for e in table])


def _unpack_table(text: object) -> list[ShapePlanRow]:
    entries = cast(list[dict[str, object]], loads(text) or [])
    return [as_row(ShapePlanRow, {**e, "modes": unpack_modes(e["modes"])}) for e in entries]


def _plan_like(d: Params, num_blocks: int | None) -> Params:
    """A plan's or a warm plan's columns decoded in place; those written before modes were kept read
    back as their blocks recomputing and the rest storing."""
    blocks = cast(list[int], loads(d["blocks"]))
    d["blocks"] = blocks
    if d.get("modes") is not None:
        d["modes"] = unpack_modes(d["modes"])
    else:
        n = num_blocks if num_blocks is not None else max(blocks, default=-1) + 1
        d["modes"] = derived_modes(blocks, n)
    d["shape_plans"] = _unpack_table(d.get("shape_plans"))
    return d


def plan_out(r: Mapping[str, object], drop: Sequence[str] = ("id", "job")) -> StoredPlanRow:
    """A row of ``plans`` (joined with its job's ``job_blocks``) as the plan it records."""
    d = decoded(r, drop=drop)
    n = d.pop("job_blocks", None)
    return as_row(StoredPlanRow, _plan_like(d, as_int(n) if n is not None else None))


def warm_plan_out(r: Mapping[str, object]) -> WarmPlanRow:
    d = dict(r)
    return as_row(WarmPlanRow, _plan_like(d, as_int(d["num_blocks"])))


def controls_out(r: Mapping[str, object]) -> StoredControlsRow:
    d = decoded(r, json_columns=("pin_blocks",))
    modes = d.get("pin_modes")
    d["pin_modes"] = unpack_modes(modes) if modes is not None else None
    return as_row(StoredControlsRow, d)


def plan_params(job: str, rank: int, plan: PlanRow, now: float) -> Params:
    """A plan's row of ``plans``."""
    return PLANS.values({**plan, "job": job, "rank": rank, "created_at": now, "blocks": dumps(list(plan["blocks"])),
                         "modes": packed(plan["modes"]), "shape_plans": pack_table(plan["shape_plans"])})  # fmt: skip


def warm_params(row: WarmPlanRow) -> Params:
    return WARM_PLANS.values({**row, "blocks": dumps(list(row["blocks"])), "modes": packed(row["modes"]),
                              "shape_plans": pack_table(row["shape_plans"])})  # fmt: skip


def controls_params(job: str, controls: ControlsRow, now: float) -> Params:
    """A job's row of ``job_controls``: every override, NULL where the controls leave it unset; its revision is the
    write's to number (0 here)."""
    return JOB_CONTROLS.values({**controls, "job": job, "pin_blocks": dumps(controls.get("pin_blocks")),
                                "pin_modes": packed(controls.get("pin_modes")), "revision": 0,
                                "updated_at": now})  # fmt: skip
