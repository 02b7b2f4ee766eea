"""The planner's base vocabulary: modes, input shapes, and the checks of byte and second counts."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from rematd.planner.records import quick


def check_bytes(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer number of bytes, got {value!r}")


def check_seconds(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative number of seconds, got {value!r}")


class Mode(enum.IntEnum):
    """How a block keeps what its backward needs. Values match the wire enum."""

    STORE = 1
    """Keep every saved activation."""
    SELECTIVE = 2
    """Keep matmul and attention outputs; recompute pointwise ops in backward."""
    RECOMPUTE = 3
    """Keep only the block's input; run its forward again in backward."""
    OFFLOAD = 4
    """Copy the saved activations to host memory until backward."""
    COMPRESS = 5
    """Keep the saved activations quantized (8 bits, or bf16) until backward: lossy, and only where enabled."""
    TITAN = 6
    """torchtitan's selective policy: keep every other matmul's output, attention's and the collectives',
    recompute the rest (an MoE router's gate always)."""
    ATTENTION = 7
    """Recompute the block's attention part in backward; keep the rest as storing does."""
    MLP = 8
    """Recompute the block's MLP (or experts) part in backward; keep the rest as storing does."""

    @property
    def label(self) -> str:
        """The mode's name as people read it, in REST, the dashboard and Prometheus labels: ``"store"``."""
        return self.name.lower()

    @property
    def letter(self) -> str:
        """One character a block, as plans are printed and stored: ``".stamROC"``."""
        return MODE_LETTERS[self]


MODE_LETTERS = {
    Mode.STORE: ".",
    Mode.SELECTIVE: "s",
    Mode.RECOMPUTE: "R",
    Mode.OFFLOAD: "O",
    Mode.COMPRESS: "C",
    Mode.TITAN: "t",
    Mode.ATTENTION: "a",
    Mode.MLP: "m",
}
"""The mode vocabulary's letters, the one place they are defined."""
MODES_BY_LABEL = {m.label: m for m in Mode}
"""Each mode by the name people read it by (``Mode.label``)."""
MODES_BY_LETTER = {letter: m for m, letter in MODE_LETTERS.items()}
"""Each mode by its letter (``Mode.letter``), as plans are printed."""


def letters(modes: tuple[Mode, ...] | list[Mode]) -> str:
    """Modes one letter a block, as the demo prints them: . store, s selective, t titan, a attention, m mlp,
    R recompute, O offload, C compress."""
    return "".join(MODE_LETTERS[m] for m in modes)


@quick
@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """The shape signature of one step's input."""

    batch: int = 0
    """Sequences in the batch (0 when unknown)."""
    seq_len: int = 0
    """Tokens per sequence (0 when unknown)."""
    tokens: int = 0
    """Tokens in the batch; the quantity activation memory scales with."""

    def __post_init__(self) -> None:
        for name in ("batch", "seq_len", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"shape.{name} must be a non-negative integer, got {value!r}")
