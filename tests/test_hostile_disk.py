"""A failing disk is visible: readiness fails while liveness holds, a metric counts the failed writes, and the
service still shuts down cleanly. The disk fills for real: the server runs under a file-size limit."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx

from rematd import wire
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_service import hello, stats

LIMIT_BYTES = 128 * 1024


def _serve(db: Path, log: Path, limit: int | None, *, liftable: bool = False) -> subprocess.Popen[bytes]:
    """``rematd serve`` whose files may not grow past ``limit``; ``liftable``: a soft limit the test may raise."""

    def limited() -> None:
        if limit is not None:
            # Past it a write fails with EFBIG, as on a full disk (Python ignores SIGXFSZ).
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY if liftable else limit))

    return subprocess.Popen(
        [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0", "--db", str(db)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=limited,
    )


def _addresses(log: Path, proc: subprocess.Popen[bytes]) -> tuple[str, str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        text = log.read_text(errors="replace")
        g, h = re.search(r"serving gRPC on (\S+)", text), re.search(r"REST on https?://([^/\s]+)/", text)
        if g and h:
            return g.group(1), h.group(1)
        time.sleep(0.05)
    raise AssertionError("rematd serve did not start:\n" + log.read_text(errors="replace"))


def _metric(http: str, name: str) -> float:
    body = httpx.get(f"http://{http}/metrics", timeout=10).text
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_full_disk_fails_readiness_counts_failures_and_shuts_down_cleanly(tmp_path: Path) -> None:
    db, log = tmp_path / "r.db", tmp_path / "serve.log"
    proc = _serve(db, log, limit=LIMIT_BYTES)
    try:
        grpc_addr, http = _addresses(log, proc)
        assert httpx.get(f"http://{http}/readyz").json() == {"status": "ready"}
        codes = []
        with grpc.insecure_channel(grpc_addr) as ch:
            stub = pb_grpc.AdvisorStub(ch)
            for k in range(400):
                msgs = [
                    pb.ClientMessage(hello=wire.hello_to_pb(hello(job=f"fill-{k}", n=64))),
                    *(pb.ClientMessage(stats=wire.stats_to_pb(stats(i, 500))) for i in range(5)),
                    pb.ClientMessage(goodbye=pb.Goodbye(reason="done")),
                ]
                try:
                    list(stub.Session(iter(msgs), timeout=10))
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
                # A write that still fits in what is left succeeds: ready until even the probe's does not.
                if codes[-1] == grpc.StatusCode.INTERNAL:
                    ready = httpx.get(f"http://{http}/readyz", timeout=10)
                    if ready.status_code == 503:
                        break
        assert grpc.StatusCode.INTERNAL in codes, "the disk never filled"
        assert ready.status_code == 503, ready.text
        assert "cannot be written" in ready.json()["detail"]
        assert httpx.get(f"http://{http}/healthz").status_code == 200, "alive: restarting would not help"
        assert _metric(http, "rematd_store_write_failures_total") >= 1
        # Reads still answer (without what could not be written).
        assert httpx.get(f"http://{http}/api/v1/jobs", timeout=10).status_code == 200
        before = len(log.read_bytes())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        shutdown = log.read_bytes()[before:].decode(errors="replace")
        assert "Traceback" not in shutdown, shutdown
        # The outage is said in one line per failure, not a traceback each (those are for bugs).
        whole = log.read_text(errors="replace")
        assert "Traceback" not in whole and "the store cannot be written" in whole, whole[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_readiness_comes_back_when_the_disk_does(tmp_path: Path) -> None:
    """A store that failed and takes writes again is found ready by the probe write, without traffic."""
    from rematd.server.store.store import Store

    store = Store(tmp_path / "r.db")
    try:
        store.failing_since = time.monotonic()
        store.last_failure = "database or disk is full"
        assert store.writable(probe_every=0.0)
        assert store.failing_since is None
    finally:
        store.close()
