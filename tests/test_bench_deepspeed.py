"""``python -m bench.deepspeed --quick`` runs end to end on two CPU ranks and reports what docs/deepspeed.md shows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench.launch import run_launcher


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
# Eight ZeRO engines on 2 ranks: about 2 minutes on a quiet 2-core machine, past the default timeout when other
# tests share the cores.
@pytest.mark.timeout(600)
def test_the_deepspeed_benchmark_runs_and_recomputing_gathers_as_plain_zero3(tmp_path: Path) -> None:
    out = tmp_path / "deepspeed.json"
    stdout = run_launcher("bench.deepspeed", ["--quick", "--out", str(out)], env={"DS_ACCELERATOR": "cpu"})
    assert "| released | recompute |" in stdout and "| live | switch |" in stdout
    for rank in json.loads(out.read_text())["ranks"]:
        released, live = rank["configs"]["released"], rank["configs"]["live"]
        assert released["recompute"]["gathers"] == released["plain"]["gathers"], released
        assert released["recompute"]["step_seconds"] > 0 and released["plain"]["step_seconds"] > 0
        # Once traced, the live configuration gathers far less than one gather per use; a switch costs one step.
        plain = live["plain"]["gathers"]
        assert plain[-1] < plain[0], plain
        extra = [k for k, (a, b) in enumerate(zip(live["switch"]["gathers"], plain, strict=True)) if k and a > b]
        # The profiling step recomputes every block, so storing from step 1 is a switch too; --quick switches back
        # at step 2. Each switch costs its own step; the step after it prefetches again.
        assert extra == [1, 2], live
