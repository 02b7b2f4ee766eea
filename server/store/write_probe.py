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
        self._stalled_since: float | None = None
        """When (monotonic) the database stopped answering, where a probe gave up after the timeout; None once
        a probe succeeds."""
        self._answered = threading.Event()
        """Set once the first probe came back, either way."""

    def start(self) -> None:
        """Start the probes (once; a closed probe starts none)."""
        with self._lock:
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="rematd-store-probe", daemon=True)
                self._thread.start()

    def problem(self) -> tuple[str, float | None]:
        """Why the database does not take writes ("" while it does), and since when (monotonic) it has not.
        The first call waits for the first probe's answer, :attr:`timeout` at most."""
        self.start()
        self._answered.wait(self.timeout)
        late = self._late()
        if late is not None:
            return late
        return self._failure, None

    def late(self) -> str:
        """Why the database is not answering, without waiting ("" while it answers): a probe write in flight past
        the timeout, or one that gave up after it (a connection attempt that timed out), until a probe succeeds."""
        late = self._late()
        return late[0] if late is not None else ""

    def _late(self) -> tuple[str, float] | None:
        now = time.monotonic()
        stalled, since = self._stalled_since, self._since
        if stalled is None and since is not None and now - since > self.timeout:
            stalled = since
        if stalled is None:
            return None
        return f"the database has not answered a probe write in {now - stalled:.1f} s", stalled

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.is_set():
            began = self._since = time.monotonic()
            try:
                self._probe()
            except Exception as err:
                self._failure = why(err)
                if time.monotonic() - began > self.timeout and self._stalled_since is None:
                    # It gave up only after the database kept it waiting: still not answering, until one succeeds.
                    self._stalled_since = began
            else:
                self._failure = ""
                self._stalled_since = None
            finally:
                self._since = None
                self._answered.set()
            self._closed.wait(self.every)
