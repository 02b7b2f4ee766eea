"""Where a step's memory figures come from: the CUDA allocator, or saved-tensor accounting on the CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from rematd.client.memory.accounting import SavedTensorAccounting
from rematd.planner import AllocatorFigures, Size, Term
from rematd.planner.messages import MEMORY_CUDA, MEMORY_SAVED
from rematd.planner.records import quick


@quick
@dataclass(frozen=True, slots=True, kw_only=True)
class MemorySample(AllocatorFigures):
    """Memory figures for one step: the allocator's (CUDA) and the peaks the budget caps."""

    peak_allocated_bytes: int = 0
    saved_peak_bytes: int = 0
    held_bytes: int = 0
    """On the CPU, bytes saved for backward still held once the step is over (a graph nobody ran backward
    through): there at the next step's start, which counts them as static memory."""
    outside_bytes: int = 0
    """On the CPU, the peak of the bytes saved outside the blocks (embeddings, head, loss), less those still
    held once the step is over."""


def outside_blocks(*, peak: int, static: int, blocks: int, allocated_after: int, fresh_grads: int) -> Size:
    """The profiling step's memory at its peak outside static memory and the blocks, on CUDA, as the planner
    models it for other steps.

    ``peak``: the step's peak allocated bytes; ``static``: allocated at its start; ``blocks``: what the
    blocks saved; ``allocated_after``: allocated at its end; ``fresh_grads``: bytes of the gradients of
    parameters that had none at its start. What the step created and kept (``allocated_after - static``:
    optimizer state, gradients kept by ``zero_grad(set_to_none=False)``) is in later steps' static memory:
    it is taken out, not modelled as growing with tokens. The fresh gradients stay, as a constant: with
    ``zero_grad()`` (set to None) a later step creates them again on top of its static memory.
    """
    outside = max(0, peak - static - blocks)
    persisted = max(0, allocated_after - static)
    grads = min(outside, fresh_grads)
    # The persisted gradients are the same bytes as ``grads``: only what else persisted is taken out.
    kept = min(outside - grads, max(0, persisted - fresh_grads))
    grows = outside - grads - kept
    terms = [Term(grads, 0, 0)] if grads else []
    if grows:
        terms.append(Term(grows, 1, 1))
    return Size(tuple(terms))


class CudaMemory:
    """The caching allocator's statistics for one device, peaks reset every step."""

    kind = MEMORY_CUDA

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.name = torch.cuda.get_device_name(device)
        _, self.total_bytes = torch.cuda.mem_get_info(device)
        torch.cuda.reset_peak_memory_stats(device)

    def static_bytes(self) -> int:
        """Allocated now (at a step's start), from the allocator's nested statistics: ``memory_allocated``
        reads ``memory_stats``, which flattens every entry in Python, on the training thread, every step."""
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        return int(_all(stats, "allocated_bytes").get("current", 0))

    def sample(self) -> MemorySample:
        """The step's figures; peaks start again."""
        # The allocator's nested statistics as it returns them: ``memory_stats`` flattens every entry in Python
        # first, on the training thread, for the handful read here.
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated, reserved = _all(stats, "allocated_bytes"), _all(stats, "reserved_bytes")
        return MemorySample(
            peak_allocated_bytes=int(allocated.get("peak", 0)),
            peak_reserved_bytes=int(reserved.get("peak", 0)),
            allocated_bytes=int(allocated.get("current", 0)),
            reserved_bytes=int(reserved.get("current", 0)),
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
            oom_count=int(stats.get("num_ooms", 0)),
            inactive_split_bytes=int(_all(stats, "inactive_split_bytes").get("current", 0)),
            free_bytes=int(free),
            total_bytes=int(total),
        )


def _all(stats: dict[str, Any], name: str) -> dict[str, Any]:
    """The allocator's figures of ``name`` over all pools (``stats[name]["all"]``; empty where absent)."""
    entry = stats.get(name)
    return entry.get("all", {}) if isinstance(entry, dict) else {}


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class SavedTensorMemory:
    """On the CPU the budget caps bytes saved for backward, counted by saved-tensor hooks."""

    kind = MEMORY_SAVED

    def __init__(self, accounting: SavedTensorAccounting) -> None:
        self.accounting = accounting
        self.name = "cpu"
        self.total_bytes = _host_memory_bytes()

    def static_bytes(self) -> int:
        return 0

    def sample(self, static: int = 0) -> MemorySample:
        """The step's figures, ``static`` bytes (what the set-up holds, standing in for a device's) added to the
        peak of those saved for backward; the accounting's peaks start again."""
        return saved_sample(self.take(static))

    def take(self, static: int = 0) -> SavedFigures:
        """:meth:`sample`'s figures as they are read (on the training thread), made a sample by
        :func:`saved_sample` where needed."""
        peak, live, outside = self.accounting.take_step()
        return peak + static, live, outside, self.total_bytes


SavedFigures = tuple[int, int, int, int]
"""On the CPU, a step's peak of bytes saved for backward (static bytes included), those still held at its end, the
peak outside the blocks less those held, and the host's bytes."""


def saved_sample(figures: SavedFigures) -> MemorySample:
    """The memory sample of :meth:`SavedTensorMemory.take`'s figures."""
    peak, held, outside, total = figures
    return MemorySample(saved_peak_bytes=peak, held_bytes=held, outside_bytes=outside, total_bytes=total)
