"""A profile's costs at one input shape, prepared once and shared by every session over that profile."""

from __future__ import annotations

import threading
from collections import OrderedDict

from rematd.planner.cost import choose, peak_of
from rematd.planner.knapsack import Knapsack
from rematd.planner.model import Option, Profile
from rematd.planner.solvers import pool_seconds
from rematd.planner.units import Mode, Shape

Scales = tuple[tuple[Mode, float], ...]
"""(mode, measured / profiled seconds) for the modes whose measurements differ from the profile."""
Offsets = tuple[tuple[Mode, tuple[float, ...]], ...]
"""(mode, seconds a block of each position group adds beyond its per-block price) for the modes whose
step-level prices differ from the per-block ones (:mod:`rematd.planner.stepfit`); () for none."""

# Plans priced per shape before the memo starts over.
MAX_COSTS = 64
# Blocks' worth of prepared shapes kept in all (a block's options and knapsack take about 1 KiB).
MAX_CACHED_BLOCKS = 256 * 1024


class AtShape:
    """Every block's options at one shape (those of the allowed modes), the forward time,
    the activations saved outside the blocks, and the knapsack, built on first use."""

    __slots__ = ("_costs", "_knapsack", "_pooled", "forward_seconds", "options", "other_bytes", "profile")

    def __init__(
        self,
        profile: Profile,
        shape: Shape | None,
        allowed: frozenset[Mode] | None,
        scales: Scales = (),
        base: AtShape | None = None,
        prune: bool = False,
        offsets: Offsets = (),
    ) -> None:
        self.profile = profile
        if base is None:
            self.options: list[list[Option]] = profile.options_at(shape, allowed)
            self.forward_seconds = profile.forward_seconds_at(shape)
            self.other_bytes = profile.other_at(shape)
        else:
            # The measured seconds of each mode, over the profile's, and what the steps add per position
            # group: blocks alike (in the same group) share one list still.
            by_mode = dict(scales)
            added = dict(offsets)
            groups = max((len(v) for v in added.values()), default=1)
            # Groups are told apart (tagged) only where some mode's step-level price differs between them.
            tagged = any(len(set(v)) > 1 for v in added.values())
            n = len(base.options)
            rescaled: dict[tuple[int, int], list[Option]] = {}
            self.options = []
            for i, opts in enumerate(base.options):
                g = min(groups - 1, i * groups // n)
                key = (id(opts), g if tagged else 0)
                hit = rescaled.get(key)
                if hit is None:
                    hit = [
                        o.repriced(
                            o.scaled_seconds * by_mode.get(o.mode, 1.0)
                            + o.fixed
                            + (added[o.mode][g] if o.mode in added else 0),
                            key[1] if tagged else None,
                        )
                        for o in opts
                    ]
                    rescaled[key] = hit = _undominated(hit) if prune else hit
                self.options.append(hit)
            # Recomputing a block costs about its forward: that mode's scale applies to forward time too.
            self.forward_seconds = base.forward_seconds * by_mode.get(Mode.RECOMPUTE, 1.0)
            self.other_bytes = base.other_bytes
        self._knapsack: Knapsack | None = None
        self._pooled: list[list[Option]] | None = None
        self._costs: dict[tuple[Mode, ...], tuple[int, float]] = {}

    def cost(self, modes: tuple[Mode, ...]) -> tuple[int, float]:
        """Bytes of activations at the peak in backward order, less the activations outside the blocks
        (which callers add), and extra seconds of ``modes``; memoised, as a session prices the few
        plans of its table over and over."""
        hit = self._costs.get(modes)
        if hit is None:
            chosen = choose(self.options, modes)
            outside = self.other_bytes
            peak = peak_of(chosen, outside_bytes=outside, outside_in_backward=self.profile.other_in_backward)
            hit = (peak - outside, sum(o.seconds for o in chosen))
            if len(self._costs) >= MAX_COSTS:
                self._costs.clear()
            self._costs[modes] = hit
        return hit

    def pooled_seconds(self, modes: tuple[Mode, ...]) -> float:
        """Extra seconds of ``modes`` with each mode's seconds averaged over the blocks alike in bytes (and
        position group): what the solvers minimise, so that two placements of alike blocks compare as the
        solvers see them, not by the noise between their profiled seconds."""
        if self._pooled is None:
            self._pooled = pool_seconds(self.options)
        return sum(o.seconds for o in choose(self._pooled, modes))

    @property
    def knapsack(self) -> Knapsack:
        if self._knapsack is None:
            self._knapsack = Knapsack(self.options)
        return self._knapsack


def _undominated(opts: list[Option]) -> list[Option]:
    """``opts`` less the modes slower than recomputing the block while keeping as much or more: a
    plan never gains by them (what they save in the peak's transient, recomputing a block saves too)."""
    rec = next((o for o in opts if o.mode == Mode.RECOMPUTE), None)
    if rec is None:
        return opts
    keep = (Mode.STORE, Mode.RECOMPUTE)
    return [o for o in opts if o.mode in keep or not (o.seconds > rec.seconds and o.kept >= rec.kept)]


_CACHE: OrderedDict[tuple[int, Shape | None, frozenset[Mode] | None, Scales, Offsets, bool], AtShape] = OrderedDict()
_cached_blocks = 0
# Services plan hellos on worker threads while the event loop plans steps: the table is shared.
_LOCK = threading.Lock()


def at_shape(
    profile: Profile,
    shape: Shape | None,
    allowed: frozenset[Mode] | None = None,
    scales: Scales = (),
    *,
    prune: bool = False,
    offsets: Offsets = (),
) -> AtShape:
    """The prepared costs of ``profile`` at ``shape`` (its own when None), each mode's seconds times
    its scale in ``scales``, plus what ``offsets`` adds per position group; least recently used evicted.
    ``prune`` drops each block's modes that are slower than recomputing it while freeing less (for
    solving; pricing a plan needs every mode).

    Sessions ask for few shapes, often; sessions of one model share the profile object and so the
    entries.
    """
    global _cached_blocks
    if shape == profile.shape:
        shape = None
    key = (id(profile), shape, allowed, scales, offsets, prune)
    with _LOCK:
        hit = _CACHE.get(key)
        # The identity check guards against a dead profile's id being reused.
        if hit is not None and hit.profile is profile:
            _CACHE.move_to_end(key)
            return hit
    if prune:
        priced = at_shape(profile, shape, allowed, scales, offsets=offsets)
        entry = AtShape(profile, shape, allowed, (), priced, prune=True)
    else:
        base = at_shape(profile, shape, allowed) if scales or offsets else None
        entry = AtShape(profile, shape, allowed, scales, base, offsets=offsets)
    with _LOCK:
        old = _CACHE.pop(key, None)
        if old is not None:
            _cached_blocks -= old.profile.num_blocks
        _CACHE[key] = entry
        _cached_blocks += profile.num_blocks
        while _cached_blocks > MAX_CACHED_BLOCKS and len(_CACHE) > 1:
            _, evicted = _CACHE.popitem(last=False)
            _cached_blocks -= evicted.profile.num_blocks
    return entry


def forget(profile: Profile) -> None:
    """Drop what was prepared for ``profile``: no session uses it any more."""
    global _cached_blocks
    with _LOCK:
        for key in [k for k, v in _CACHE.items() if v.profile is profile]:
            _cached_blocks -= _CACHE.pop(key).profile.num_blocks
