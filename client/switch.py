"""Blocks whose activation checkpointing can be switched between steps.

The block's ``forward`` is replaced on the instance, so parameter names,
``state_dict`` keys and hooks stay exactly as the user defined them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rematd.client.accounting import SavedTensorAccounting, storage_key, tensors_in, unique_bytes


@dataclass(slots=True)
class BlockMeasure:
    """One block's profile, measured on a forward without checkpointing."""

    saved_bytes: int = 0
    input_bytes: int = 0
    forward_seconds: float = 0.0


def _attach_to_graph(output: Any, keep: list[Any]) -> None:
    """Keep ``keep`` alive exactly as long as the autograd graph of ``output``."""
    for t in tensors_in([output]):
        if t.grad_fn is not None:
            t.grad_fn.metadata["rematd_held"] = keep  # type: ignore[index]
            return


class SwitchableBlock:
    """Wraps one block's forward; ``checkpointed`` decides how the next forward runs."""

    def __init__(self, index: int, name: str, module: nn.Module, accounting: SavedTensorAccounting | None) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.checkpointed = False
        self.profiling = False
        self.measure: BlockMeasure | None = None
        self._accounting = accounting
        self._had_instance_forward = "forward" in module.__dict__
        self._original: Callable[..., Any] = module.forward
        module.forward = self._forward

    def restore(self) -> None:
        if self._had_instance_forward:
            self.module.forward = self._original
        else:
            self.module.__dict__.pop("forward", None)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._original(*args, **kwargs)
        if self.profiling:
            return self._profiled(*args, **kwargs)
        if not self.checkpointed:
            return self._original(*args, **kwargs)
        output = checkpoint(self._original, *args, use_reentrant=False, **kwargs)
        acct = self._accounting
        if acct is not None and acct.active:
            _attach_to_graph(output, acct.hold(tensors_in([args, kwargs])))
        return output

    def _profiled(self, *args: Any, **kwargs: Any) -> Any:
        acct = self._accounting
        excluded = acct.excluded if acct is not None else frozenset()
        saved: dict[tuple[str, int], int] = {}

        def pack(t: torch.Tensor) -> Any:
            key = storage_key(t)
            if key not in excluded:
                saved[key] = unique_bytes([t])
            return acct.pack(t) if acct is not None and acct.active else t

        def unpack(held: Any) -> torch.Tensor:
            return SavedTensorAccounting.unpack(held)

        inputs = tensors_in([args, kwargs])
        cuda = any(t.is_cuda for t in inputs)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            output = self._original(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        self.measure = BlockMeasure(
            saved_bytes=sum(saved.values()),
            input_bytes=unique_bytes(inputs, excluded),
            forward_seconds=time.perf_counter() - start,
        )
        self.profiling = False
        return output
