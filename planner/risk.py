"""The memory a step can really use, and the out-of-memory risk of a rank: 0 (none) to 1 (imminent)."""

from __future__ import annotations

from rematd.planner.steps import AllocatorFigures, StepObservation

GRAIN = 256
"""Capacity moves in steps of 1/GRAIN of the budget, so that jitter in the allocator's figures keeps
the same target (and the planner's caches warm)."""


def fragmented_bytes(obs: StepObservation, room: int | None = None) -> int:
    """Bytes the caching allocator holds in split blocks that serve only smaller requests: its inactive
    split bytes, no more than what it held beyond the allocations at the end of the step and at the peak
    (fragmentation can have cost the peak no more than that). 0 without the allocator's figures, and 0
    while the allocator was not short: with room to grow its reserve, split blocks cost no allocation
    anything. Counting them then would tighten the plan, which leaves more of the reserve idle (the
    allocator keeps it), more of it split, and so on with nothing ever loosening it again."""
    if not (obs.reserved_bytes and obs.inactive_split_bytes):
        return 0
    grain = max(1, min(obs.budget_bytes, room or obs.budget_bytes) // GRAIN)
    short = obs.alloc_retries > 0 or (room is not None and obs.peak_reserved_bytes + grain >= room)
    if not short:
        return 0
    lost = min(obs.inactive_split_bytes, max(0, obs.reserved_bytes - obs.allocated_bytes))
    if obs.peak_reserved_bytes:
        lost = min(lost, max(0, obs.peak_reserved_bytes - obs.peak_bytes))
    return lost


def device_room_bytes(obs: AllocatorFigures) -> int | None:
    """The most this process's allocator can hold: what it holds and what the device has free (0 free is
    a reading: the device is full). Memory neither free nor its own (another process, the CUDA context)
    is out of reach. None where the device's figures are not reported or do not add up."""
    if not (obs.total_bytes and obs.reserved_bytes):
        return None
    room = obs.free_bytes + obs.reserved_bytes
    return room if room <= obs.total_bytes else None


def usable_bytes(obs: StepObservation) -> int:
    """The budget the step's allocations can really reach: the budget, bounded by the device room, less
    the fragmented bytes; rounded down to 1/``GRAIN`` of the smaller of budget and room. The budget itself
    without the allocator's figures (the CPU, older clients)."""
    budget = obs.budget_bytes
    room = device_room_bytes(obs)
    lost = max(0, budget - room) if room is not None else 0
    lost += fragmented_bytes(obs, room)
    if not lost:
        return budget
    grain = max(1, min(budget, room if room is not None else budget) // GRAIN)
    return max(0, budget - -(-lost // grain) * grain)


def oom_risk(
    obs: StepObservation,
    *,
    predicted_next_bytes: int,
    capacity_bytes: int,
    margin_ratio: float,
    previous_peak_bytes: int = 0,
) -> float:
    """Combine how close the next step is predicted to run to capacity, what the allocator reports
    (retries) and the trend of the peak. ``capacity_bytes`` is the step's :func:`usable_bytes`: the
    fragmentation and the device's room are in it.

    The score reaches 1 at capacity and 0 below the target (capacity x (1 - margin)).
    """
    if capacity_bytes <= 0:
        return 1.0 if obs.budget_bytes > 0 else 0.0
    target = capacity_bytes * (1.0 - margin_ratio)
    band = max(capacity_bytes - target, 1.0)
    worst = max(predicted_next_bytes, obs.peak_bytes)
    trend = max(0, obs.peak_bytes - previous_peak_bytes) if previous_peak_bytes else 0
    pressure = (worst + trend - target) / band
    score = max(0.0, min(1.0, pressure)) + min(0.3, 0.1 * obs.alloc_retries)
    return max(0.0, min(1.0, score))
