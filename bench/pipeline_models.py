"""Stock ``transformers`` models split into pipeline stages, two ways.

- :func:`titan_stage`: torchtitan's way. The whole model keeps its layers in a ``ModuleDict`` keyed by layer id;
  each stage is a copy with the other stages' layers deleted, and the embedding, final norm and head set to
  ``None`` where the stage does not hold them. The layers are Llama's own ``LlamaDecoderLayer``.
- :func:`hand_stage`: split by hand. A stage module holds its slice of GPT-2's ``GPT2Block`` list, and the
  embeddings or the head when it is the first or the last.

Both forwards take what the stage before sends (the first: token ids) and return what the next needs (the
last: logits); :func:`loss_fn` is the schedule's loss.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import transformers
from torch import nn


def llama(layers: int, *, width: int = 32, vocab: int = 64, dropout: float = 0.1) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=dropout,
        max_position_embeddings=1024,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def gpt2(layers: int, *, width: int = 32, vocab: int = 64) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=width, n_layer=layers, n_head=4)
    return transformers.GPT2LMHeadModel(cfg)  # dropout 0.1 everywhere by default


class TitanLlama(nn.Module):
    """A Llama laid out as torchtitan lays out its models: ``tok_embeddings``, ``layers`` (a ``ModuleDict`` by
    layer id), ``norm``, ``output``; any of them ``None`` or missing on a pipeline stage."""

    def __init__(self, model: transformers.LlamaForCausalLM) -> None:
        super().__init__()
        inner = model.model
        self.tok_embeddings: nn.Module | None = inner.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers)})
        self.norm: nn.Module | None = inner.norm
        self.output: nn.Module | None = model.lm_head
        self.rotary = inner.rotary_emb

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary(h, positions)
        for layer in self.layers.values():
            h = layer(h, position_embeddings=rotary)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def _bounds(counts: Sequence[int], stage: int) -> range:
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def titan_stage(model: transformers.LlamaForCausalLM, stage: int, counts: Sequence[int]) -> TitanLlama:
    """Stage ``stage`` of ``model`` split into stages of ``counts`` layers, torchtitan's way: a copy with the
    other layers deleted."""
    whole = TitanLlama(copy.deepcopy(model))
    keep = {str(i) for i in _bounds(counts, stage)}
    for name in list(whole.layers.keys()):
        if name not in keep:
            del whole.layers[name]
    if stage > 0:
        whole.tok_embeddings = None
    if stage < len(counts) - 1:
        whole.norm = None
        whole.output = None
    return whole


class HandStage(nn.Module):
    """A slice of GPT-2's blocks, with the embeddings on the first stage and the head on the last."""

    def __init__(self, model: transformers.GPT2LMHeadModel, stage: int, counts: Sequence[int]) -> None:
        super().__init__()
        model = copy.deepcopy(model)
        inner = model.transformer
        self.first, self.last = stage == 0, stage == len(counts) - 1
        self.embed = nn.ModuleDict({"wte": inner.wte, "wpe": inner.wpe, "drop": inner.drop}) if self.first else None
        self.blocks = nn.ModuleList(inner.h[i] for i in _bounds(counts, stage))
        self.head = nn.ModuleDict({"ln_f": inner.ln_f, "lm_head": model.lm_head}) if self.last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            h = self.embed["drop"](self.embed["wte"](h) + self.embed["wpe"](positions))
        for block in self.blocks:
            h = block(h)
        if self.head is not None:
            h = self.head["lm_head"](self.head["ln_f"](h))
        return h


def hand_stage(model: transformers.GPT2LMHeadModel, stage: int, counts: Sequence[int]) -> HandStage:
    return HandStage(model, stage, counts)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
