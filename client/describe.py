"""What the handle tells the planner about the model and the process: shapes, blocks, rank."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rematd.client.accounting import tensors_in
from rematd.client.switch import SwitchableBlock
from rematd.messages import BlockProfile
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


def model_fingerprint(blocks: Sequence[tuple[str, nn.Module]]) -> str:
    h = hashlib.sha256()
    for name, module in blocks:
        h.update(f"{name}:{type(module).__qualname__}".encode())
        for pname, p in module.named_parameters():
            h.update(f"{pname}{tuple(p.shape)}{p.dtype}".encode())
    return h.hexdigest()[:16]


def block_records(blocks: Sequence[SwitchableBlock]) -> tuple[BlockProfile, ...]:
    """Each block's profile as measured (zeros for a block without one)."""
    records = []
    for b in blocks:
        m = b.measure
        records.append(
            BlockProfile(
                index=b.index,
                name=b.name,
                saved_bytes=m.saved_bytes if m else 0,
                input_bytes=m.input_bytes if m else 0,
                forward_seconds=m.forward_seconds if m else 0.0,
                modes=m.modes if m else (),
            )
        )
    return tuple(records)


def dist_rank() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
