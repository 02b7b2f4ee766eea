"""Out-of-memory recovery: recognise the error, free what the failed step held.

The handle's :meth:`~rematd.client.handle.Handle.run_step` and
:meth:`~rematd.client.handle.Handle.guard` use these; the policy (report,
safe plan, one retry) lives in the handle.
"""

from __future__ import annotations

import gc
import traceback
from types import TracebackType
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from rematd.client.handle import Handle


class OutOfMemory(torch.OutOfMemoryError):
    """A step crossed ``hard_limit_bytes`` of bytes saved for backward (rematd's CPU limit).

    A subclass of ``torch.OutOfMemoryError``, so code that handles CUDA's
    out-of-memory error handles this one alike.
    """


class UnsupportedModel(ValueError):
    """``attach`` was given a model wrapped in a way rematd cannot work with."""


def is_oom(exc: BaseException) -> bool:
    """True for CUDA's (and rematd's) out-of-memory errors, and other backends' spelled as such."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def free_after_oom(
    exc: BaseException,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    cuda: bool,
) -> None:
    """Drop what the failed step holds: its graph (kept alive by the traceback's frames) and gradients."""
    tb: TracebackType | None = exc.__traceback__
    if tb is not None:
        traceback.clear_frames(tb)
    exc.__traceback__ = None
    model.zero_grad(set_to_none=True)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if cuda and torch.cuda.is_available():
        torch.cuda.empty_cache()


class Guard:
    """The context manager :meth:`Handle.guard <rematd.client.Handle.guard>` returns."""

    def __init__(self, handle: Handle) -> None:
        self._handle = handle
        self.oom = False
        """True when the guarded block ran out of memory and rematd recovered."""

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        h = self._handle
        if exc is None:
            h._oom_streak = 0
            return False
        if not isinstance(exc, Exception) or not is_oom(exc):
            return False
        h._recover(exc)
        if h._oom_streak >= 2:
            return False
        self.oom = True
        return True
