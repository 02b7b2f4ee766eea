"""``python -m bench.compress --quick`` runs end to end and reports every format for both models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .distributed import ROOT


def test_the_compress_benchmark_runs_and_reports_each_format(tmp_path: Path) -> None:
    out = tmp_path / "compress.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.compress",
            "--quick",
            "--steps",
            "3",
            "--time-width",
            "64",
            "--time-steps",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "gpt:" in proc.stdout and "llama:" in proc.stdout
    report = json.loads(out.read_text())
    assert [m["model"] for m in report["models"]] == ["gpt", "llama"]
    for model in report["models"]:
        rows = {r["format"]: r for r in model["rows"]}
        assert set(rows) == {"int8", "fp8", "bf16"}
        for fmt, row in rows.items():
            assert row["block_bytes_vs_store"] < (0.35 if fmt != "bf16" else 0.6), (model["model"], row)
            assert row["grad_cosine"] > 0.999 and 0 < row["grad_rel_error"] < 0.03, (model["model"], row)
    timing = report["timing"]
    assert timing["width"] == 64 and set(timing["models"]) == {"gpt", "llama"}
    for rows in timing["models"].values():
        assert [r["format"] for r in rows] == ["int8", "fp8", "bf16"]
        assert all(r["time_vs_store"] > 0 and r["step_ms"] > 0 for r in rows)
