"""The server side of the load bench: a ``rematd serve`` subprocess on loopback, and what it uses.

The server's CPU and memory are read from ``/proc`` for its whole process tree
(``--workers`` processes and the parent that supervises them).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def proc_tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    out.extend(proc_tree(int(child)))
    except OSError:
        pass
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
            total += int(m.group(1)) * 1024 if m else 0
        except OSError:
            pass
    return total


@dataclass(frozen=True, slots=True)
class Usage:
    """The server's CPU over a window and its memory at the window's end."""

    cores: float
    rss_bytes: int
    cores_by_process: tuple[float, ...]
    """Each process's share, busiest first: a worker left idle shows here (its ranks went elsewhere)."""


class UsageWindow:
    """Opened before a measurement and closed after it: the server tree's CPU in between. With ``signal``,
    each server process is sent SIGUSR2 as it opens and SIGUSR1 as it closes (``bench.load_probe``)."""

    def __init__(self, pid: int, *, signal_processes: bool = False) -> None:
        self.pid = pid
        self.signal_processes = signal_processes
        if signal_processes:
            _signal_all(proc_tree(pid), signal.SIGUSR2)
        self._cpu0 = {p: cpu_seconds([p]) for p in proc_tree(pid)}
        self._t0 = time.monotonic()

    def close(self) -> Usage:
        pids = proc_tree(self.pid)
        if self.signal_processes:
            _signal_all(pids, signal.SIGUSR1)
        took = max(1e-9, time.monotonic() - self._t0)
        each = sorted(((cpu_seconds([p]) - self._cpu0.get(p, 0.0)) / took for p in pids), reverse=True)
        return Usage(cores=sum(each), rss_bytes=rss_bytes(pids), cores_by_process=tuple(round(c, 2) for c in each))


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


@dataclass
class Server:
    proc: subprocess.Popen[str]
    target: str
    output: collections.deque[str]

    def stop(self) -> None:
        """SIGTERM to the server's process group (its workers too), SIGKILL if it has not gone in 30 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def start_server(
    db: Path | str,
    workers: int,
    report_interval: float,
    *,
    python: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Server:
    """``rematd serve`` on a free loopback port, with ``--workers`` processes; ``python`` is the command that
    runs the ``rematd`` CLI (by default this interpreter's ``-m rematd.server.cli``), ``env`` added to its
    environment."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cmd = [
        *(python or (sys.executable, "-m", "rematd.server.cli")), "serve", "--grpc-port", str(port), "--http-port", "0",
        "--db", str(db), "--log-level", "warning", "--workers", str(workers),
        "--max-report-interval-seconds", str(report_interval),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    server = Server(proc, f"127.0.0.1:{port}", collections.deque(maxlen=40))
    serving = threading.Event()

    def drain() -> None:  # a full pipe would stall the server; the tail is kept for when it dies
        assert proc.stdout is not None
        for line in proc.stdout:
            server.output.append(line)
            if "serving gRPC on" in line:
                serving.set()

    threading.Thread(target=drain, daemon=True).start()
    if not serving.wait(60) or proc.poll() is not None:
        server.stop()
        raise RuntimeError("rematd serve did not start:\n" + "".join(server.output))
    # Only worker 0 says it serves. The kernel spreads connections over the sockets listening when they
    # connect: a worker that binds after the generators' channels have connected gets none of their ranks.
    deadline = time.monotonic() + 60
    while listeners(port) < workers:
        if time.monotonic() > deadline or proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"{listeners(port)} of {workers} workers listen:\n" + "".join(server.output))
        time.sleep(0.1)
    return server


def listeners(port: int) -> int:
    """Sockets listening on ``port`` (one per worker process with SO_REUSEPORT)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                n += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port
    return n
