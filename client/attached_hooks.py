"""Hooks rematd leaves on a user's model and optimizer, safe to copy and pickle.

``copy.deepcopy(model)``, ``AveragedModel(model)`` and ``torch.save(model)``
copy every hook with the model. A hook bound to the handle would drag its
locks and stream thread along (and fail), or worse, let the copy drive the
original's handle. A copy is not attached: its hooks do nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class AttachedHook:
    """Calls ``fn`` here; a copy (deep copy, pickle) calls nothing and returns None."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any] | None) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return None if self.fn is None else self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[type[AttachedHook], tuple[None]]:
        return (AttachedHook, (None,))
