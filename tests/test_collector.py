"""The service's collection pacing: sessions' objects frozen once arrivals settle, thawed for a full collection."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from rematd.server.runtime.gc_schedule import Collections


class _Node:
    def __init__(self) -> None:
        self.payload = bytearray(1 << 16)
        self.other: _Node | None = None


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    gc.collect()
    yield
    gc.unfreeze()


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


def test_sessions_are_frozen_once_arrivals_settle() -> None:
    async def go() -> tuple[int, int, int]:
        c = Collections(settle=0.05, freeze_every=10.0)
        kept = [_Node() for _ in range(100)]
        before = gc.get_freeze_count()
        for _ in range(3):  # arrivals keep the freeze waiting
            c.opened()
            await asyncio.sleep(0.02)
        waiting = c.freezes
        await asyncio.sleep(0.15)
        del kept
        return before, waiting, c.freezes

    before, waiting, after = asyncio.run(go())
    assert waiting == 0 and after == 1
    assert gc.get_freeze_count() > before


def test_a_full_collection_reaches_frozen_garbage() -> None:
    async def go() -> tuple[bool, bool, int]:
        c = Collections(interval=0.0, full_after_bytes=1000, settle=0.01)
        held = [_cycle()]
        ref = weakref.ref(held[0])
        c.opened()
        await asyncio.sleep(0.05)
        assert c.freezes == 1
        held.clear()  # frozen, then garbage: young collections no longer see it
        c.request(10)
        await asyncio.sleep(0.05)
        alive_after_young = ref() is not None
        c.request(1000)
        await asyncio.sleep(0.05)
        return alive_after_young, ref() is None, c.full

    alive_after_young, gone, full = asyncio.run(go())
    assert alive_after_young, "a young collection reached a frozen object"
    assert gone and full == 1
    assert gc.get_freeze_count() > 0, "what survived the full collection is frozen again"


def test_what_a_burst_leaves_below_the_full_threshold_is_collected_once_streams_stop_ending() -> None:
    async def go() -> tuple[bool, bool, int, int]:
        c = Collections(interval=0.0, full_after_bytes=16 << 20, quiet=0.1, quiet_after_bytes=1 << 20)
        held = [_cycle()]
        ref = weakref.ref(held[0])
        gc.collect()  # the cycle survives into the oldest generation, which young collections never visit
        held.clear()
        for _ in range(3):  # a burst: streams of 1 MiB messages ending one after another, far below 16 MiB
            c.request(1 << 20)
            await asyncio.sleep(0.03)
        during = ref() is not None
        await asyncio.sleep(0.3)
        # Small streams (a rank's ordinary traffic) do not call for it.
        quiet = Collections(interval=0.0, quiet=0.05)
        quiet.request(4096)
        await asyncio.sleep(0.2)
        return during, ref() is None, c.full, quiet.full

    during, gone, full, small = asyncio.run(go())
    assert during, "not collected while streams keep ending"
    assert gone and full == 1, "collected once they stopped"
    assert small == 0
