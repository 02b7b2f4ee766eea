"""Counting bytes saved for backward, de-duplicated by storage.

Saved-tensor hooks see every tensor autograd keeps for backward. Each packed
tensor is wrapped in a small holder whose release (when autograd frees the
saved variable) gives the bytes back, so the live total follows forward and
backward and its peak is the step's activation peak.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rematd.client.errors import OutOfMemory
from rematd.client.thread_cost import ThreadClock


def storage_id(t: torch.Tensor) -> int | None:
    """A storage's identity that outlives a sharded set-up's resizing it to nothing and back (unlike its address)."""
    try:
        return int(local_part(t).untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def local_part(t: torch.Tensor) -> torch.Tensor:
    """A distributed tensor's local part (what this rank holds); any other tensor as it is."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    t = local_part(t)
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return ("id", id(t))


def storage_bytes(t: torch.Tensor) -> int:
    t = local_part(t)
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


def _fast_key(t: torch.Tensor) -> tuple[str, int]:
    t = local_part(t)
    try:
        return (t.device.type, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return storage_key(t)


class _Held:
    """A saved tensor as autograd keeps it, giving its bytes back when freed."""

    __slots__ = ("__weakref__", "key", "owner", "tensor")

    def __init__(self, owner: SavedTensorAccounting, key: tuple[str, int], tensor: torch.Tensor | None) -> None:
        self.owner = owner
        self.key = key
        self.tensor = tensor
        """The tensor autograd saved; None for a count that :meth:`SavedTensorAccounting.hold` keeps without it."""

    def __del__(self) -> None:
        self.owner._release(self.key)


class SavedTensorAccounting:
    """Live and peak bytes saved for backward, excluding parameters and buffers."""

    def __init__(self) -> None:
        self.clock = ThreadClock()
        """Where rematd's time on the training thread adds up: its saved-tensor hooks' and the handle's."""
        self._lock = threading.Lock()
        self._refs: dict[tuple[str, int], list[int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.excluded: frozenset[tuple[str, int]] = frozenset()
        self._held: list[list[_Held]] = []
        self._held_until: dict[int, list[list[_Held]]] = {}
        """Held counts by the id of the tensor whose gradient frees them (ids of this step's tensors)."""
        self._open: list[Callable[[object], None]] = []
        self._transient = 0
        self._transient_owner: object | None = None
        self._excluded_fast: frozenset[tuple[str, int]] = frozenset()
        self.gathered: frozenset[int] = frozenset()
        """Storages the parallel set-up gathers parameters into: weights, not activations."""
        self.active = False
        """True while the model's forward runs under this accounting's hooks."""
        self.is_weight: Callable[[torch.Tensor], bool] | None = None
        """The set-up's test for saved tensors that are parameters it gathered anew for this use (weights)."""
        self.hard_limit_bytes: int | None = None
        """Live bytes a pack may not take the total above: it raises ``OutOfMemory`` instead."""
        self.block_depth = 0
        """Blocks whose forward is running (on the training thread): a storage first saved while none is, is
        saved outside the blocks."""
        self.outside_live = 0
        self.outside_peak = 0
        """Live bytes saved outside the blocks (the embeddings, the head, the loss), and their peak since
        :meth:`take_step`: measured apart, whatever the blocks keep."""

    def exclude_module_state(self, module: torch.nn.Module, gathered: frozenset[int] = frozenset()) -> None:
        """Leave ``module``'s parameters and buffers out of the count, known by their addresses (a cheap test on
        the hot path), except those in storages a sharded set-up gathers into (``gathered``: identities). The
        set-up frees such a storage between uses and gathers into it anew at another address, which the allocator
        may meanwhile hand to an activation: kept, the address would hide that activation. :attr:`gathered`
        tells them apart by identity."""
        state = [t for t in (*module.parameters(), *module.buffers()) if storage_id(t) not in gathered]
        self.excluded = frozenset(storage_key(t) for t in state)
        self._excluded_fast = frozenset(_fast_key(t) for t in state)

    def pack(self, t: torch.Tensor) -> Any:
        clock = self.clock
        clock.enter()
        try:
            return self._pack(t)
        finally:
            clock.leave()

    def _pack(self, t: torch.Tensor) -> Any:
        # The hot path (once per saved tensor): one storage object for both the key and the size.
        if self.is_weight is not None and self.is_weight(t):
            return t
        try:
            st = t.untyped_storage()
            key = (t.device.type, st.data_ptr())
            size = int(st.nbytes())
            if self.gathered and st._cdata in self.gathered:
                return t
        except (RuntimeError, NotImplementedError):
            # A distributed tensor (tensor parallel) has no storage of its own: its local part is what is held.
            local = local_part(t)
            if self.gathered and local is not t and storage_id(local) in self.gathered:
                return t
            key, size = _fast_key(t), storage_bytes(t)
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
                outside = self.block_depth == 0
                self._refs[key] = [1, size, outside]
                self.live_bytes += size
                if self.live_bytes > self.peak_bytes:
                    self.peak_bytes = self.live_bytes
                if outside:
                    self.outside_live += size
                    if self.outside_live > self.outside_peak:
                        self.outside_peak = self.outside_live
            else:
                ref[0] += 1
        return _Held(self, key, t)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held  # type: ignore[no-any-return,return-value]

    def _release(self, key: tuple[str, int]) -> None:
        with self._lock:
            ref = self._refs.get(key)
            if ref is None:
                return
            ref[0] -= 1
            if ref[0] == 0:
                del self._refs[key]
                self.live_bytes -= ref[1]
                if ref[2]:
                    self.outside_live -= ref[1]

    def hold(self, tensors: Iterable[torch.Tensor], until_grad_of: Iterable[torch.Tensor] = ()) -> None:
        """Count tensors that a checkpoint keeps outside autograd's saved variables, until
        backward has computed the gradient of any of ``until_grad_of`` (the block is done)
        or, failing that, until :meth:`release_held` at the end of the step."""
        held = [h for h in (self._pack(t) for t in tensors) if isinstance(h, _Held)]
        if not held:
            return
        for h in held:
            # Counted, not kept: the checkpoint frees what it kept once its recomputation has used it, and a
            # reference here would hold each block's kept outputs until its backward ends.
            h.tensor = None
        self._held.append(held)
        watch = [t for t in until_grad_of if t.requires_grad]
        if watch:
            torch.autograd.graph.register_multi_grad_hook(watch, lambda _grads: held.clear(), mode="any")
            for t in watch:
                self._held_until.setdefault(id(t), []).append(held)

    def rematerialise(
        self, nbytes: int, between: Iterable[torch.Tensor], until_grad_of: Iterable[torch.Tensor]
    ) -> None:
        """Count ``nbytes`` that a checkpointed block brings back in backward: from when the
        gradient of its output (``between``) arrives until that of its input does. The
        checkpoint recomputes under hooks of its own, so the size comes from the profile."""
        outs = [t for t in between if t.requires_grad]
        ins = [t for t in until_grad_of if t.requires_grad]
        if nbytes <= 0 or not outs:
            return
        token = object()
        # The hook keeps ids, not the outputs: a hook lives on the output's own autograd node, so a tensor
        # captured here would live until backward ends, a block's output more per block on the real peak.
        out_ids = [id(t) for t in outs]

        def start(_grads: object) -> None:
            # The block after this one is done: what it held until this gradient is freed before this
            # block rematerialises anything (its own hook, registered later, fires after this one).
            for key in out_ids:
                for held in self._held_until.pop(key, ()):
                    held.clear()
            # Backward runs blocks one after another: the previous block's rematerialised
            # activations are gone once the next one starts (its end hook may fire after this).
            with self._lock:
                self.live_bytes += nbytes - self._transient
                self._transient, self._transient_owner = nbytes, token
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)

        def end(_grads: object) -> None:
            with self._lock:
                if self._transient_owner is token:
                    self.live_bytes -= self._transient
                    self._transient, self._transient_owner = 0, None

        torch.autograd.graph.register_multi_grad_hook(outs, start, mode="any")
        if ins:
            torch.autograd.graph.register_multi_grad_hook(ins, end, mode="any")
        self._open.append(end)

    def forget(self) -> None:
        """Start counting from nothing: after a failed step nothing it saved is needed, whatever
        still references it (a holder released later then gives back nothing)."""
        self.release_held()
        with self._lock:
            self._refs.clear()
            self.live_bytes = self.peak_bytes = 0
            self.outside_live = self.outside_peak = 0
            self._transient, self._transient_owner = 0, None

    def release_held(self) -> None:
        """Give back every count :meth:`hold` and :meth:`rematerialise` still keep (the step is over)."""
        for held in self._held:
            held.clear()
        self._held.clear()
        self._held_until.clear()
        for end in self._open:
            end(None)
        self._open.clear()

    def take_step(self) -> tuple[int, int, int]:
        """At a step's end: every count still kept given back (:meth:`release_held`), then the peak since the
        last take, the bytes still live and the peak outside the blocks (:meth:`take_peak`,
        :meth:`take_outside_peak`), under one lock."""
        if self._held or self._held_until or self._open:
            self.release_held()
        with self._lock:
            peak, live = self.peak_bytes, self.live_bytes
            outside, outside_live = self.outside_peak, self.outside_live
            self.peak_bytes, self.outside_peak = live, outside_live
        return peak, live, max(0, outside - outside_live)

    def take_peak(self) -> int:
        """The peak since the last call; the next period starts from the live total."""
        with self._lock:
            peak = self.peak_bytes
            self.peak_bytes = self.live_bytes
            return peak

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
