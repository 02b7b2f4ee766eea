"""bench.mode_prices: each mode's price from the profile beside what pinned steps measure it adds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import mode_prices


def test_the_quick_run_prices_and_measures_every_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prices.json"
    assert mode_prices.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {row["mode"]: row for row in report["rows"]}
    assert {"store", "selective", "titan", "attention", "mlp", "recompute"} <= set(rows)
    assert rows["store"]["priced_ms_per_block"] == 0 and rows["store"]["measured_ms_per_block"] == 0
    assert rows["recompute"]["priced_ms_per_block"] > 0 and rows["recompute"]["priced_share"] == 1.0
    # On the CPU the checkpoint's own work is a share of every checkpointing mode's price, and of no other.
    assert rows["store"]["fixed_ms_per_block"] == 0
    assert 0 < rows["recompute"]["fixed_ms_per_block"] <= rows["recompute"]["priced_ms_per_block"]
    assert 0 < rows["mlp"]["fixed_ms_per_block"] <= rows["recompute"]["fixed_ms_per_block"]
    assert all(row["step_ms"] > 0 for row in rows.values())
    assert report["setup"]["layers"] == 2 and report["profiled_forward_ms_per_block"] > 0
    printed = capsys.readouterr().out
    assert "priced / recompute" in printed and "checkpoint's own" in printed and "selective" in printed


def test_bad_sizes_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        mode_prices.parse_args(["--layers", "0"])
    assert "--layers must be at least 1" in capsys.readouterr().err
