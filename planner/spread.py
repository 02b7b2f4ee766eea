"""Placing modes within a class of identical blocks: which of them run which mode.

The blocks of a class cost the same seconds in any placement, so placement is chosen by the peak and by
what the per-block prices cannot see: the modes that bring most back in backward go first (Megatron's
"block" recomputation, rather than every k-th block). Over a run of alike blocks on one stage, each
rematerialisation then runs when the fewest kept bytes are still held (the solvers keep another
placement only where this one would not fit); and on a CPU the stored activations are the last
blocks', which wait least for their backward and more often come back from cache (``python -m
bench.copies``: every third of 12 blocks recomputed took 4.5% longer a step than the first 4).
``spread`` remains for the "every k-th" plans people run, which the benchmarks compare against."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rematd.planner.units import Mode


def placed_first(mode: Mode, transient: int, kept: int) -> tuple[bool, int, int]:
    """The order of a class's modes on its blocks, first to last: the one that brings most back in
    backward first (the one keeping least on a tie), storing last."""
    return mode == Mode.STORE, -transient, kept


def place(
    blocks: Sequence[int], counts: list[int], h: Sequence[tuple[int, float, int, Mode]], modes: list[Mode]
) -> list[int]:
    """Sets the modes of a class's ``blocks``, ``counts[v]`` of them at hull vertex ``v``, in the order
    of :func:`placed_first`. Returns the vertices used."""
    used = sorted((v for v in range(len(h)) if counts[v]), key=lambda v: placed_first(h[v][3], h[v][2], h[v][0]))
    at = 0
    for v in used:
        for i in blocks[at : at + counts[v]]:
            modes[i] = h[v][3]
        at += counts[v]
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
