"""The shape of a model call as the planner sees it: the batch and sequence length of its first tensor."""

from __future__ import annotations

from typing import Any

import torch

from rematd.client.memory.accounting import tensors_in
from rematd.planner import Shape

_last: list[Shape] = [Shape()]
"""The shape found last: a step like the one before (the common case) makes no new one."""


def shape_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shape:
    """The shape signature of a model call: batch and sequence length of its first tensor."""
    first = args[0] if args else None
    size = first.shape if isinstance(first, torch.Tensor) else ()
    if len(size) >= 2:
        # Once per step, on the training thread: the first argument is the batch in nearly every loop (one
        # call into torch, its size; each costs microseconds there, its caches cold after a backward).
        last = _last[0]
        if last.batch == size[0] and last.seq_len == size[1]:
            return last
        shape = Shape(batch=int(size[0]), seq_len=int(size[1]), tokens=int(size[0]) * int(size[1]))
        _last[0] = shape
        return shape
    for t in tensors_in([args, kwargs]):
        if t.dim() == 0:
            continue
        batch = int(t.shape[0])
        seq = int(t.shape[1]) if t.dim() >= 2 else 1
        return Shape(batch=batch, seq_len=seq, tokens=batch * seq)
    return Shape()
