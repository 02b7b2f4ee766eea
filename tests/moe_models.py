"""A tiny mixture-of-experts language model whose experts receive the rows its router sends them, as one rank's
experts do under expert parallel: of ``experts`` experts the first ``local`` are this rank's, and only the tokens
routed to them reach its expert bank (the others leave through a cheap path, standing in for the all-to-all to
another rank). A router skewed towards expert 0 (``skew(0)``) sends the bank every token; towards one of another
rank's (``skew(7)``), none, and the bank is not called at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LocalExperts(nn.Module):
    """An expert bank with its weights stacked, one slice per local expert (as torchtitan's ``GroupedExperts``):
    every tensor it saves has a row per token it received."""

    def __init__(self, local: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(local, dim, hidden) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(local, hidden, dim) * hidden**-0.5)

    def forward(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        # Every local expert on every row, then each row's own: the rows' count sets every saved tensor's size.
        h = F.gelu(torch.einsum("rd,edh->reh", rows, self.w1))
        out = torch.einsum("reh,ehd->red", h, self.w2)
        return out.gather(1, expert.view(-1, 1, 1).expand(-1, 1, out.shape[-1])).squeeze(1)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, local: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = LocalExperts(local, dim, hidden)
        self.local = local
        self.skew: int | None = None
        """The expert the router sends every token to (a batch all of one kind); None: as its scores say."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        if self.skew is not None:
            favoured = torch.zeros(logits.shape[-1], dtype=logits.dtype)
            favoured[self.skew] = 50.0
            logits = logits + favoured
        probs = logits.softmax(-1)
        choice = probs.argmax(-1)
        weight = probs.gather(1, choice.view(-1, 1))
        local = choice < self.local
        out = flat * weight  # the tokens another rank's experts take: a cheap stand-in
        if bool(local.any()):
            index = local.nonzero().squeeze(1)
            routed = self.experts(flat[index], choice[index])
            out = out.index_put((index,), routed * weight[index])
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, local: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.moe = MoE(dim, hidden, experts, local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.attn(self.norm(x)))
        return x + self.moe(x)


class TinyMoE(nn.Module):
    def __init__(self, *, layers: int = 4, dim: int = 48, hidden: int = 64, experts: int = 8, local: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, experts, local) for _ in range(layers))
        self.head = nn.Linear(dim, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def skew(self, expert: int | None) -> None:
        for b in self.blocks:
            b.moe.skew = expert


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
