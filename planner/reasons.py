"""The controller's reasons, for people: byte counts, modes as letters, what changed between two tables."""

from __future__ import annotations

from rematd.planner.plan import ShapePlan
from rematd.planner.solvers import Choice
from rematd.planner.units import Mode, letters


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# How much of a block's forward runs again in backward: what "recomputes less" counts.
_RECOMPUTED = {Mode.STORE: 0, Mode.OFFLOAD: 0, Mode.SELECTIVE: 1, Mode.RECOMPUTE: 2}


def changed(
    before: tuple[ShapePlan, ...], after: tuple[ShapePlan, ...]
) -> list[tuple[int, ShapePlan | None, ShapePlan]]:
    old = {e.max_seq_len: e for e in before}
    return [(e.max_seq_len, old.get(e.max_seq_len), e) for e in after if old.get(e.max_seq_len) != e]


def recomputes_less(before: tuple[ShapePlan, ...], after: tuple[ShapePlan, ...]) -> bool:
    """No length of the table recomputes more than before, and some length recomputes less."""
    less = False
    for _seq, old, new in changed(before, after):
        if old is None:
            continue
        was = sum(_RECOMPUTED[m] for m in old.modes)
        now = sum(_RECOMPUTED[m] for m in new.modes)
        if now > was:
            return False
        less = less or now < was
    return less


def what_changed(before: tuple[ShapePlan, ...], after: tuple[ShapePlan, ...], most: int = 4) -> str:
    """The lengths whose modes changed, in the demo's letters, e.g. "length <= 160: RRRsRRRs -> RRRRRRRR"."""
    parts = []
    for seq, old, new in changed(before, after):
        if old is not None and old.modes == new.modes:
            continue
        parts.append(
            f"length <= {seq}: {letters(old.modes)} -> {letters(new.modes)}"
            if old is not None
            else f"length <= {seq}: {letters(new.modes)} (new)"
        )
    if not parts:
        return "modes unchanged (. store, s selective, R recompute, O offload)"
    shown = parts[:most] + ([f"and {len(parts) - most} more"] if len(parts) > most else [])
    return ", ".join(shown) + " (. store, s selective, R recompute, O offload)"


def initial_reason(choice: Choice, target: int) -> str:
    fit = "fits" if choice.fits else "does not fit"
    reason = (
        f"initial plan from profile: predicted {human_bytes(choice.predicted_peak_bytes)} "
        f"{fit} target {human_bytes(target)}"
    )
    return f"{reason}; {choice.note}" if choice.note else reason
