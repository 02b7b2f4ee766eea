"""A small GPT-style decoder for the demo, tests and benchmarks (no downloads)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Size of the tiny decoder."""

    vocab_size: int = 256
    """Tokens in the vocabulary (bytes, by default)."""
    max_seq_len: int = 1024
    """Longest sequence the position table covers."""
    n_layer: int = 4
    """Decoder blocks."""
    n_head: int = 4
    """Attention heads."""
    d_model: int = 64
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability inside the blocks."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    """Causal self-attention with an explicit (materialised) attention matrix."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.n_head)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        out: torch.Tensor = self.drop(self.proj(y))
        return out


class MLP(nn.Module):
    """The feed-forward part: 4x wide, GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.out(F.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """Pre-norm decoder block: attention (``attn``) and MLP (``mlp``), each behind a norm and a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyGPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks in ``self.h``, a language-model head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
