"""Starting a launcher (torchrun, or a benchmark that starts ranks of its own) from the repository's root, joined
with a timeout: the benchmarks that run others, and the tests that run the benchmarks, use it alike."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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
