"""Counting the collectives a step issues, by kind, at the dispatcher (where FSDP's and DTensor's land)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from rematd.client.parallel.agreement import Agreement

_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
}
"""The sharding's collectives by the op that carries them (c10d's, or the functional ones DTensor uses).
rematd's plan agreement (an all-reduce of a byte per block) is counted apart, as ``agreement``."""


class _Count(TorchDispatchMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            kind = "agreement" if Agreement.running else _KINDS.get(func.__name__.split(".")[0], "other")
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Collectives issued inside the block, by kind (``all_gather``, ``reduce_scatter``, ``all_reduce``)."""
    counts: Counter[str] = Counter()
    with _Count(counts):
        yield counts


def differences(plain: dict[str, int], ours: dict[str, int], kinds: tuple[str, ...] = ("all_gather",)) -> list[str]:
    """How a step's collectives with rematd differ from the same step without it, for ``kinds`` (empty: none)."""
    return [
        f"{k}: {ours.get(k, 0)} with rematd, {plain.get(k, 0)} without" for k in kinds if ours.get(k) != plain.get(k)
    ]
