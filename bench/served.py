"""A ``rematd serve`` subprocess on loopback for the service benchmarks (no torch needed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
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
        assert proc.stdout is not None
        grpc_target = http = None
        lines = []
        while (grpc_target is None or http is None) and (line := proc.stdout.readline()):
            lines.append(line)
            if m := re.search(r"serving gRPC on (\S+)", line):
                grpc_target = m.group(1)
            if m := re.search(r"REST on (https?://[^/\s]+)/", line):
                http = m.group(1)
        if grpc_target is None or http is None:
            raise RuntimeError("rematd serve did not start:\n" + "".join(lines))
        yield Served(proc=proc, grpc=grpc_target, http=http)
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
