"""The controller's reasons, for people: byte counts, modes as letters, what changed between two tables."""

from __future__ import annotations

from collections.abc import Iterable

from rematd.planner.plan import ShapePlan
from rematd.planner.solvers import Choice
from rematd.planner.units import Mode, letters


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# How much of a block's forward runs again in backward: what "recomputes less" counts.
_RECOMPUTED = {
    Mode.STORE: 0,
    Mode.OFFLOAD: 0,
    Mode.COMPRESS: 0,
    Mode.ATTENTION: 1,
    Mode.MLP: 1,
    Mode.SELECTIVE: 1,
    Mode.TITAN: 1,
    Mode.RECOMPUTE: 2,
}
_KEYED = (Mode.STORE, Mode.SELECTIVE, Mode.RECOMPUTE, Mode.OFFLOAD)
"""The modes the key always names (readers match it); the others are named once some plan shown runs them."""
LEGEND = "(. store, s selective, R recompute, O offload)"


def legend(shown: Iterable[Mode]) -> str:
    """The key to the letters of the modes ``shown``: the usual key, and the letter of each other mode shown."""
    extra = sorted(set(shown) - set(_KEYED))
    if not extra:
        return LEGEND
    return LEGEND[:-1] + "".join(f", {m.letter} {m.label}" for m in extra) + ")"


def lossy_note(modes: tuple[Mode, ...], table: tuple[ShapePlan, ...]) -> str:
    """What a plan that compresses says of it: its gradients are close to storing's, not bitwise equal."""
    blocks = sorted({i for ms in (modes, *(e.modes for e in table)) for i, m in enumerate(ms) if m == Mode.COMPRESS})
    if not blocks:
        return ""
    return f"lossy: blocks {', '.join(map(str, blocks))} compress their saved activations (C)"


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
    shown = [m for _seq, old, new in changed(before, after) for m in (*(old.modes if old else ()), *new.modes)]
    key = legend(shown)
    for seq, old, new in changed(before, after):
        if old is not None and old.modes == new.modes:
            continue
        parts.append(
            f"length <= {seq}: {letters(old.modes)} -> {letters(new.modes)}"
            if old is not None
            else f"length <= {seq}: {letters(new.modes)} (new)"
        )
    if not parts:
        return f"modes unchanged {key}"
    listed = parts[:most] + ([f"and {len(parts) - most} more"] if len(parts) > most else [])
    return ", ".join(listed) + f" {key}"


def initial_reason(choice: Choice, target: int) -> str:
    fit = "fits" if choice.fits else "does not fit"
    reason = (
        f"initial plan from profile: predicted {human_bytes(choice.predicted_peak_bytes)} "
        f"{fit} target {human_bytes(target)}"
    )
    return f"{reason}; {choice.note}" if choice.note else reason


def lengths_named(seqs: list[int]) -> str:
    """Table lengths as a reason names them: "length 64", "lengths 128 and 256", "lengths 64 to 512"."""
    ordered = sorted(seqs)
    if len(ordered) == 1:
        return f"length {ordered[0]}"
    if len(ordered) == 2:
        return f"lengths {ordered[0]} and {ordered[1]}"
    return f"lengths {ordered[0]} to {ordered[-1]}"


def target_named(here: int, target: int) -> str:
    """A length's target as a reason quotes it: the target, or the wider one its settled peaks earned."""
    return human_bytes(here) if here == target else f"{human_bytes(here)} (its peaks settled: a smaller margin)"
