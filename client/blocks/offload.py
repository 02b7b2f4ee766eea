"""Offload: a block's saved activations go to host memory on a side stream, and come back before its
backward needs them.

Copies out start as each tensor is saved and run on a side stream, so the
block's forward goes on while they do; the device memory is handed back to
the allocator once the copy is done (``record_stream``). Coming back, each
block's tensors are fetched when the gradient reaches the block's output,
and the previous block's with them, so the copy of the next block back
overlaps this block's backward. The compute stream waits for a tensor only
when backward unpacks it; that wait is timed (CUDA events on the compute
stream), the part of offload's cost that falls in backward.

Without CUDA the same bookkeeping runs with plain copies (nothing to
overlap): the path is not offered there, but its logic is testable.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rematd.client.blocks.mode_timing import RecomputeTimer
from rematd.client.memory.accounting import tensors_in
from rematd.planner import Mode

# Tensors smaller than this stay on the device: a copy's fixed cost outweighs what it frees.
MIN_BYTES = 64 * 1024


@dataclass(slots=True, eq=False)
class _Saved:
    """One saved tensor, on the host or on its way back."""

    host: torch.Tensor
    device: torch.device
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

    def __init__(self, timer: RecomputeTimer | None = None) -> None:
        self.timer = timer
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._groups: list[_Group] = []
        self.prefetched = 0
        """Blocks fetched back ahead of their backward (when the gradient reached their output)."""
        self.late = 0
        """Blocks fetched only when backward unpacked their first tensor (nothing to overlap with)."""

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    @contextmanager
    def block(self) -> Iterator[_Group]:
        """Around one block's forward: what it saves goes to the host. Call :meth:`on_output` with its output."""
        group = _Group()
        previous = self._groups[-1] if self._groups else None
        self._groups.append(group)
        if len(self._groups) > 4096:
            del self._groups[:2048]  # groups whose backward never ran (evaluation with gradients on)

        def pack(t: torch.Tensor) -> Any:
            if isinstance(t, nn.Parameter) or t.numel() * t.element_size() < MIN_BYTES or t.is_sparse:
                return t
            if not t.is_contiguous() or t._base is not None:
                return t  # a view: copying it out would not free the memory it shares
            saved = self._offload(t)
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
                if previous is not None:
                    self._fetch(previous)
            return self._wait(x)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield group

    def on_output(self, group: _Group, output: Any, previous_too: bool = True) -> None:
        """Hook the block's outputs: when their gradient arrives, fetch this block's tensors back, and the
        block's before it (whose backward comes next)."""
        index = self._groups.index(group) if group in self._groups else -1
        earlier = self._groups[index - 1] if previous_too and index > 0 else None

        def fetch(grad: torch.Tensor) -> None:
            for g in (group, earlier):
                if g is not None and not g.fetched:
                    self.prefetched += 1
                    self._fetch(g)

        outs = [o for o in tensors_in([output]) if o.requires_grad]
        if outs:
            outs[0].register_hook(fetch)

    def _offload(self, t: torch.Tensor) -> _Saved:
        if not t.is_cuda:
            host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")
            host.copy_(t)
            return _Saved(host=host, device=t.device)
        stream = self._stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        # The allocator may reuse t's memory only once the side stream has copied it.
        t.record_stream(stream)
        return _Saved(host=host, device=t.device, offloaded=done)

    def _fetch(self, group: _Group) -> None:
        if group.fetched:
            return
        group.fetched = True
        for s in group.saved:
            if s.back is not None:
                continue
            if s.device.type != "cuda":
                began = time.perf_counter()
                s.back = s.host.to(s.device, copy=True)
                if self.timer is not None:
                    self.timer.add_seconds(Mode.OFFLOAD, time.perf_counter() - began)
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
        if group in self._groups:
            self._groups.remove(group)

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
        its groups through its own graph (the saved-tensor hooks hold them), so it still finds them."""
        self._groups.clear()

    def forget(self) -> None:
        """Drop the groups of a step that failed."""
        self._groups.clear()
