"""ZeRO-3 parameter settings that make a tiny model's all-gathers countable: the DeepSpeed benchmark trains under
both, and the DeepSpeed tests under one or the other."""

from __future__ import annotations

RELEASED = {
    "stage3_param_persistence_threshold": 0,
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
}
"""ZeRO-3 releasing every parameter after each use: every use is a gather, so the gathers count uses."""

LIVE = {"stage3_param_persistence_threshold": 0}
"""ZeRO-3 as configured by default (prefetching along its trace, parameters reused while in reach) except that
no parameter is persistent: a tiny model's would all be, and nothing would be gathered at all."""
