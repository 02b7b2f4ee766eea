"""The profile the planner's price tests start from: eight alike blocks, priced so that each mode frees what it
costs in proportion (storing keeps 1000 bytes; selective 400, bringing 600 back in backward; recomputing 100,
bringing 1000 back and adding one forward)."""

from __future__ import annotations

from rematd.planner import BlockCost, Mode, ModeCost, Profile, Shape, Size, Term

REF = Shape(batch=2, seq_len=64, tokens=128)
"""The shape the profile is measured at."""
FORWARD = 0.01
"""A block's forward, seconds: what recomputing it adds."""


def fixed(n: int) -> Size:
    """``n`` bytes at every shape: the budget binds alike at every length, only the prices differ."""
    return Size((Term(n, 0, 0),))


def alike_blocks(
    *,
    n: int = 8,
    selective: float | None = 0.004,
    scaled: bool = True,
    shape: Shape = REF,
    middle: Mode = Mode.SELECTIVE,
) -> Profile:
    """``n`` alike blocks. ``selective``: the seconds the mode between storing and recomputing (``middle``,
    selective by default) adds by the profile (None: not offered); ``scaled``: sizes grow with tokens, else
    :func:`fixed`."""
    size = Size.linear if scaled else fixed
    modes = [ModeCost(mode=Mode.STORE, kept=size(1000))]
    if selective is not None:
        modes.append(ModeCost(mode=middle, kept=size(400), transient=size(600), extra_seconds=selective))
    modes.append(ModeCost(mode=Mode.RECOMPUTE, kept=size(100), transient=size(1000), extra_seconds=FORWARD))
    block = BlockCost(saved_bytes=1000, input_bytes=100, forward_seconds=FORWARD, modes=tuple(modes))
    return Profile(blocks=(block,) * n, shape=shape)
