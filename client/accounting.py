"""Counting bytes saved for backward, de-duplicated by storage.

Saved-tensor hooks see every tensor autograd keeps for backward. Each packed
tensor is wrapped in a small holder whose release (when autograd frees the
saved variable) gives the bytes back, so the live total follows forward and
backward and its peak is the step's activation peak.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from rematd.client.guard import OutOfMemory


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return ("id", id(t))


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def tensors_in(values: Iterable[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(tensors_in(v))
        elif isinstance(v, dict):
            found.extend(tensors_in(v.values()))
    return found


def unique_bytes(tensors: Iterable[torch.Tensor], exclude: frozenset[tuple[str, int]] = frozenset()) -> int:
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        key = storage_key(t)
        if key not in exclude:
            seen[key] = storage_bytes(t)
    return sum(seen.values())


def _fast_key(t: torch.Tensor) -> tuple[str, int]:
    try:
        return (t.device.type, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return storage_key(t)


class _Held:
    """A saved tensor as autograd keeps it, giving its bytes back when freed."""

    __slots__ = ("__weakref__", "key", "owner", "tensor")

    def __init__(self, owner: SavedTensorAccounting, key: tuple[str, int], tensor: torch.Tensor) -> None:
        self.owner = owner
        self.key = key
        self.tensor = tensor

    def __del__(self) -> None:
        self.owner._release(self.key)


class SavedTensorAccounting:
    """Live and peak bytes saved for backward, excluding parameters and buffers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict[tuple[str, int], list[int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.excluded: frozenset[tuple[str, int]] = frozenset()
        self._excluded_fast: frozenset[tuple[str, int]] = frozenset()
        self.active = False
        """True while the model's forward runs under this accounting's hooks."""
        self.hard_limit_bytes: int | None = None
        """Live bytes a pack may not take the total above: it raises ``OutOfMemory`` instead."""

    def exclude_module_state(self, module: torch.nn.Module) -> None:
        state = (*module.parameters(), *module.buffers())
        self.excluded = frozenset(storage_key(t) for t in state)
        self._excluded_fast = frozenset(_fast_key(t) for t in state)

    def pack(self, t: torch.Tensor) -> Any:
        # The hot path (once per saved tensor): one storage object for both the key and the size.
        try:
            st = t.untyped_storage()
            key = (t.device.type, st.data_ptr())
            size = int(st.nbytes())
        except (RuntimeError, NotImplementedError):
            key, size = storage_key(t), storage_bytes(t)
        if key in self._excluded_fast:
            return t
        with self._lock:
            ref = self._refs.get(key)
            if ref is None:
                limit = self.hard_limit_bytes
                if limit is not None and self.live_bytes + size > limit:
                    raise OutOfMemory(
                        f"rematd hard limit: saving {size} more bytes for backward would hold "
                        f"{self.live_bytes + size} bytes, over hard_limit_bytes={limit}"
                    )
                self._refs[key] = [1, size]
                self.live_bytes += size
                if self.live_bytes > self.peak_bytes:
                    self.peak_bytes = self.live_bytes
            else:
                ref[0] += 1
        return _Held(self, key, t)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held  # type: ignore[no-any-return]

    def _release(self, key: tuple[str, int]) -> None:
        with self._lock:
            ref = self._refs.get(key)
            if ref is None:
                return
            ref[0] -= 1
            if ref[0] == 0:
                del self._refs[key]
                self.live_bytes -= ref[1]

    def hold(self, tensors: Iterable[torch.Tensor]) -> list[_Held]:
        """Count tensors that a checkpoint keeps outside autograd's saved variables."""
        return [h for h in (self.pack(t) for t in tensors) if isinstance(h, _Held)]

    def take_peak(self) -> int:
        """The peak since the last call; the next period starts from the live total."""
        with self._lock:
            peak = self.peak_bytes
            self.peak_bytes = self.live_bytes
            return peak

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
