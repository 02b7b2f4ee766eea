"""What ``torch.utils.checkpoint`` costs around a region beyond what the steps time of it.

A checkpointed region pays the checkpoint's own work every step: in forward, a hook on each tensor the region
saves (which keeps a placeholder instead); in backward, the recomputation's set-up and a hook again on each
tensor as backward takes it. None of it is an op of the region, so the profile's op timings do not hold it,
and the steps' timing of a rematerialisation (the region's forward run again inside the checkpoint) holds only
the hooks that run during the rerun. On a CPU it is a fixed share of a step that weighs most on the smallest
regions: about 0.3 ms a region and 25-45 us a tensor saved on the 2-core VM, which made six recomputed MLPs
look cheaper than two recomputed blocks while the steps found them dearer.

It is measured once per process on a chain of small linear layers, checkpointed and not, at two lengths (so
two counts of tensors saved), its rerun timed inside the checkpoint as the client times a rematerialisation,
and its forward apart: an op policy's timed forward already holds the forward's hooks. It runs on a thread of
its own (no saved-tensor hook, dispatch mode or autocast of the training thread's sees it), without saving or
restoring the random state (it neither reads nor writes the global random stream), and stops between
timings once its time is up.
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


class _Stopped(Exception):
    """The measurement's time is up."""


@dataclass(frozen=True, slots=True)
class RegionCost:
    """The checkpoint's own work around a region: a fixed part and a part per tensor the region saves, of which
    the share paid in forward."""

    region_seconds: float = 0.0
    """Seconds a step, whatever the region saves."""
    saved_seconds: float = 0.0
    """Seconds a step per tensor the region's forward saves for backward."""
    forward_share: float = 0.0
    """Of it, the fraction paid in forward (the hooks that keep placeholders), within [0, 1]."""

    def of(self, saved: int, *, backward_only: bool = False) -> float:
        """The seconds a region that saves ``saved`` tensors costs a step (``backward_only``: its backward's)."""
        whole = self.region_seconds + self.saved_seconds * max(0, saved)
        return whole * (1.0 - self.forward_share) if backward_only else whole


def _best(call: Callable[[], float | None], stop: threading.Event) -> float:
    """The least, over ``REPEATS``, of the mean seconds of ``CALLS`` calls, less what the calls say to leave out."""
    for _ in range(3):
        call()
    timings = []
    for _ in range(REPEATS):
        if stop.is_set():
            raise _Stopped
        start = time.perf_counter()
        left_out = sum(call() or 0.0 for _ in range(CALLS))
        timings.append((time.perf_counter() - start - left_out) / CALLS)
    return min(timings)


def _extra(layers: int, stop: threading.Event) -> tuple[int, float, float]:
    """(tensors saved, seconds the checkpoint adds to a forward and backward of a chain of ``layers`` linear
    layers beyond its rerun timed inside it, of which in forward)."""
    weight = torch.full((WIDTH, WIDTH), 1.0 / WIDTH, requires_grad=True)
    bias = torch.zeros(WIDTH, requires_grad=True)
    x = torch.ones(2, WIDTH, requires_grad=True)
    rerun = [0.0]
    calls = [0]

    def chain(h: torch.Tensor) -> torch.Tensor:
        for _ in range(layers):
            h = F.linear(h, weight, bias)
        return h

    def timed(h: torch.Tensor) -> torch.Tensor:
        # The checkpoint calls it twice a step: in forward, then in backward to rerun it, which the client times.
        calls[0] += 1
        if calls[0] % 2:
            return chain(h)
        start = time.perf_counter()
        try:
            return chain(h)
        finally:
            rerun[0] += time.perf_counter() - start

    def checkpointed() -> float:
        rerun[0] = 0.0
        checkpoint(timed, x, use_reentrant=False, preserve_rng_state=False).sum().backward()
        return rerun[0]

    saved = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        chain(x)

    def forward_only() -> None:
        checkpoint(chain, x, use_reentrant=False, preserve_rng_state=False)

    def plain_forward() -> None:
        chain(x)

    plain = _best(lambda: chain(x).sum().backward(), stop)
    whole = _best(checkpointed, stop) - plain
    forward = _best(forward_only, stop) - _best(plain_forward, stop)
    return saved, whole, forward


def _measure(stop: threading.Event) -> RegionCost:
    (few, short, ahead), (many, long, forward) = (_extra(n, stop) for n in LENGTHS)
    per_saved = max(0.0, (long - short) / (many - few)) if many > few else 0.0
    # Over both chains: the forward's part is a small difference of two timings, the noisiest figure here.
    share = min(1.0, max(0.0, (ahead + forward) / (short + long))) if short + long > 0 else 0.0
    return RegionCost(region_seconds=max(0.0, short - per_saved * few), saved_seconds=per_saved, forward_share=share)


@functools.cache
def region_cost() -> RegionCost:
    """The checkpoint's own work around a region on this host, measured once per process (about 0.2 s on a
    CPU); nothing where it could not be measured in ``TIMEOUT``: a price too low is what the steps correct, and
    a failure here must not stop the profile."""
    found: list[RegionCost] = []
    stop = threading.Event()

    def run() -> None:
        try:
            found.append(_measure(stop))
        except Exception:  # a host that cannot run it (or ran out of time) prices no region cost
            return

    thread = threading.Thread(target=run, name="rematd-region-cost", daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    stop.set()
    return found[0] if found else RegionCost()
