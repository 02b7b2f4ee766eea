"""The database server's probe: a database that keeps a probe waiting past the timeout reads as not answering
for as long as it is away, also when the probe gives up on it (a connection attempt that timed out), until a
probe succeeds; a probe that fails at once is a failure, not a stall."""

from __future__ import annotations

import threading
import time

from rematd.server.store.write_probe import WriteProbe


def _until(check: object, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.01)


def test_a_probe_that_gave_up_after_the_timeout_keeps_the_database_late_until_one_succeeds() -> None:
    frozen = threading.Event()
    frozen.set()
    calls = []

    def probe() -> None:
        calls.append(time.monotonic())
        if frozen.is_set():
            time.sleep(0.3)  # past the timeout, then gives up as a connect timeout does
            raise OSError("connection timeout expired")

    p = WriteProbe(probe, every=0.02, timeout=0.1)
    try:
        p.start()
        _until(lambda: p.late() != "")
        seen = len(calls)
        _until(lambda: len(calls) >= seen + 2)  # probes gave up and started again
        for _ in range(20):
            assert "has not answered a probe write" in p.late()
            time.sleep(0.01)
        assert "has not answered" in p.problem()[0]
        frozen.clear()
        _until(lambda: p.late() == "")
        assert p.problem() == ("", None)
    finally:
        p.close()


def test_a_probe_that_fails_at_once_is_a_failure_not_a_stall() -> None:
    def probe() -> None:
        raise OSError("too many clients already")

    p = WriteProbe(probe, every=0.02, timeout=0.5)
    try:
        assert "too many clients" in p.problem()[0]
        assert p.late() == ""
    finally:
        p.close()
