"""bench.offload_copies: offload's copies out and back, into fresh host tensors and into its reused pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import offload_copies


def test_the_quick_run_times_each_way_and_the_pool_allocates_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "copies.json"
    offload_copies.main(["--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = {row["way"]: row for row in report["rows"]}
    assert set(rows) == {"fresh", "pool"}, "no device: no pageable way beside the pinned ones"
    assert all(row["step_ms"] > 0 and row["gb_per_s"] > 0 for row in rows.values())
    assert rows["pool"]["x_pool"] == 1.0
    # The warm-up step allocates the 8 buffers; each of the 3 timed steps takes them again.
    assert report["pool"]["fresh"] == 8 and report["pool"]["reused"] == 3 * 8
    printed = capsys.readouterr().out
    assert "host to host" in printed and "fresh" in printed and "x pool" in printed


def test_bad_sizes_are_refused_naming_them() -> None:
    with pytest.raises(SystemExit):
        offload_copies.parse_args(["--tensors", "0"])
