"""What ``torch.utils.checkpoint`` costs around a region beyond running the region again.

A checkpointed region pays the checkpoint's own work every step: in forward, a hook on each tensor the region
saves (which keeps a placeholder instead); in backward, the recomputation's set-up (the saved random state
restored, the hooks that catch what the rerun saves) and a hook again on each tensor as backward takes it.
None of it is an op of the region, so the profile's op timings do not hold it, and the steps' timing of a
rematerialisation (the region's forward run again) does not either. On a CPU it is a fixed share of a step
that weighs most on the smallest regions: about 0.25 ms a region and 25 us a tensor saved on the 2-core VM,
which made six recomputed MLPs look cheaper than two recomputed blocks while the steps found them dearer.

It is measured once per process on a chain of small linear layers, checkpointed and not, at two lengths
(so two counts of tensors saved), on a thread of its own: no saved-tensor hook, dispatch mode or autocast of
the training thread's sees it, and it draws nothing from the global random stream.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

WIDTH = 8
"""Features of the layers measured on: small enough that their ops cost next to nothing."""
LENGTHS = (1, 8)
"""Layers in the two chains measured: the difference gives the cost a tensor saved."""
CALLS = 10
"""Calls a timing averages over; the least of ``REPEATS`` timings counts (the others met a preemption)."""
REPEATS = 5
TIMEOUT = 10.0
"""Seconds the measurement may take before the cost is taken for nothing."""


@dataclass(frozen=True, slots=True)
class RegionCost:
    """The checkpoint's own work around a region: a fixed part and a part per tensor the region saves."""

    region_seconds: float = 0.0
    """Seconds a step, whatever the region saves."""
    saved_seconds: float = 0.0
    """Seconds a step per tensor the region's forward saves for backward."""

    def of(self, saved: int) -> float:
        """The seconds a region that saves ``saved`` tensors costs a step."""
        return self.region_seconds + self.saved_seconds * max(0, saved)


def _best(call: Callable[[], object]) -> float:
    for _ in range(3):
        call()
    timings = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        timings.append((time.perf_counter() - start) / CALLS)
    return min(timings)


def _extra(layers: int) -> tuple[int, float]:
    """(tensors saved, seconds the checkpoint adds over a plain forward and backward and the rerun forward) of a
    chain of ``layers`` linear layers."""
    weight = torch.full((WIDTH, WIDTH), 1.0 / WIDTH, requires_grad=True)
    bias = torch.zeros(WIDTH, requires_grad=True)
    x = torch.ones(2, WIDTH, requires_grad=True)

    def chain(h: torch.Tensor) -> torch.Tensor:
        for _ in range(layers):
            h = F.linear(h, weight, bias)
        return h

    saved = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        chain(x)
    plain = _best(lambda: chain(x).sum().backward())
    checkpointed = _best(lambda: checkpoint(chain, x, use_reentrant=False).sum().backward())
    rerun = _best(lambda: chain(x))
    return saved, checkpointed - plain - rerun


def _measure() -> RegionCost:
    (few, short), (many, long) = (_extra(n) for n in LENGTHS)
    per_saved = max(0.0, (long - short) / (many - few)) if many > few else 0.0
    return RegionCost(region_seconds=max(0.0, short - per_saved * few), saved_seconds=per_saved)


@functools.cache
def region_cost() -> RegionCost:
    """The checkpoint's own work around a region on this host, measured once per process (about 0.1 s on a CPU); nothing
    where it could not be measured: a price too low is what the steps correct, a failure here must not stop the
    profile."""
    found: list[RegionCost] = []

    def run() -> None:
        try:
            found.append(_measure())
        except Exception:  # a host that cannot run it prices no region cost
            return

    thread = threading.Thread(target=run, name="rematd-region-cost", daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    return found[0] if found else RegionCost()
