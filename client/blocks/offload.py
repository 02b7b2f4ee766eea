"""Offload: a block's saved activations go to host memory on a side stream, and come back before its
backward needs them.

Copies out start as each tensor is saved and run on a side stream, so the
block's forward goes on while they do; the device memory is handed back to
the allocator once the copy is done (``record_stream``). The host buffers
come from a pool reused step after step (:mod:`rematd.client.blocks.host_pool`),
pinned on a device, so that a step pays no allocation of page-locked memory.
Coming back, each block's tensors are fetched when the gradient reaches the
block's output, and those of the ``prefetch_blocks`` offloaded blocks before
it with them, so the copies back overlap this block's backward. The compute
stream waits for a tensor only when backward unpacks it; that wait is timed
(CUDA events on the compute stream), the part of offload's cost that falls
in backward.

Without CUDA the same bookkeeping runs with plain copies (nothing to
overlap): the path is not offered there, but its logic is testable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rematd.client.blocks.host_pool import HostPool, Lease
from rematd.client.blocks.mode_timing import RecomputeTimer
from rematd.client.memory.accounting import tensors_in
from rematd.planner import Mode

log = logging.getLogger("rematd.client")


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadConfig:
    """How blocks in the ``offload`` mode move their saved tensors (``attach(..., offload=...)``)."""

    prefetch_blocks: int = 1
    """Offloaded blocks fetched back ahead of the one whose backward starts: when the gradient reaches a block's
    output, its own tensors and those of this many offloaded blocks before it start coming back. More hides
    slower copies behind more backward, and holds that many blocks' activations on the device at once."""
    min_bytes: int = 64 * 1024
    """Tensors smaller than this stay on the device: a copy's fixed cost outweighs what it frees."""
    pool: bool = True
    """Copy into host buffers reused from step to step (pinned on a device). False: a fresh host tensor per
    saved tensor, every step (on a device, a fresh pinned allocation each time: several times slower)."""

    def __post_init__(self) -> None:
        for name in ("prefetch_blocks", "min_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"offload.{name} must be an integer >= 0; got {value!r}")
        if not isinstance(self.pool, bool):
            raise ValueError(f"offload.pool must be True or False; got {self.pool!r}")


def check_offload(value: object) -> OffloadConfig:
    """``attach``'s ``offload``: an :class:`OffloadConfig`, or None (the defaults)."""
    if value is None:
        return OffloadConfig()
    if isinstance(value, OffloadConfig):
        return value
    raise TypeError(f"offload must be an OffloadConfig or None, got {value!r}")


@dataclass(slots=True, eq=False)
class _Saved:
    """One saved tensor, on the host or on its way back."""

    host: torch.Tensor | None
    """The host copy (None once it has come back: its buffer is the pool's again)."""
    device: torch.device
    lease: Lease | None = None
    offloaded: torch.cuda.Event | None = None
    back: torch.Tensor | None = None
    fetched: torch.cuda.Event | None = None


@dataclass(slots=True, eq=False)
class _Group:
    """One block's saved tensors in one forward."""

    saved: list[_Saved] = field(default_factory=list)
    fetched: bool = False


class Offloader:
    """Saved-tensor hooks that keep blocks' activations in (pinned) host memory between forward and backward."""

    def __init__(self, timer: RecomputeTimer | None = None, config: OffloadConfig | None = None) -> None:
        self.timer = timer
        self.config = config = config or OffloadConfig()
        self.pool = HostPool() if config.pool else None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._groups: list[_Group] = []
        self.used = False
        """Whether some block offloaded since the last step's end, or the pool still owns buffers: whether a
        step's end has anything to let go of (read there at every step, without a call)."""
        self.prefetched = 0
        """Blocks fetched back ahead of their backward (when the gradient reached their output)."""
        self.late = 0
        """Blocks fetched only when backward unpacked their first tensor (nothing to overlap with)."""
        self.kept = 0
        """Tensors left on the device because no host memory could be had for them (pinned memory runs out
        before device memory does on some hosts): the step goes on, holding them as storing would."""

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    @contextmanager
    def block(self) -> Iterator[_Group]:
        """Around one block's forward: what it saves goes to the host. Call :meth:`on_output` with its output."""
        group = _Group()
        ahead = self.config.prefetch_blocks
        earlier = self._groups[max(0, len(self._groups) - ahead) :] if ahead else []
        self._groups.append(group)
        self.used = True
        if len(self._groups) > 4096:
            del self._groups[:2048]  # groups whose backward never ran (evaluation with gradients on)
        min_bytes = self.config.min_bytes

        def pack(t: torch.Tensor) -> Any:
            nbytes = t.numel() * t.element_size()
            if isinstance(t, nn.Parameter) or nbytes < min_bytes or nbytes == 0 or t.is_sparse:
                return t
            if not t.is_contiguous() or t._base is not None:
                return t  # a view: copying it out would not free the memory it shares
            try:
                saved = self._offload(t, nbytes)
            except RuntimeError as err:
                if not self.kept:
                    log.warning("rematd: offload could not get host memory (%s); tensors stay on the device", err)
                self.kept += 1
                return t
            group.saved.append(saved)
            return saved

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, torch.Tensor):
                return x
            assert isinstance(x, _Saved)
            if x.back is None:
                # Not prefetched (the gradient skipped the block's output): fetch now.
                self.late += 1
                self._fetch(group)
                for g in reversed(earlier):
                    self._fetch(g)
            return self._wait(x)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield group

    def on_output(self, group: _Group, output: Any) -> None:
        """Hook the block's outputs: when their gradient arrives, fetch this block's tensors back, and those of
        the ``prefetch_blocks`` blocks before it (whose backward comes next)."""
        ahead = self.config.prefetch_blocks
        index = self._groups.index(group) if group in self._groups else -1
        # Nearest first: the block whose backward comes next is the first the copies bring back.
        earlier = self._groups[max(0, index - ahead) : index][::-1] if ahead and index > 0 else []

        def fetch(grad: torch.Tensor) -> None:
            for g in (group, *earlier):
                if not g.fetched:
                    self.prefetched += 1
                    self._fetch(g)

        outs = [o for o in tensors_in([output]) if o.requires_grad]
        if outs:
            outs[0].register_hook(fetch)

    def _offload(self, t: torch.Tensor, nbytes: int) -> _Saved:
        if not t.is_cuda:
            host, lease = self._host_for(t, nbytes, pinned=False)
            host.copy_(t)
            return _Saved(host=host, device=t.device, lease=lease)
        stream = self._stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host, lease = self._host_for(t, nbytes, pinned=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        if lease is not None:
            lease.last = done
        # The allocator may reuse t's memory only once the side stream has copied it.
        t.record_stream(stream)
        return _Saved(host=host, device=t.device, lease=lease, offloaded=done)

    def _host_for(self, t: torch.Tensor, nbytes: int, *, pinned: bool) -> tuple[torch.Tensor, Lease | None]:
        """Host memory shaped as ``t`` (``nbytes``): a buffer of the pool, or without one a fresh tensor."""
        if self.pool is None:
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=pinned), None
        lease = self.pool.take(nbytes, pinned=pinned)
        return lease.view(t), lease

    def _fetch(self, group: _Group) -> None:
        if group.fetched:
            return
        group.fetched = True
        for s in group.saved:
            if s.back is not None or s.host is None:
                continue
            if s.device.type != "cuda":
                began = time.perf_counter()
                s.back = s.host.to(s.device, copy=True)
                if self.timer is not None:
                    self.timer.add_seconds(Mode.OFFLOAD, time.perf_counter() - began)
                self._give_back(s, None)
                continue
            stream = self._stream(s.device)
            current = torch.cuda.current_stream(s.device)
            with torch.cuda.stream(stream):
                if s.offloaded is not None:
                    stream.wait_event(s.offloaded)
                back = torch.empty_strided(s.host.size(), s.host.stride(), dtype=s.host.dtype, device=s.device)
                back.copy_(s.host, non_blocking=True)
                s.fetched = torch.cuda.Event()
                s.fetched.record(stream)
            # Used on the compute stream: not reusable until that stream is done with it.
            back.record_stream(current)
            s.back = back
            self._give_back(s, s.fetched)
        if group in self._groups:
            self._groups.remove(group)

    def _give_back(self, s: _Saved, after: torch.cuda.Event | None) -> None:
        """The host copy has served: its buffer is the pool's again once the copy back (``after``) is done."""
        s.host = None
        if s.lease is not None and self.pool is not None:
            self.pool.give_back(s.lease, after)
            s.lease = None

    def _wait(self, s: _Saved) -> torch.Tensor:
        back = s.back
        assert back is not None
        if s.fetched is not None:
            current = torch.cuda.current_stream(s.device)
            if self.timer is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(current)
                current.wait_event(s.fetched)
                end.record(current)
                self.timer.add_events(Mode.OFFLOAD, start, end)
            else:
                current.wait_event(s.fetched)
            s.fetched = None
        return back

    def end_step(self) -> None:
        """At a step's end: let go of the groups still listed. Those of a forward whose backward never ran
        (evaluation with gradients on) hold host copies nothing will read; a backward still pending keeps
        its groups through its own graph (the saved-tensor hooks hold them), so it still finds them. The
        pool lets go of buffers no recent step took."""
        self._groups.clear()
        pool = self.pool
        if pool is not None:
            pool.end_step()
        self.used = pool is not None and pool.owned_bytes > 0

    def forget(self) -> None:
        """Drop the groups of a step that failed."""
        self._groups.clear()
