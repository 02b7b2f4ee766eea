"""The mode-per-block knapsack, prepared once and solved for many targets.

The predicted peak is static + sum(kept) + max(transient): additive but for
the one largest rematerialisation (kept counts every microbatch alive at once,
``Option.kept + Option.others``). Capping the transient at ``c`` leaves a
multiple-choice knapsack: each block picks one of its options whose
transient is at most ``c``, kept bytes within ``target - static - c``, least
extra seconds. Its linear relaxation is solved greedily: every block starts
at its cheapest option and moves down the lower convex hull of its
(kept, seconds) points, segments taken in order of seconds per freed byte
across all blocks. The bytes still missing after the last whole segment come
from the cheapest single move: that segment rounded up to whole blocks, or a
later one open where its class stands. The plan costs at most one segment of
one class of identical blocks more than the relaxation.

Preparing does what does not depend on the target: classes of identical
blocks, each class's hull for every cap at which its choice widens
(:mod:`rematd.planner.hulls`), every segment sorted once by slope, and per cap the bytes and seconds of the
cheapest and of the leanest choice. A solve then costs a few scans of the
sorted segments. The relaxation with every option allowed bounds every cap
from below and only grows with the cap, which prunes the caps above the
best; at the smallest cap its own choice fits under, it is tight. With many
distinct caps (blocks of many sizes) the search scans a window of caps below
that one and a coarse sweep of the rest, refined where it finds better: on
random profiles of 40-150 unlike blocks it finds what scanning every cap
finds at over 99% of budgets, and is within a few per cent at the others.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

from rematd.planner.hulls import INF, Opt, classes_of
from rematd.planner.model import Option
from rematd.planner.runs import RUN, Runs
from rematd.planner.spread import place
from rematd.planner.units import Mode

__all__ = ["INF", "Knapsack", "Solution"]

# Up to this many feasible caps, every one is a candidate.
SCAN_ALL_CAPS = 24
# Caps sampled per round of the coarse-to-fine search.
CAPS_PER_ROUND = 6
# Caps scanned one by one below the search's starting point.
WINDOW = 8
# Segments past the relaxation's last one considered for the rest of the bytes.
LOOKAHEAD = 32


# A hull segment: (seconds per freed byte, bytes freed per block, seconds added per block,
# blocks in the class, lowest cap it holds at, cap it stops holding at, class, vertex it leaves,
# its place in slope order, the place of the segment before it on the class's hull or -1).
_Segment = tuple[float, int, float, int, int, float, int, int, int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Solution:
    """One mode per block, with what the choice costs."""

    modes: tuple[Mode, ...]
    seconds: float
    """Extra seconds (seconds averaged over each class of identical blocks)."""
    kept: int
    """Bytes kept from forward to backward."""
    transient: int
    """The largest rematerialisation."""


class Knapsack:
    """Every block's options, prepared for solving at any budget."""

    def __init__(self, options: Sequence[Sequence[Option]]) -> None:
        if not options:
            raise ValueError("the knapsack needs at least one block")
        self.num_blocks = len(options)
        classes = classes_of(options)
        self._classes = classes
        self._hulls: dict[int, list[tuple[Opt, ...]]] = {}
        self.alike = tuple(c.blocks for c in classes if len(c.blocks) > 1)
        """The classes of two blocks or more: the blocks alike in bytes (the solvers arrange modes within them)."""
        # Below the largest of the classes' smallest transients some class has no option at all.
        start = max(c.thresholds[0] for c in classes)
        self.caps = sorted({t for c in classes for t in c.thresholds if t >= start})
        self._per_cap(start)
        self._sort_segments(start)

    def _per_cap(self, start: int) -> None:
        """Per cap: kept bytes and seconds with every block at its cheapest option, kept at its leanest."""
        base_kept = lean = 0
        base_secs = 0.0
        events: list[tuple[int, int, int]] = []
        for ci, c in enumerate(self._classes):
            j0 = c.state(start)
            w = len(c.blocks)
            h = c.hulls[j0]
            base_kept += w * h[0][0]
            base_secs += w * h[0][1]
            lean += w * h[-1][0]
            events.extend((c.thresholds[j], ci, j) for j in range(j0 + 1, len(c.thresholds)))
        events.sort()
        self._base_kept: list[int] = []
        self._base_secs: list[float] = []
        self._lean: list[int] = []
        e = 0
        for cap in self.caps:
            while e < len(events) and events[e][0] <= cap:
                _, ci, j = events[e]
                c = self._classes[ci]
                w = len(c.blocks)
                old, new = c.hulls[j - 1], c.hulls[j]
                base_kept += w * (new[0][0] - old[0][0])
                base_secs += w * (new[0][1] - old[0][1])
                lean += w * (new[-1][0] - old[-1][0])
                e += 1
            self._base_kept.append(base_kept)
            self._base_secs.append(base_secs)
            self._lean.append(lean)

    def _sort_segments(self, start: int) -> None:
        segments: list[_Segment] = []
        reach = 0  # the largest transient of the cheapest choice with every option allowed
        for ci, c in enumerate(self._classes):
            w = len(c.blocks)
            last = len(c.thresholds) - 1
            reach = max(reach, c.hulls[last][0][2])
            for j in range(c.state(start), last + 1):
                lo = max(c.thresholds[j], start)
                hi = c.thresholds[j + 1] if j < last else INF
                h = c.hulls[j]
                for v in range(len(h) - 1):
                    freed = h[v][0] - h[v + 1][0]
                    added = h[v + 1][1] - h[v][1]
                    segments.append((added / freed, freed, added, w, lo, hi, ci, v, 0, -1))
        segments.sort()
        # Each segment learns its place and that of the segment before it on its class's hull
        # (-1 at the hull's start), so a scan tells which later segments start where a class stands.
        place = {(s[6], s[4], s[7]): i for i, s in enumerate(segments)}
        self._segments = [(*s[:8], i, place.get((s[6], s[4], s[7] - 1), -1)) for i, s in enumerate(segments)]
        segments = self._segments
        self._runs = Runs([(s[1], s[3], s[2], s[4], s[5]) for s in segments])
        # The relaxation with every option allowed: prefix sums over the last states' segments,
        # and the largest transient its choice reaches.
        self._final_slopes: list[float] = []
        self._final_freed: list[int] = []
        self._final_secs: list[float] = []
        self._final_reach: list[int] = []
        freed_sum, secs_sum = 0, 0.0
        for slope, freed, added, w, _lo, hi, ci, v, _i, _prev in segments:
            if hi == INF:
                freed_sum += freed * w
                secs_sum += added * w
                c = self._classes[ci]
                reach = max(reach, c.hulls[-1][v + 1][2])
                self._final_slopes.append(slope)
                self._final_freed.append(freed_sum)
                self._final_secs.append(secs_sum)
                self._final_reach.append(reach)
        self._base_reach = max(c.hulls[-1][0][2] for c in self._classes)

    def _relaxed(self, budget: int) -> tuple[float, int]:
        """The relaxation with every option allowed at ``budget``: its extra seconds (a lower bound
        for every cap; INF when even the leanest choice is over) and the largest transient it reaches."""
        need = self._base_kept[-1] - budget
        if need <= 0:
            return self._base_secs[-1], self._base_reach
        i = bisect_left(self._final_freed, need)
        if i == len(self._final_freed):
            return INF, self._final_reach[-1] if self._final_reach else self._base_reach
        before_freed = self._final_freed[i - 1] if i else 0
        before_secs = self._final_secs[i - 1] if i else 0.0
        return self._base_secs[-1] + before_secs + (need - before_freed) * self._final_slopes[i], self._final_reach[i]

    def bound(self, budget: int) -> float:
        """A lower bound on the extra seconds of any choice whose kept bytes fit ``budget``
        under any cap; INF when none can."""
        return self._relaxed(budget)[0]

    def least_peak(self) -> tuple[int, int]:
        """The least kept bytes + largest transient of any choice, and the cap index that gives it."""
        return min((cap + lean, j) for j, (cap, lean) in enumerate(zip(self.caps, self._lean, strict=True)))

    def leanest(self, j: int) -> tuple[Mode, ...]:
        """Every block at its leanest option under cap index ``j``."""
        modes = [Mode.STORE] * self.num_blocks
        for c in self._classes:
            mode = c.hulls[c.state(self.caps[j])][-1][3]
            for i in c.blocks:
                modes[i] = mode
        return tuple(modes)

    def feasible(self, budget: int) -> list[int]:
        """The cap indices under which some choice fits ``budget`` (its leanest choice there does)."""
        caps = self.caps
        return [j for j in range(bisect_right(caps, budget)) if self._lean[j] + caps[j] <= budget]

    def greedy(self, j: int, budget: int) -> float:
        """The rounded greedy's extra seconds at cap index ``j`` with kept bytes within ``budget`` (the cap's
        own bytes already taken off); INF where it falls short. What :meth:`solve` takes the least of."""
        return self._scan(j, budget)

    def _scan(self, j: int, budget: int, record: list[list[int]] | None = None) -> float:
        """The rounded greedy's extra seconds at cap index ``j``; with ``record``, the number of
        blocks of each class at each hull vertex.

        The segments up to the one the relaxation takes part of are taken whole; the rest of the
        bytes come from whichever next move is cheapest: that segment rounded up, or one of the
        following ``LOOKAHEAD`` open segments that starts where its class stands.
        """
        cap = self.caps[j]
        need = self._base_kept[j] - budget
        secs = self._base_secs[j]
        if need <= 0:
            return secs
        found = self._whole(cap, need, secs)
        if found is None:
            return INF
        need, secs, seg = found
        freed, added, at = seg[1], seg[2], seg[8]
        k = -(-need // freed)
        best, pick = k * added, at
        looked = 0
        for _slope, freed2, added2, w2, lo2, hi2, _ci2, _v2, at2, prev2 in islice(self._segments, at + 1, None):
            if lo2 <= cap < hi2:
                # Open only where the segment before it on its hull was taken whole.
                if prev2 < at:
                    k2 = -(-need // freed2)
                    if k2 <= w2 and k2 * added2 < best:
                        best, pick, k = k2 * added2, at2, k2
                looked += 1
                if looked >= LOOKAHEAD:
                    break
        if record is not None:
            for _slope, _freed, _added, w, lo, hi, ci, v, _at, _prev in self._segments[:at]:
                if lo <= cap < hi:
                    record[ci][v] -= w
                    record[ci][v + 1] += w
            ci, v = self._segments[pick][6], self._segments[pick][7]
            record[ci][v] -= k
            record[ci][v + 1] += k
        return secs + best

    def _whole(self, cap: int, need: int, secs: float) -> tuple[int, float, _Segment] | None:
        """The segments taken whole at ``cap`` before ``need`` bytes are freed: the bytes still needed,
        the seconds with them, and the segment that meets the need; None when all of them fall short.
        Whole runs of segments are skipped on their sums."""
        runs, segments = self._runs, self._segments
        for r in range(len(runs)):
            freed, added = runs.at(r, cap)
            if freed < need:
                need -= freed
                secs += added
                continue
            for seg in islice(segments, r * RUN, (r + 1) * RUN):
                if seg[4] <= cap < seg[5]:
                    if seg[1] * seg[3] >= need:
                        return need, secs, seg
                    need -= seg[1] * seg[3]
                    secs += seg[2] * seg[3]
        return None

    def solve(self, budget: int) -> Solution | None:
        """The least extra seconds with kept bytes + the largest transient within ``budget``;
        None when no choice fits."""
        caps = self.caps
        feasible = self.feasible(budget)
        if not feasible:
            return None
        value: dict[int, float] = {}
        best = INF

        def visit(p: int) -> None:
            nonlocal best
            j = feasible[p]
            if j in value:
                return
            bound, _ = self._relaxed(budget - caps[j])
            # A cap whose bound cannot beat the best is not scanned.
            value[j] = INF if bound >= best - 1e-12 else self._scan(j, budget - caps[j])
            best = min(best, value[j])

        if len(feasible) <= SCAN_ALL_CAPS:
            for p in range(len(feasible)):
                visit(p)
        else:
            self._search(feasible, budget, visit, value)
        j = min(value, key=lambda j: (value[j], j))
        if value[j] == INF:
            return None
        return self._modes(j, budget - caps[j])

    def _search(self, feasible: list[int], budget: int, visit: Callable[[int], None], value: dict[int, float]) -> None:
        """Caps near the smallest one the unrestricted relaxation's own choice fits under (where the
        bound turns tight and the cost, falling with the cap until there, levels off), every one in
        a window below it; then a coarse sweep of the rest, refined around any cap that beats them."""
        caps = self.caps
        lo, hi = 0, len(feasible) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            j = feasible[mid]
            if self._relaxed(budget - caps[j])[1] <= caps[j]:
                hi = mid
            else:
                lo = mid + 1
        seed = lo
        for p in range(min(len(feasible) - 1, seed + 2), max(-1, seed - WINDOW - 1), -1):
            visit(p)
        lo, hi = 0, max(0, seed - WINDOW - 1)
        while True:
            if hi - lo + 1 <= CAPS_PER_ROUND:
                for p in range(lo, hi + 1):
                    visit(p)
                return
            step = (hi - lo) / (CAPS_PER_ROUND - 1)
            picks = [lo + round(k * step) for k in range(CAPS_PER_ROUND)]
            for p in picks:
                visit(p)
            here = min(picks, key=lambda p: value[feasible[p]])
            if value[feasible[here]] > min(value.values()):
                return  # nothing out here beats the window
            i = picks.index(here)
            lo, hi = picks[max(0, i - 1)], picks[min(len(picks) - 1, i + 1)]

    def _hulls_at(self, cap: int) -> list[tuple[Opt, ...]]:
        """Each class's hull under ``cap``; the last few kept (a solve's widenings come back to the same caps)."""
        hit = self._hulls.get(cap)
        if hit is None:
            if len(self._hulls) >= 8:
                self._hulls.clear()
            hit = self._hulls[cap] = [c.hulls[c.state(cap)] if len(c.hulls) > 1 else c.hulls[0] for c in self._classes]
        return hit

    def _modes(self, j: int, budget: int) -> Solution:
        cap = self.caps[j]
        hulls = self._hulls_at(cap)
        counts = [[len(c.blocks)] + [0] * (len(h) - 1) for c, h in zip(self._classes, hulls, strict=True)]
        secs = self._scan(j, budget, record=counts)
        modes = [Mode.STORE] * self.num_blocks
        kept = transient = 0
        for c, h, cnt in zip(self._classes, hulls, counts, strict=True):
            if len(c.blocks) == 1:
                o = h[cnt.index(1)]
                modes[c.blocks[0]] = o[3]
                kept += o[0]
                transient = max(transient, o[2])
                continue
            for v in place(c.blocks, cnt, h, modes):
                kept += cnt[v] * h[v][0]
                transient = max(transient, h[v][2])
        return Solution(modes=tuple(modes), seconds=secs, kept=kept, transient=transient)
