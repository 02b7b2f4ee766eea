"""What an out-of-memory error in a step does, for ``run_step`` and ``guard`` alike.

Every error is counted and handed to the handle's recovery: free what the
failed step held, report the error to the planner, recompute every block
until the planner's next plan (safe mode). Then:

- :meth:`OomPolicy.run` (``run_step``) runs the step again; when every one of
  ``give_up_after`` tries in the call failed, the last error is raised.
- :meth:`OomPolicy.after_guarded` (``guard``) suppresses the error, unless it
  is the ``give_up_after``-th in a row: the guarded retry failed too, and it is
  raised.
- A step that completes ends the streak.

A retry does not wait: it differs from the failed try by what it keeps
(every block recomputes), not by when it runs.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

T = TypeVar("T")

Recovery = Callable[[BaseException], None]
"""The handle's recovery from one error; it must not raise."""


def is_oom(exc: BaseException) -> bool:
    """True for CUDA's (and rematd's) out-of-memory errors, and other backends' spelled as such."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def oom_message(exc: BaseException) -> str:
    """The error as the planner and the log see it (bounded: some backends' messages run long)."""
    return f"{type(exc).__name__}: {str(exc)[:500]}"


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


class OomPolicy:
    """Counts out-of-memory errors, runs the recovery for each, and decides when one is raised."""

    def __init__(
        self, recover: Recovery, *, give_up_after: int = 2, closed: Callable[[], bool] = lambda: False
    ) -> None:
        if isinstance(give_up_after, bool) or not isinstance(give_up_after, int) or give_up_after < 1:
            raise ValueError(f"give_up_after must be an integer >= 1, got {give_up_after!r}")
        self._recover = recover
        self._closed = closed
        """True once the handle is closed: an error after that is the training job's own, raised untouched."""
        self.give_up_after = give_up_after
        """Errors in a row (tries of one ``run``, or guarded blocks) after which the error is raised."""
        self.count = 0
        """Out-of-memory errors recovered from (or raised)."""
        self.streak = 0
        """Errors since the last step that completed."""

    def succeeded(self) -> None:
        """A step completed: the next error starts a new streak."""
        self.streak = 0

    def failed(self, exc: BaseException) -> bool:
        """Recover from ``exc``; True when the step may be tried again (the streak is not at its limit)."""
        self.count += 1
        self.streak += 1
        self._recover(exc)
        return self.streak < self.give_up_after

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, tried again after an out-of-memory error, up to ``give_up_after`` tries."""
        tries = 0
        while True:
            tries += 1
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                if not is_oom(exc) or self._closed():
                    raise
                self.failed(exc)
                if tries >= self.give_up_after:
                    raise
                continue
            self.succeeded()
            return result

    def after_guarded(self, exc: BaseException | None) -> bool:
        """How a guarded block ended; True when its out-of-memory error is suppressed."""
        if exc is None:
            self.succeeded()
            return False
        if not isinstance(exc, Exception) or not is_oom(exc) or self._closed():
            return False
        return self.failed(exc)


class Guarded(Protocol):
    """What a guard needs of a handle: its out-of-memory policy."""

    @property
    def oom_policy(self) -> OomPolicy: ...


class Guard:
    """The context manager :meth:`Handle.guard <rematd.client.Handle.guard>` returns."""

    def __init__(self, handle: Guarded) -> None:
        self._policy = handle.oom_policy
        self.oom = False
        """True when the guarded block ran out of memory and rematd recovered."""

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        suppressed = self._policy.after_guarded(exc)
        self.oom = self.oom or suppressed
        return suppressed
