"""The shape of a model call as the planner sees it: the batch and sequence length of its first tensor."""

from __future__ import annotations

from typing import Any

from rematd.client.memory.accounting import tensors_in
from rematd.planner import Shape


def shape_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shape:
    """The shape signature of a model call: batch and sequence length of its first tensor."""
    for t in tensors_in([args, kwargs]):
        if t.dim() == 0:
            continue
        batch = int(t.shape[0])
        seq = int(t.shape[1]) if t.dim() >= 2 else 1
        return Shape(batch=batch, seq_len=seq, tokens=batch * seq)
    return Shape()
