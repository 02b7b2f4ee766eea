"""The cost model: predicted peak memory and recompute overhead of a plan."""

from __future__ import annotations

from collections.abc import Collection

from rematd.planner.model import Profile

# Backward costs about twice the forward, so a step is about three forwards.
_STEP_FORWARDS = 3.0


def predict_peak_bytes(profile: Profile, recompute: Collection[int], *, static_bytes: int = 0) -> int:
    """Predicted peak: static memory, stored activations, kept inputs, and the
    largest block materialised again while it is recomputed in backward."""
    stored = 0
    transient = 0
    for i, block in enumerate(profile.blocks):
        if i in recompute:
            stored += block.input_bytes
            transient = max(transient, block.saved_bytes)
        else:
            stored += block.saved_bytes
    return static_bytes + stored + transient


def predict_overhead_ratio(profile: Profile, recompute: Collection[int]) -> float:
    """Extra step time from recomputation, as a fraction of a step without it."""
    total = sum(b.forward_seconds for b in profile.blocks)
    if total <= 0:
        return len(recompute) / (_STEP_FORWARDS * profile.num_blocks)
    extra = sum(profile.blocks[i].forward_seconds for i in recompute)
    return extra / (_STEP_FORWARDS * total)
