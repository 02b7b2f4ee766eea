"""The out-of-memory risk score of a rank: 0 (none) to 1 (imminent)."""

from __future__ import annotations

from rematd.planner.model import StepObservation


def oom_risk(
    obs: StepObservation,
    *,
    predicted_next_bytes: int,
    capacity_bytes: int,
    margin_ratio: float,
    previous_peak_bytes: int = 0,
) -> float:
    """Combine how close the next step is predicted to run to capacity, what the
    allocator reports (retries, fragmentation) and the trend of the peak.

    The score reaches 1 at capacity and 0 below the target (capacity x (1 - margin)).
    """
    if capacity_bytes <= 0:
        return 0.0
    target = capacity_bytes * (1.0 - margin_ratio)
    band = max(capacity_bytes - target, 1.0)
    worst = max(predicted_next_bytes, obs.peak_bytes)
    trend = max(0, obs.peak_bytes - previous_peak_bytes) if previous_peak_bytes else 0
    pressure = (worst + trend - target) / band
    fragmentation = 0.0
    if obs.reserved_bytes > obs.allocated_bytes > 0:
        # Memory the allocator holds but cannot hand out counts against headroom.
        fragmentation = (obs.reserved_bytes - obs.allocated_bytes) / capacity_bytes
    score = max(0.0, min(1.0, pressure)) + min(0.3, 0.1 * obs.alloc_retries) + min(0.2, fragmentation)
    return max(0.0, min(1.0, score))
