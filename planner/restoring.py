"""Reading back a saved planner state: numbers, counts and lengths checked one by one, so that a bad state
is refused with the field it went wrong at, never taken in part."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from rematd.planner.units import Mode

_T = TypeVar("_T")

MAX_SUM = 1e12
"""Bound on a restored decayed sum (seconds or blocks): anything larger is not a measurement."""
MAX_STEP = 2**53
"""Bound on a restored step count or length: beyond it a float loses whole numbers."""


def restored_by_length(raw: Any, where: str, restore: Callable[[Any, str], _T], *, most: int) -> dict[int, _T]:
    """A restored list of at most ``most`` [bucket top, sums] pairs, each sums read by ``restore`` (given
    where it is, to name in its errors), the order kept; ValueError naming ``where`` otherwise."""
    if not isinstance(raw, list) or len(raw) > most:
        raise ValueError(f"state: {where} must be a list of at most {most} [length, sums] pairs")
    out: dict[int, _T] = {}
    for entry in raw:
        if not isinstance(entry, list) or len(entry) != 2:
            raise ValueError(f"state: {where} must hold [length, sums] pairs, got {entry!r}")
        top, sums = entry
        if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= MAX_STEP or top in out:
            raise ValueError(f"state: {where} has a bad or repeated length {top!r}")
        out[top] = restore(sums, f"{where}[{top}]")
    return out


def number(value: Any, what: str) -> float:
    """A restored decayed sum: a finite number in [0, ``MAX_SUM``]; ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"state: {what} must be a number, got {value!r}")
    if (isinstance(value, float) and math.isnan(value)) or not 0 <= value <= MAX_SUM:
        raise ValueError(f"state: {what} must be a finite number in [0, {MAX_SUM:g}], got {value!r}")
    return float(value)


def whole_number(value: Any, what: str, *, lo: int = 0) -> int:
    """A restored count, step or length: an integer in [``lo``, ``MAX_STEP``]; ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= MAX_STEP:
        raise ValueError(f"state: {what} must be an integer in [{lo}, {MAX_STEP}], got {value!r}")
    return value


def mode_sums(state: dict[str, Any], key: str, where: str, parse: Callable[[Any, str], _T]) -> dict[Mode, _T]:
    """``state[key]``, an object of mode names, each value read by ``parse``."""
    raw = state.get(key, {})
    if not isinstance(raw, dict):
        raise ValueError(f"state: {where}.{key} must be an object of modes, got {raw!r}")
    out: dict[Mode, _T] = {}
    for name, value in raw.items():
        mode = Mode.__members__.get(name.upper()) if isinstance(name, str) else None
        if mode is None:
            raise ValueError(f"state: {where}.{key} has an unknown mode {name!r}")
        out[mode] = parse(value, f"{where}.{key}.{name}")
    return out
