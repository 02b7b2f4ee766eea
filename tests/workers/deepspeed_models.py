"""The models and DeepSpeed configs the DeepSpeed workers train: stock ``transformers`` models from tiny configs."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

VOCAB = 64


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        cfg: Any = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_dropout=0.1,
            max_position_embeddings=64,
            use_cache=False,
        )
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4, use_cache=False
    )  # dropout 0.1 everywhere by default
    return transformers.GPT2LMHeadModel(cfg)


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
