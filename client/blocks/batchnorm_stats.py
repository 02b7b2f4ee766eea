"""Keep batch-norm statistics as they would be without recomputation.

A recomputed block runs its forward a second time, in backward, and a
``BatchNorm`` layer in training mode would update its running mean, variance
and batch count again: the model's state (and every evaluation after) would
differ from the same run without rematd. These hooks notice a forward that
runs inside backward (only a recompute does) and put the statistics back.
The copies are made outside any dispatch mode: under selective checkpointing
the recompute must run exactly the ops the forward ran, and these are not
among them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.hooks import RemovableHandle

from rematd.client.attached_hooks import AttachedHook


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class _Restore:
    """Pre- and post-forward hooks of one norm layer."""

    __slots__ = ("saved",)

    def __init__(self) -> None:
        self.saved: list[torch.Tensor] | None = None

    def pre(self, module: nn.Module, args: Any) -> None:
        if module.training and _in_backward():
            with _disable_current_modes():
                self.saved = [b.clone() for b in module.buffers(recurse=False)]

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.saved is not None:
            with torch.no_grad(), _disable_current_modes():
                for b, s in zip(module.buffers(recurse=False), self.saved, strict=True):
                    b.copy_(s)
            self.saved = None


def protect_running_stats(blocks: Sequence[nn.Module]) -> list[RemovableHandle]:
    """Hooks on every batch-norm layer inside ``blocks``; remove them to undo."""
    handles: list[RemovableHandle] = []
    for block in blocks:
        for m in block.modules():
            if isinstance(m, _BatchNorm) and m.track_running_stats:
                r = _Restore()
                handles.append(m.register_forward_pre_hook(AttachedHook(r.pre)))
                handles.append(m.register_forward_hook(AttachedHook(r.post), always_call=True))
    return handles
