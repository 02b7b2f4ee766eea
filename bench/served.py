"""A ``rematd serve`` subprocess on loopback for the service benchmarks (no torch needed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


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


@contextmanager
def served(db: Path, *args: str) -> Iterator[Served]:
    """``rematd serve`` on ports it picks itself, stopped (SIGTERM, then SIGKILL) on the way out."""
    command = [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0"]
    proc = subprocess.Popen(
        [*command, "--db", str(db), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        grpc_target, http = addresses(proc)
        yield Served(proc=proc, grpc=grpc_target, http=f"http://{http}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
