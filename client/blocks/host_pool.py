"""Host buffers for offloaded activations, reused from step to step.

Allocating pinned host memory is slow (the driver locks every page of it; freeing it synchronises the device), and
a fresh pinned tensor per saved activation puts that cost, or torch's cache of pinned blocks with each block rounded
up to a power of two, on every step: torchtitan's trainer measured copies into fresh pinned tensors at about a fifth
of the bandwidth of copies into a reused pool. A step of a job saves the same tensors as the step before it, so the
pool's buffers, sized in classes of at most 1/8 (or a 4 KiB page) over the bytes asked for, are taken again each
step and allocated only for a length the job has not run recently.

A buffer lent out comes back with the copy that last uses it (a CUDA event): it is lent again only once that copy
has finished. Buffers no step took for :data:`IDLE_STEPS` step ends are let go, so that a length the job left does
not keep its memory pinned.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol

import torch

IDLE_STEPS = 2
"""Step ends after which a buffer no step took is let go."""


class Done(Protocol):
    """What a copy in flight is known by: a CUDA event, or anything with its ``query``."""

    def query(self) -> bool: ...


def size_class(nbytes: int) -> int:
    """The bytes of the buffer lent for ``nbytes``: rounded up to a multiple of a sixteenth of their power of two
    (4 KiB at least), so that a tensor a little larger than last step's takes the same buffer, with less than an
    eighth of it (or a page) unused."""
    n = max(int(nbytes), 4096)
    step = 1 << max(12, n.bit_length() - 4)
    return -(-n // step) * step


class Lease:
    """One buffer lent out; :meth:`HostPool.give_back` (or its collection) returns it."""

    __slots__ = ("__weakref__", "buffer", "key", "last", "pool", "returned")

    def __init__(self, pool: HostPool, key: tuple[bool, int], buffer: torch.Tensor) -> None:
        self.pool, self.key, self.buffer = pool, key, buffer
        self.returned = False
        self.last: Done | None = None
        """The last copy into or out of the buffer, while it may still run (None: none, or done)."""

    def view(self, like: torch.Tensor) -> torch.Tensor:
        """The buffer's first bytes as a tensor of ``like``'s dtype, sizes and strides (``like`` is dense)."""
        nbytes = like.numel() * like.element_size()
        return self.buffer[:nbytes].view(like.dtype).as_strided(like.size(), like.stride())

    def __del__(self) -> None:
        # Dropped without being given back (a forward whose backward never ran): lent again once the copy that
        # filled it is done.
        if not self.returned:
            # At interpreter exit the pool may be half gone: there is nothing left to return to.
            with contextlib.suppress(Exception):
                self.pool.give_back(self, self.last)


class HostPool:
    """Reused host buffers in size classes, pinned where the copies are a device's."""

    def __init__(self) -> None:
        # Re-entrant: a lease collected by the garbage collector inside the pool's own code gives itself back.
        self._lock = threading.RLock()
        self._free: dict[tuple[bool, int], list[tuple[torch.Tensor, int]]] = {}
        """Buffers ready to lend, by (pinned, bytes), each with the step end it was last given back at."""
        self._pending: list[tuple[Lease, Done]] = []
        """Buffers given back whose last copy may still run."""
        self._ends = 0
        self.fresh = 0
        """Buffers allocated (each one's first lease)."""
        self.reused = 0
        """Leases of a buffer allocated before."""
        self.owned_bytes = 0
        """Bytes of every buffer the pool holds, lent or not."""

    def take(self, nbytes: int, *, pinned: bool) -> Lease:
        """A buffer of at least ``nbytes`` (pinned: page-locked, for a device's asynchronous copies)."""
        key = (pinned, size_class(nbytes))
        with self._lock:
            if self._pending:
                self._reclaim()
            free = self._free.get(key)
            if free:
                buffer, _ = free.pop()
                self.reused += 1
                return Lease(self, key, buffer)
        # Allocated outside the lock: pinning takes milliseconds, and a give-back from autograd's thread waits.
        buffer = torch.empty(key[1], dtype=torch.uint8, pin_memory=pinned)
        with self._lock:
            self.fresh += 1
            self.owned_bytes += key[1]
        return Lease(self, key, buffer)

    def give_back(self, lease: Lease, after: Done | None = None) -> None:
        """``lease``'s buffer may be lent again once ``after`` (the last copy that uses it) is done."""
        with self._lock:
            if lease.returned:
                return
            lease.returned = True
            if after is None or after.query():
                self._ready(lease)
            else:
                self._pending.append((lease, after))

    def _ready(self, lease: Lease) -> None:
        """``lease``'s buffer ready to lend, stamped with this step end (under the lock)."""
        self._free.setdefault(lease.key, []).append((lease.buffer, self._ends))

    def _reclaim(self) -> None:
        pending, self._pending = self._pending, []
        for lease, done in pending:
            if done.query():
                self._ready(lease)
            else:
                self._pending.append((lease, done))

    def end_step(self) -> None:
        """A step ended: buffers no step has taken for :data:`IDLE_STEPS` step ends are let go."""
        if not self.owned_bytes:
            return  # nothing held (a job that offloads nothing pays no more than this look)
        with self._lock:
            self._ends += 1
            self._reclaim()
            for key, free in list(self._free.items()):
                kept = [(b, at) for b, at in free if self._ends - at < IDLE_STEPS]
                self.owned_bytes -= key[1] * (len(free) - len(kept))
                if kept:
                    self._free[key] = kept
                else:
                    del self._free[key]

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers ready to lend."""
        with self._lock:
            return sum(key[1] * len(free) for key, free in self._free.items())
