"""The DeepSpeed configs the DeepSpeed workers train with; the models are the FSDP workers' (stock ``transformers``
models from tiny configs, dropout on)."""

from __future__ import annotations

from typing import Any

from bench.zero3 import LIVE, RELEASED
from tests.workers.fsdp_exact import VOCAB, build

__all__ = ["VOCAB", "build", "ds_config"]


def ds_config(case: dict[str, Any]) -> dict[str, Any]:
    stage = case.get("stage", 3)
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(LIVE if case.get("live") else RELEASED)
    accumulation = case.get("accumulation", 1)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if case.get("bf16"):
        config["bf16"] = {"enabled": True}
    return config
