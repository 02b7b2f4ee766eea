"""A ``rematd serve`` subprocess on loopback for the service benchmarks (no torch needed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Served:
    proc: subprocess.Popen[str]
    grpc: str
    """The gRPC target, ``host:port``."""
    http: str
    """The HTTP base URL, ``http://host:port``."""


def addresses(proc: subprocess.Popen[str], timeout: float = 60.0) -> tuple[str, str]:
    """The gRPC and HTTP addresses (``host:port``) a starting ``rematd serve`` prints; RuntimeError with its
    output if none."""
    grpc_addr = http_addr = None
    deadline = time.monotonic() + timeout
    lines = []
    assert proc.stdout is not None
    while time.monotonic() < deadline and (grpc_addr is None or http_addr is None):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"serving gRPC on (\S+)", line):
            grpc_addr = m.group(1)
        if m := re.search(r"REST on https?://([^/\s]+)/", line):
            http_addr = m.group(1)
    if grpc_addr is None or http_addr is None:
        raise RuntimeError("rematd serve did not start:\n" + "".join(lines))
    return grpc_addr, http_addr


def launch(
    db: Path | str,
    *args: str,
    grpc_port: int = 0,
    http_port: int = 0,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> Served:
    """Start ``rematd serve`` (port 0: one it picks itself; ``env`` added to this process's environment)
    and read the addresses it prints; the caller stops it (:func:`stop`). Killed if it does not start."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "rematd.server.cli", "serve"),
            *("--grpc-port", str(grpc_port), "--http-port", str(http_port), "--db", str(db), *args),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    try:
        grpc_target, http = addresses(proc, timeout)
    except RuntimeError:
        stop(proc)
        raise
    return Served(proc=proc, grpc=grpc_target, http=f"http://{http}")


@contextmanager
def served(db: Path | str, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> Iterator[Served]:
    """:func:`launch` on ports it picks itself, stopped on the way out, a SIGTERM to this process included (a
    benchmark stopped with ``kill`` leaves no service behind)."""
    srv = launch(db, *args, timeout=timeout, env=env)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield srv
    finally:
        stop(srv.proc)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    # Python's default for SIGTERM ends the process without running ``finally`` blocks: the server would outlive it.
    raise SystemExit(128 + signum)


def stop(proc: subprocess.Popen[Any], grace: float = 15) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it lingers past ``grace`` seconds; closes its output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()
