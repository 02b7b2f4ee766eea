"""``python -m bench.fsdp --quick`` runs end to end on two CPU ranks and reports what docs/benchmarks.md shows."""

from __future__ import annotations

import json
from pathlib import Path

from bench.launch import run_launcher


def test_the_fsdp_benchmark_runs_and_keeps_rematd_under_its_budget(tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    args = ["--quick", "--rounds", "1", "--steps", "1", "--warmup", "1", "--out", str(out)]
    stdout = run_launcher("bench.fsdp", args)
    assert "| rematd |" in stdout and "| full |" in stdout
    report = json.loads(out.read_text())
    for rank in report["ranks"]:
        assert rank["recompute_peak_bytes"] < rank["budget_bytes"] < rank["store_peak_bytes"], rank
        assert all(p <= rank["budget_bytes"] for p in rank["rematd_peaks"]), rank
        assert set(rank["seconds"]) == {"none", "full", "rematd"}
