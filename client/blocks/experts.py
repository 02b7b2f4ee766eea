"""A mixture of experts' expert bank inside a block, and the token rows the router sends it.

An MoE block's experts hold their weights stacked, one slice per expert (torchtitan's ``GroupedExperts``,
transformers' fused ``Qwen3MoeExperts`` and its kin): a module whose own parameters are all three-dimensional
with one leading size, the number of experts. Everything the experts save for backward has a row per token the
bank received, and under expert parallel that count is whatever the router sent this rank's experts: a batch
whose tokens mostly pick one expert doubles what the rank that holds it keeps. The bank's first argument is
those rows (after the all-to-all that dispatches them), read by a forward hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def expert_bank(block: nn.Module) -> nn.Module | None:
    """The block's expert bank: the first module (in ``named_modules`` order) whose own parameters are all
    three-dimensional, stacked over one number of experts, more than one. None where the block has none."""
    for m in block.modules():
        own = list(m.parameters(recurse=False))
        if not own or any(p.dim() != 3 for p in own):
            continue
        leading = {int(p.shape[0]) for p in own}
        if len(leading) == 1 and leading.pop() > 1:
            return m
    return None


def rows_of(args: tuple[Any, ...]) -> int:
    """The token rows a bank's call received: its first argument's leading size (0 where it has none)."""
    first = args[0] if args else None
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() >= 1 else 0


def watch_rows(bank: nn.Module, seen: Callable[[int], None]) -> RemovableHandle:
    """Calls ``seen(rows)`` after each forward of ``bank`` (grad-enabled only: a no-grad evaluation keeps
    nothing), with the rows it received."""

    def hook(_m: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
        if torch.is_grad_enabled():
            seen(rows_of(args))

    return bank.register_forward_hook(hook)
