"""``with h.guard() as g:`` around a step: the context manager, on the handle's OOM policy."""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

from rematd.client.errors import OutOfMemory, UnsupportedModel
from rematd.client.oom_policy import OomPolicy, free_after_oom, is_oom

# Their import path before they had modules of their own.
__all__ = ["Guard", "Guarded", "OutOfMemory", "UnsupportedModel", "free_after_oom", "is_oom"]


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
