"""How the store's columns hold what the service passes around, both ways.

Lists and dicts are JSON text; a plan's modes are one letter a block; a column a later
migration added reads back as what the rows written before it meant.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rematd.planner import Mode
from rematd.server.store.rows import ControlsRow, PlanRow, ShapePlanRow, WarmPlanRow

STORE, RECOMPUTE = Mode.STORE.label, Mode.RECOMPUTE.label
# Modes are kept one letter a block, as the demo prints them: a plan of 4096 blocks with a table of
# ten lengths is 40 KB of letters, where a JSON list of names would be ten times that.
_LETTER = {m.label: m.letter for m in Mode}
_NAME = {m.letter: m.label for m in Mode}


def loads(text: str | None) -> Any:
    """A JSON column's value; None for NULL."""
    return json.loads(text) if text else None


def dumps(value: Any) -> str | None:
    """What a JSON column holds of ``value``; NULL for None."""
    return json.dumps(value) if value is not None else None


def decoded(r: Mapping[str, Any], *, json_columns: Iterable[str] = (), drop: Iterable[str] = ()) -> dict[str, Any]:
    """A row as a dict, its JSON columns decoded, without the columns in ``drop``."""
    d = dict(r)
    for k in drop:
        d.pop(k, None)
    for k in json_columns:
        d[k] = loads(d[k])
    return d


def pack_modes(names: Sequence[str]) -> str:
    return "".join(_LETTER[n] for n in names)


def unpack_modes(letters: str) -> list[str]:
    return [_NAME[c] for c in letters]


def packed(names: Sequence[str] | None) -> str | None:
    """Modes as stored, NULL for none."""
    return pack_modes(names) if names is not None else None


def derived_modes(blocks: Sequence[int], num_blocks: int) -> list[str]:
    """The modes of a plan recorded with blocks only: those recompute, the others store."""
    chosen = set(blocks)
    return [RECOMPUTE if i in chosen else STORE for i in range(num_blocks)]


def pack_table(table: Sequence[ShapePlanRow]) -> str:
    return json.dumps([{**e, "modes": pack_modes(e["modes"])} for e in table])


def _unpack_table(text: str | None) -> list[dict[str, Any]]:
    return [{**e, "modes": unpack_modes(e["modes"])} for e in loads(text) or []]


def _plan_like(d: dict[str, Any], num_blocks: int | None) -> dict[str, Any]:
    """A plan's or a warm plan's columns decoded in place; those written before modes were kept read
    back as their blocks recomputing and the rest storing."""
    d["blocks"] = loads(d["blocks"])
    if d.get("modes") is not None:
        d["modes"] = unpack_modes(d["modes"])
    else:
        n = num_blocks if num_blocks is not None else max(d["blocks"], default=-1) + 1
        d["modes"] = derived_modes(d["blocks"], n)
    d["shape_plans"] = _unpack_table(d.get("shape_plans"))
    return d


def plan_out(r: Mapping[str, Any], drop: Sequence[str] = ("id", "job")) -> dict[str, Any]:
    """A row of ``PLANS`` as the plan it records."""
    d = decoded(r, drop=drop)
    n = d.pop("job_blocks", None)
    return _plan_like(d, int(n) if n is not None else None)


def warm_plan_out(r: Mapping[str, Any]) -> dict[str, Any]:
    d = dict(r)
    return _plan_like(d, int(d["num_blocks"]))


def controls_out(r: Mapping[str, Any]) -> dict[str, Any]:
    d = decoded(r, json_columns=("pin_blocks",))
    d["pin_modes"] = unpack_modes(d["pin_modes"]) if d.get("pin_modes") is not None else None
    return d


def plan_params(job: str, rank: int, plan: PlanRow, now: float) -> dict[str, Any]:
    return {
        "job": job,
        "rank": rank,
        "version": plan["version"],
        "every": plan["checkpoint_every"],
        "blocks": dumps(list(plan["blocks"])),
        "peak": plan["predicted_peak_bytes"],
        "overhead": plan["predicted_overhead_ratio"],
        "target": plan["target_bytes"],
        "reason": plan["reason"],
        "now": now,
        "modes": packed(plan["modes"]),
        "table": pack_table(plan["shape_plans"]),
        "seq_len": plan.get("seq_len"),
    }


def warm_params(row: WarmPlanRow) -> dict[str, Any]:
    return {**row, "blocks": dumps(list(row["blocks"])), "modes": packed(row["modes"]),
            "shape_plans": pack_table(row["shape_plans"])}  # fmt: skip


def controls_params(job: str, controls: ControlsRow, revision: int, now: float) -> dict[str, Any]:
    return {
        "job": job,
        "pb": dumps(controls.get("pin_blocks")),
        "pm": packed(controls.get("pin_modes")),
        "pe": controls.get("pin_every"),
        "mr": controls.get("margin_ratio"),
        "bb": controls.get("budget_bytes"),
        "ea": controls.get("ended_at"),
        "rev": revision,
        "now": now,
    }
