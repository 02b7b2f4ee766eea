"""Whether a database server takes writes, known without waiting for it: a probe write on a thread of its own.

A database that stops answering (a frozen server, a network that drops packets) leaves a write waiting far
longer than a load balancer's readiness probe allows, and every ``/readyz`` that wrote itself would wait with it.
Here one thread writes a probe row every :data:`PROBE_EVERY_S`; readiness reads what it last found, and a probe
that has not come back within :data:`PROBE_TIMEOUT_S` is a failure, said as such.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rematd.server.store.database import why

PROBE_EVERY_S = 1.0
"""Seconds between the end of one probe write and the start of the next."""

PROBE_TIMEOUT_S = 2.0
"""A probe write not back after this many seconds makes the store not ready (``/readyz`` answers 503)."""


class WriteProbe:
    """Runs ``probe`` (a write that raises when it fails) on a daemon thread, from the first :meth:`problem`."""

    def __init__(
        self, probe: Callable[[], None], *, every: float = PROBE_EVERY_S, timeout: float = PROBE_TIMEOUT_S
    ) -> None:
        self._probe = probe
        self.every = every
        self.timeout = timeout
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._since: float | None = None
        """When (monotonic) the probe in flight began; None between probes."""
        self._failure = ""
        self._answered = threading.Event()
        """Set once the first probe came back, either way."""

    def problem(self) -> tuple[str, float | None]:
        """Why the database does not take writes ("" while it does), and since when (monotonic) it has not.
        The first call starts the probes and waits for the first one's answer, :attr:`timeout` at most."""
        with self._lock:
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="rematd-store-probe", daemon=True)
                self._thread.start()
        self._answered.wait(self.timeout)
        since = self._since
        if since is not None and time.monotonic() - since > self.timeout:
            return f"the database has not answered a probe write in {time.monotonic() - since:.1f} s", since
        return self._failure, None

    def late(self) -> str:
        """Why the database is not answering, without waiting: a probe write in flight past the timeout ("" while
        none is)."""
        since = self._since
        if since is not None and time.monotonic() - since > self.timeout:
            return f"the database has not answered a probe write in {time.monotonic() - since:.1f} s"
        return ""

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._since = time.monotonic()
            try:
                self._probe()
            except Exception as err:
                self._failure = why(err)
            else:
                self._failure = ""
            finally:
                self._since = None
                self._answered.set()
            self._closed.wait(self.every)
