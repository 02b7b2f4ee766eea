"""A job's figures, computed once: the dashboard, the REST API and Prometheus read the same numbers."""

from __future__ import annotations

from collections.abc import Iterable


def headroom_ratio(budget_bytes: int, peak_bytes: int | None) -> float | None:
    """``(budget - peak) / budget``: negative over budget; None without a measured peak or a budget."""
    if peak_bytes is None or budget_bytes <= 0:
        return None
    return (budget_bytes - peak_bytes) / budget_bytes


def job_oom_risk(risks: Iterable[float | None], *, ended: bool = False) -> float | None:
    """A job's out-of-memory risk: its riskiest rank's. An ended job carries no live risk (what it last
    measured is history), and a job whose ranks measured none has none."""
    if ended:
        return None
    known = [r for r in risks if r is not None]
    return max(known) if known else None


def job_peak(peaks: Iterable[int | None]) -> int | None:
    """A job's measured peak: its largest rank's last step (None before any step)."""
    known = [p for p in peaks if p is not None]
    return max(known) if known else None
