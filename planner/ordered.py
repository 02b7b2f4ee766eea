"""The exact optimum under the peak in backward order, for small models.

A block that rematerialises does so while the blocks before it still hold what
they kept and the blocks after it have released theirs
(:func:`rematd.planner.cost.peak_of`). So the peak depends on where each mode
sits, not only on how many blocks take it. The programme walks the blocks in
order keeping, per partial plan, the bytes kept so far, the worst moment of
backward so far and the seconds; a partial plan is dropped when another keeps
no more, peaks no higher and costs no more. Bounded: past ``MAX_STATES`` live
partial plans it gives up and the caller falls back on the knapsack's bound.
"""

from __future__ import annotations

from operator import itemgetter

from rematd.planner.cost import NO_MOMENT
from rematd.planner.model import Option
from rematd.planner.units import Mode

MAX_STATES = 20_000
"""Partial plans kept at once before the programme gives up (blocks of many unlike sizes)."""

# A partial plan: (bytes kept so far, worst moment of backward so far in the current pipeline stage, seconds,
# modes, bytes the other microbatches alive at once keep so far: held at every moment, so added to each, and the
# worst moment of the stages before, less what was kept when it ended: every byte kept after it adds to it).
_State = tuple[int, int, float, tuple[Mode, ...], int, int]


_ORDER = itemgetter(0, 1, 2, 4, 5)
"""States sorted by bytes kept, then worst moment, seconds, other microbatches' bytes and the stages before."""


class TooManyStates(Exception):
    """The programme grew past :data:`MAX_STATES` partial plans."""


def exact_ordered(options: list[list[Option]], kept_budget: int, moment_budget: int) -> list[Mode] | None:
    """The least extra seconds with every kept byte within ``kept_budget`` and every moment of backward
    (kept bytes still held plus a block's rematerialisation) within ``moment_budget``; among equal
    seconds, the fewest blocks not stored, then the lowest peak. None when nothing fits;
    :class:`TooManyStates` past :data:`MAX_STATES` partial plans. What the other microbatches alive at
    once keep (``Option.others``, on a pipeline stage) counts against both budgets."""
    states: list[_State] = [(0, 0, 0.0, (), 0, NO_MOMENT)]
    stage = options[0][0].stage if options and options[0] else 0
    for opts in options:
        if opts and opts[0].stage != stage:
            # A new pipeline stage of the rank: the moments of the one before now hold what comes after it.
            stage = opts[0].stage
            states = [(k, 0, t, m, e, max(d, w - k) if w else d) for k, w, t, m, e, d in states]
        # Plain tuples and comparisons, not attribute reads and max(): this loop is most of a solve.
        plain = [(o.kept, o.others, o.transient, o.seconds, o.mode) for o in opts]
        grown: list[_State] = []
        for kept, worst, secs, modes, others, done in states:
            for o_kept, o_others, transient, seconds, mode in plain:
                k, e = kept + o_kept, others + o_others
                if k + e > kept_budget:
                    continue
                w = worst
                if transient and k + transient > w:
                    w = k + transient
                top = k + done if k + done > w else w
                if top + e > moment_budget:
                    continue
                grown.append((k, w, secs + seconds, (*modes, mode), e, done))
        if not grown:
            return None
        states = _pareto(grown)
        if len(states) > MAX_STATES:
            raise TooManyStates(f"more than {MAX_STATES} partial plans")
    # The least seconds; among those, the fewest blocks not stored, then the lowest peak.
    least = min(round(s[2], 12) for s in states)
    tied = [s for s in states if round(s[2], 12) == least]
    best = min(tied, key=lambda s: (sum(m != Mode.STORE for m in s[3]), s[4] + max(s[0], s[1])))
    return list(best[3])


def _pareto(states: list[_State]) -> list[_State]:
    """``states`` less those another keeps no more than, peaks no higher than (in this stage and the ones
    before), costs no more than and whose other microbatches keep no more than."""
    states.sort(key=_ORDER)
    first = states[0]
    if all(s[4] == first[4] and s[5] == first[5] for s in states):
        return _pareto_2d(states)
    front: list[tuple[int, float, int, int]] = []
    out: list[_State] = []
    for state in states:
        kept, worst, secs, _modes, others, done = state
        before = kept + done
        # Every state in ``front`` keeps no more (sorted by kept): dominated if one peaks and costs no more.
        if any(w <= worst and s <= secs + 1e-15 and e <= others and b <= before for w, s, e, b in front):
            continue
        front.append((worst, secs, others, before))
        out.append(state)
    return out


def _pareto_2d(states: list[_State]) -> list[_State]:
    """:func:`_pareto` where every state's other microbatches keep alike and the stages before peaked alike
    (no pipeline stage before this one): sorted by bytes kept, a state is dominated where one before it
    peaks and costs no more. The least seconds among the states before, per worst moment, in a Fenwick
    tree over the worst moments: n log n where the pairwise test is quadratic (a look for a plan trial
    solves a few dozen times)."""
    worsts = sorted({s[1] for s in states})
    rank = {w: i + 1 for i, w in enumerate(worsts)}
    size = len(worsts)
    tree = [float("inf")] * (size + 1)
    out: list[_State] = []
    for state in states:
        i = rank[state[1]]
        # The least seconds of the states kept so far whose worst moment is no higher.
        least, j = float("inf"), i
        while j > 0:
            if tree[j] < least:
                least = tree[j]
            j -= j & -j
        if least <= state[2] + 1e-15:
            continue
        out.append(state)
        while i <= size:
            if state[2] < tree[i]:
                tree[i] = state[2]
            i += i & -i
    return out
