"""Placing modes within a class of identical blocks: which of them run which mode, spread evenly."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rematd.planner.units import Mode


def place(
    blocks: Sequence[int], counts: list[int], h: Sequence[tuple[int, float, int, Mode]], modes: list[Mode]
) -> list[int]:
    """Sets the modes of a class's ``blocks``, ``counts[v]`` of them at hull vertex ``v``: the
    most-recomputing vertex first, spread evenly over the blocks. Returns the vertices used."""
    remaining = blocks
    used = []
    for v in range(len(h) - 1, -1, -1):
        if not counts[v]:
            continue
        used.append(v)
        picked = spread(remaining, counts[v]) if v and counts[v] < len(remaining) else remaining
        for i in picked:
            modes[i] = h[v][3]
        if picked is not remaining:
            taken = set(picked)
            remaining = [i for i in remaining if i not in taken]
    return used


def spread(indices: Sequence[int], count: int) -> list[int]:
    """``count`` of ``indices`` spread evenly, as "every k-th" when some k gives exactly that many."""
    n = len(indices)
    if count >= n:
        return list(indices)
    if count <= 0:
        return []
    for k in range(1, n + 1):
        if math.ceil(n / k) == count:
            return [indices[j] for j in range(0, n, k)]
    return [indices[(j * n) // count] for j in range(count)]
