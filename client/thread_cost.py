"""What rematd costs the training thread, step by step, measured where it runs.

rematd's code runs in short stretches between the model's own work: the step-boundary hooks, each block's and
part's wrapper, the CPU's saved-tensor hooks, a recomputation's dispatch in backward. Each stretch starts the
clock when rematd's code is entered (:meth:`ThreadClock.enter`) and stops it when that code calls out to the
model or to torch (:meth:`ThreadClock.leave`), so a stretch nested in the model's forward (a part inside a
block, a saved tensor inside a part) counts only itself: at any moment the innermost stretch of rematd's code is
the one that runs. What rematd calls out to (a block's own forward, torch's checkpoint, the profiling step's
measured forwards) is the model's time, not rematd's.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any, TypeVar

T = TypeVar("T")


class ThreadClock:
    """Seconds of rematd's code on the training thread since the last :meth:`take`."""

    __slots__ = ("mark", "spent")

    def __init__(self) -> None:
        self.spent = 0.0
        self.mark = perf_counter()

    def enter(self) -> None:
        """rematd's code starts (or resumes after calling out)."""
        self.mark = perf_counter()

    def leave(self) -> None:
        """rematd's code ends (or calls out to the model or torch)."""
        self.spent += perf_counter() - self.mark

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, the model's or torch's code, called from rematd's, which it does not count."""
        self.leave()
        try:
            return fn(*args, **kwargs)
        finally:
            self.enter()

    def take(self) -> float:
        """From inside rematd's code: the seconds counted since the last call, this stretch's so far included;
        the count starts again from now."""
        now = perf_counter()
        spent = self.spent + (now - self.mark)
        self.spent, self.mark = 0.0, now
        return spent
