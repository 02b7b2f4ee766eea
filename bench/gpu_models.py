"""bench/gpu.py's models and jobs: Hugging Face configs with random weights, and what one worker runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model of the benchmark and its workload."""

    name: str
    kind: str
    """``gpt2`` or ``llama``."""
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    batch: int
    seq: int
    max_seq: int
    ffn: int = 0
    """Llama's intermediate size (0: 8/3 of d_model, rounded to 64)."""
    dropout: float = 0.0


FULL_MODELS = (
    ModelSpec(
        name="gpt2-24x1024",
        kind="gpt2",
        n_layer=24,
        d_model=1024,
        n_head=16,
        vocab=50257,
        batch=8,
        seq=1024,
        max_seq=2048,
        dropout=0.1,
    ),
    ModelSpec(
        name="llama-16x2048",
        kind="llama",
        n_layer=16,
        d_model=2048,
        n_head=16,
        vocab=32000,
        batch=4,
        seq=1024,
        max_seq=2048,
        ffn=5504,
    ),
)
QUICK_MODELS = (
    ModelSpec(name="gpt2-tiny", kind="gpt2", n_layer=4, d_model=64, n_head=4, vocab=256, batch=2, seq=24, max_seq=32),
    ModelSpec(name="llama-tiny", kind="llama", n_layer=4, d_model=64, n_head=4, vocab=256, batch=2, seq=24, max_seq=32),
)


def _import_transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    return transformers


def build(spec: ModelSpec, device: torch.device, seed: int = 0) -> nn.Module:
    tf = _import_transformers()
    torch.manual_seed(seed)
    if spec.kind == "gpt2":
        cfg = tf.GPT2Config(
            n_layer=spec.n_layer,
            n_embd=spec.d_model,
            n_head=spec.n_head,
            vocab_size=spec.vocab,
            n_positions=spec.max_seq,
            resid_pdrop=spec.dropout,
            embd_pdrop=spec.dropout,
            attn_pdrop=spec.dropout,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = tf.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    elif spec.kind == "llama":
        ffn = spec.ffn or 64 * round(spec.d_model * 8 / 3 / 64)
        cfg = tf.LlamaConfig(
            hidden_size=spec.d_model,
            intermediate_size=ffn,
            num_hidden_layers=spec.n_layer,
            num_attention_heads=spec.n_head,
            num_key_value_heads=spec.n_head,
            vocab_size=spec.vocab,
            max_position_embeddings=spec.max_seq,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    else:
        raise ValueError(f"model kind must be gpt2 or llama, got {spec.kind!r}")
    return model.to(device).train()  # type: ignore[no-any-return]


def block_list(model: nn.Module) -> nn.ModuleList:
    """The model's own list of blocks (GPT-2's ``transformer.h``, Llama's ``model.layers``): a block set in
    it replaces the one the model runs."""
    inner = getattr(model, "transformer", None) or getattr(model, "model", None)
    found = getattr(inner, "h", None) or getattr(inner, "layers", None)
    if not isinstance(found, nn.ModuleList):
        raise ValueError(f"no block list in {type(model).__name__}")
    return found


def layers(model: nn.Module) -> list[nn.Module]:
    return list(block_list(model))


@dataclass(slots=True, kw_only=True)
class Job:
    """One strategy on one model: what a worker process runs."""

    model: ModelSpec
    strategy: str
    steps: int
    warmup: int
    budget_bytes: int = 0
    """rematd's budget (0: none)."""
    budget_frac: float = 0.0
    """Where ``budget_bytes`` is 0 and this is not: on the CPU, this fraction of the bytes a step storing every
    block saves for backward."""
    margin: float = 0.1
    modes: list[str] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    """Per measured step, a sequence length (the adaptive scenario); empty: the model's own, every step."""
    memory_fraction: float = 0.0
    """Enforce this fraction of device memory (CUDA); 0: not enforced."""
