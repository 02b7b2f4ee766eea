"""The load bench end to end on a few ranks: a real ``rematd serve``, real generator processes, its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import load
from bench.load_gen import PEAK_BYTES, _Reports
from bench.load_report import Level, markdown


def test_a_hand_encoded_report_parses_as_the_proto_says() -> None:
    from rematd.v1 import advisor_pb2 as pb

    msg = pb.ClientMessage.FromString(_Reports().encode(step=7, steps=3, plan_version=5))
    assert (msg.stats.step, msg.stats.steps, msg.stats.plan_version) == (7, 3, 5)
    assert PEAK_BYTES <= msg.stats.peak_allocated_bytes < PEAK_BYTES + (1 << 20)


def test_to_limit_adds_levels_up_to_its_maximum() -> None:
    p = load._parser()
    args = p.parse_args(["--ranks", "100,200", "--to-limit", "--limit-step", "150", "--limit-max", "600"])
    assert load._levels(p, args) == [100, 200, 350, 500]
    with pytest.raises(SystemExit):
        load._levels(p, p.parse_args(["--ranks", "200,100"]))


def test_the_curve_runs_and_stops_past_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "load.json"
    # A target no level can meet: the listed levels all run, the limit search stops at the first.
    argv = ["--ranks", "6,12", "--to-limit", "--limit-step", "6", "--limit-max", "30", "--p99-ms", "0.0001"]
    argv += ["--seconds", "2", "--settle", "0", "--workers", "1", "--clients", "1", "--probe", "--out", str(out)]
    assert load.main(argv) == 0
    got = json.loads(out.read_text())
    levels = got["levels"]
    assert [r["ranks"] for r in levels] == [6, 12]
    for r in levels:
        assert r["live"] == r["ranks"] and r["errors"] == 0 and r["acked"] > 0
        # The maximum is rounded to 0.1 ms and the percentiles to 0.01 ms: 0.05 + 0.005 apart at most.
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] + 0.06
        assert r["gen_cpu_cores"] > 0 and r["server_cpu_cores"] > 0
        assert not r["latency_ok"] and not r["ok"]
        # The server's loop was watched (bench.load_probe): a 10 ms sleep wakes late by something, not by seconds.
        assert 0 <= r["server_loop_p99_ms"] <= r["server_loop_max_ms"] < 2000
        assert r["server_gc_max_ms"] >= 0 and isinstance(r["server_stalls"], list)
    assert got["highest_within_latency_ranks"] == 0
    printed = capsys.readouterr().out
    assert "stopping: 12 ranks are past" in printed
    assert markdown([Level(**r) for r in levels]) in printed
