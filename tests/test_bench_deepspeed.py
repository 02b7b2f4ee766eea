"""``python -m bench.deepspeed --quick`` runs end to end on two CPU ranks and reports what docs/deepspeed.md shows."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .distributed import ROOT


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_the_deepspeed_benchmark_runs_and_recomputing_gathers_as_plain_zero3(tmp_path: Path) -> None:
    out = tmp_path / "deepspeed.json"
    # Its own session: on a timeout the launcher and the ranks it started are killed together.
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.deepspeed", "--quick", "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "| released | recompute |" in stdout and "| live | switch |" in stdout
    for rank in json.loads(out.read_text())["ranks"]:
        released, live = rank["configs"]["released"], rank["configs"]["live"]
        assert released["recompute"]["gathers"] == released["plain"]["gathers"], released
        assert released["recompute"]["step_seconds"] > 0 and released["plain"]["step_seconds"] > 0
        # Once traced, the live configuration gathers far less than one gather per use; a switch costs one step.
        plain = live["plain"]["gathers"]
        assert plain[-1] < plain[0], plain
        extra = [k for k, (a, b) in enumerate(zip(live["switch"]["gathers"], plain, strict=True)) if k and a > b]
        assert extra == [2], live  # --quick switches at step 2; the step after it prefetches again
