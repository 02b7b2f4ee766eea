"""A benchmark stopped with ``kill`` stops the ``rematd serve`` it started: the service does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from bench.launch import ROOT

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from bench.served import served

    with served(sys.argv[1]) as srv:
        print(srv.proc.pid, flush=True)
        time.sleep(120)
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child not yet reaped by its parent is a zombie: as good as gone.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][:1] != "Z"


def test_a_sigterm_to_the_benchmark_stops_its_service(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "bench.db")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    server = 0
    try:
        assert bench.stdout is not None
        server = int(bench.stdout.readline())
        assert alive(server)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 20
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(server), "the service outlived the benchmark that started it"
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(10)
        if server and alive(server):
            os.kill(server, signal.SIGKILL)
        if bench.stdout is not None:
            bench.stdout.close()
