"""Starting a launcher (torchrun, or a benchmark that starts ranks of its own) from the repository's root, joined
with a timeout: the benchmarks that run others, and the tests that run the benchmarks, use it alike."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import warm

ROOT = Path(__file__).resolve().parent.parent


def run_launcher(
    module: str,
    args: list[str],
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    with_stderr: bool = False,
) -> str:
    """Run ``python -m <module> <args>`` (a launcher that starts ranks of its own); its standard output (and
    after it its standard error, ``with_stderr``).

    It runs in a session of its own: on a timeout the launcher and the ranks it started are killed together."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    return f"{stdout}\n{stderr}" if with_stderr else stdout


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    ranks: int, module: str, args: list[str], *, timeout: float = 300.0, env: dict[str, str] | None = None
) -> str:
    """Run ``python -m <module> <args>`` as ``ranks`` local ranks of one process group, without torchrun's agent
    (it costs each launch seconds, its own start-up and its rendezvous): each rank gets the environment torchrun
    gives (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and a free
    ``MASTER_PORT`` on 127.0.0.1). As torchrun does, a rank that fails stops the others; so does the timeout.
    The ranks' standard output, rank by rank."""
    common = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    common.update(WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0")
    with tempfile.TemporaryDirectory(prefix="rematd-ranks-") as tmp:
        logs = [(Path(tmp) / f"out{r}", Path(tmp) / f"err{r}") for r in range(ranks)]
        procs = []
        for rank, (out, err) in enumerate(logs):
            env_rank = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(warm.start(module, args, env=env_rank, cwd=ROOT, stdout=out, stderr=err))
        in_time = warm.wait_all(procs, timeout, stop_on_failure=True)
        codes = [p.returncode for p in procs]
        stdout = "".join(out.read_text() for out, _ in logs)
        if any(codes):
            tails = "".join(
                f"--- rank {r} (exit {c}):\n{err.read_text()[-3000:]}"
                for r, ((_, err), c) in enumerate(zip(logs, codes, strict=True))
            )
            timed_out = "" if in_time else " (killed at the timeout)"
            raise AssertionError(
                f"python -m {module} failed on {ranks} ranks{timed_out}: exit codes {codes}\n{stdout[-2000:]}{tails}"
            )
        return stdout
