"""``/metrics`` rendered at most once per interval, whatever the number of scrapers.

Rendering is pure Python under the interpreter's lock: at 1,000 jobs a scrape is about 1 MiB, and 16
scrapers rendering at once on worker threads starved the event loop that serves the training ranks'
streams and ``/healthz`` (``/healthz`` p50 193-328 ms, max 1.5 s). Here one render is shared: a scrape
that finds a body younger than ``seconds`` gets it as it is, and scrapes that arrive while one renders
wait for that render instead of starting their own. The gzip form (what Prometheus asks for) is made
in the same render, off the loop.
"""

from __future__ import annotations

import asyncio
import gzip
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

DEFAULT_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class Body:
    """One render: the exposition text, plain and gzipped, and when it was rendered (monotonic)."""

    plain: bytes
    gzipped: bytes
    rendered_at: float


def _render(registry: CollectorRegistry) -> Body:
    at = time.monotonic()
    plain = generate_latest(registry)
    # Level 1: a tenth of the size for a few milliseconds; higher levels cost more than they save here.
    return Body(plain=plain, gzipped=gzip.compress(plain, compresslevel=1), rendered_at=at)


class Scrape:
    """The registry's latest render, reused for ``seconds``; one render at a time, on a worker thread."""

    def __init__(self, registry: CollectorRegistry, seconds: float = DEFAULT_SECONDS) -> None:
        if not seconds >= 0:
            raise ValueError(f"metrics_cache_seconds must be >= 0, got {seconds!r}")
        self.registry = registry
        self.seconds = seconds
        self.renders = 0
        """Renders since start (what the cache saved shows against the scrapes served)."""
        self._body: Body | None = None
        self._lock: asyncio.Lock | None = None

    def _fresh(self) -> Body | None:
        body = self._body
        if body is not None and time.monotonic() - body.rendered_at < self.seconds:
            return body
        return None

    async def body(self) -> Body:
        """A render at most ``seconds`` old (with ``seconds`` 0: one begun after this call, or shared with
        scrapes that waited for the same one)."""
        body = self._fresh()
        if body is not None:
            return body
        if self._lock is None:
            self._lock = asyncio.Lock()
        asked = time.monotonic()
        async with self._lock:
            body = self._body
            # A render that began after this scrape asked is as fresh as one of its own.
            if body is not None and (body.rendered_at >= asked or self._fresh() is not None):
                return body
            body = await asyncio.to_thread(_render, self.registry)
            self._body = body
            self.renders += 1
            return body
