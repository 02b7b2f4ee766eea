"""The knapsack's blocks grouped by their byte costs: each class of identical blocks, its options' lower
convex hull of (kept, seconds) under every cap on the transient at which its choice widens, and the order
its blocks take modes in."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from rematd.planner.model import Option
from rematd.planner.units import Mode

INF = math.inf

# An option as the knapsack sees it: (kept, seconds, transient, mode); tuples sort and compare fast.
Opt = tuple[int, float, int, Mode]


def hull(opts: Sequence[Opt]) -> list[Opt]:
    """The lower convex hull of (kept, seconds), from most kept (least seconds) to least kept;
    ``opts`` sorted by (kept, seconds)."""
    pruned: list[Opt] = []
    best = INF
    for o in opts:
        if o[1] < best - 1e-15:  # else some option keeps no more and is no slower
            pruned.append(o)
            best = o[1]
    pruned.reverse()
    out: list[Opt] = []
    for o in pruned:
        while len(out) >= 2:
            a, b = out[-2], out[-1]
            # b is on or above the segment a -> o: never worth stopping at.
            if (b[1] - a[1]) * (a[0] - o[0]) >= (o[1] - a[1]) * (a[0] - b[0]):
                out.pop()
            else:
                break
        out.append(o)
    return out


@dataclass(frozen=True, slots=True)
class BlockClass:
    """Blocks with identical byte costs (seconds averaged over them)."""

    blocks: tuple[int, ...]
    thresholds: tuple[int, ...]
    """Distinct transients, ascending: state j holds for caps in [thresholds[j], thresholds[j + 1])."""
    hulls: tuple[tuple[Opt, ...], ...]
    """The hull of each state."""

    def state(self, cap: int) -> int:
        return bisect_right(self.thresholds, cap) - 1


def classes_of(options: Sequence[Sequence[Option]]) -> list[BlockClass]:
    """Every block's ``options`` as classes of blocks alike in bytes, in the order they first appear."""
    groups: dict[tuple[tuple[Mode, int, int, int], ...], list[int]] = {}
    keys: dict[int, tuple[tuple[Mode, int, int, int], ...]] = {}  # equal blocks often share one list
    for i, opts in enumerate(options):
        key = keys.get(id(opts))
        if key is None:
            key = keys[id(opts)] = tuple([(o.mode, o.kept + o.others, o.transient, o.group) for o in opts])
        groups.setdefault(key, []).append(i)
    classes = []
    for key, idx in groups.items():
        if len(idx) == 1:
            merged = [(o.kept + o.others, o.seconds, o.transient, o.mode) for o in options[idx[0]]]
        else:
            secs = [sum(options[i][j].seconds for i in idx) / len(idx) for j in range(len(key))]
            merged = [(kept, s, transient, mode) for (mode, kept, transient, _group), s in zip(key, secs, strict=True)]
        merged.sort()
        thresholds = tuple(sorted({o[2] for o in merged}))
        if len(thresholds) == 1:
            hulls: tuple[tuple[Opt, ...], ...] = (tuple(hull(merged)),)
        else:
            hulls = tuple(tuple(hull([o for o in merged if o[2] <= t])) for t in thresholds)
        classes.append(BlockClass(by_stage(idx, options), thresholds, hulls))
    return classes


def by_stage(idx: list[int], options: Sequence[Sequence[Option]]) -> tuple[int, ...]:
    """A class's blocks in the order modes are placed on them (:func:`rematd.planner.spread.place`): the
    first block of each pipeline stage, then the second of each, and so on; in block order on one stage.
    Modes placed first then go to the start of every stage alike, where the fewest kept bytes are held."""
    seen: dict[int, int] = {}
    ranked = []
    for i in idx:
        stage = options[i][0].stage
        rank = seen[stage] = seen.get(stage, -1) + 1
        ranked.append((rank, stage, i))
    return tuple(i for _rank, _stage, i in sorted(ranked))
