"""Pinned modes and the budget, set on a callback before or while it trains, passed on to its handle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rematd.client import Handle
from rematd.client.arguments import check_bytes, pin_sequence
from rematd.planner import Mode

PinArgument = str | Mode | Sequence[str | Mode] | None


class HandleControls:
    """What a training loop would do to ``attach``'s handle, for a callback that owns the handle.

    Set before training starts, a pin and a budget are kept and given to the handle the callback
    attaches (the pin then applies from the first step after profiling); set while training runs
    (from another callback, or from ``training_step``), they go to the handle at once and apply
    from the next step, exactly as :meth:`rematd.client.Handle.pin_modes` and
    :attr:`rematd.client.Handle.budget_bytes` do.
    """

    handle: Handle | None
    _options: dict[str, Any]
    _pin: PinArgument = None

    def pin_modes(self, modes: PinArgument) -> None:
        """One mode for every block (``"recompute"``) or one per block; ``None`` follows the planner again."""
        if modes is not None:
            pin_sequence(modes, 1)  # names and types now; the number of blocks once the model is attached
        if self.handle is not None:
            self.handle.pin_modes(modes)  # first: a pin the model refuses is not kept for the next run
        self._pin = modes

    @property
    def budget_bytes(self) -> int | None:
        """The memory budget the handle plans for (``None``: the device's memory, read at the first step)."""
        if self.handle is not None:
            return self.handle.budget_bytes
        budget: int | None = self._options.get("budget_bytes")
        return budget

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        budget = check_bytes("budget_bytes", value, optional=False)
        assert budget is not None
        self._options["budget_bytes"] = budget
        if self.handle is not None:
            self.handle.budget_bytes = budget

    def _controls_attached(self, handle: Handle) -> None:
        """Give a freshly attached ``handle`` the pin set on the callback; closes it if the pin does not fit."""
        if self._pin is None:
            return
        try:
            handle.pin_modes(self._pin)
        except Exception:
            handle.close()
            raise
