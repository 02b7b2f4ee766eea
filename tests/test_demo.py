"""``rematd demo``, briefly: the plan tightens as sequences grow and loosens when they shrink."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from rematd.cli import demo
from rematd.planner import MODE_LETTERS

from .helpers import live_server

# Two steps each at 64, 160, 256 and 64 tokens. 48 MiB holds the short steps' activations, not the long ones'.
BRIEF = ("--steps", "8", "--budget-mib", "48", "--sync")
LETTERS = re.escape("".join(MODE_LETTERS.values()))
LINE = re.compile(rf"^\s*(\d+)\s+(\d+)\s+([{LETTERS}]+)\s+v(\d+)\s+\S+\s+(\S+)\s+(\S+)\s+(\d+|-)\s")


def run_demo(capsys: pytest.CaptureFixture[str], *args: str) -> list[tuple[int, int, str, str, int, float, float]]:
    """Run ``rematd demo`` (in this process: it saves starting torch again); its per-step lines as
    (step, seq, modes, every, plan version, peak MiB, budget MiB)."""
    assert demo.main(list(args)) == 0
    out = capsys.readouterr().out
    assert re.search(r"step\s+seq\s+modes\s+plan\s+pred MiB\s+peak MiB\s+budget\s+every\s+sec", out), out
    rows = []
    for line in out.splitlines():
        if m := LINE.match(line):
            rows.append((int(m[1]), int(m[2]), m[3], m[7], int(m[4]), float(m[5]), float(m[6])))
    steps = int(args[args.index("--steps") + 1])
    assert [r[0] for r in rows] == list(range(steps)), out
    return rows


def kept_less(modes: str) -> int:
    return sum(c != "." for c in modes)


def test_the_demo_tightens_for_long_sequences_and_loosens_after_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = run_demo(capsys, *BRIEF, "--no-serve", "--http-port", "0", "--db", str(tmp_path / "demo.db"))
    by_seq = {seq: modes for _, seq, modes, *_ in rows[2:]}
    # Tightened as they grew: checkpointing at the long lengths, more whole blocks recomputed at the longest (the
    # count of blocks that keep less is no measure: a block's part recomputed keeps less than storing, more than
    # the whole block recomputed), every step within the budget.
    assert kept_less(by_seq[160]) > kept_less(by_seq[64]) == 0, rows
    assert by_seq[256].count("R") >= by_seq[160].count("R") > 0, rows
    assert all(peak <= budget for *_, peak, budget in rows), rows
    assert kept_less(rows[-1][2]) < kept_less(rows[-3][2]), rows  # loosened when they shrank
    for _, _, modes, every, *_ in rows:
        if set(modes) == {"R"}:
            assert every == "1"
        elif "R" not in modes or set(modes) - {"R", "."}:
            assert every == "-"


def test_the_demo_trains_against_a_service_named_with_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with live_server(tmp_path) as srv:
        # One step at each length: enough for the service's plans to show.
        rows = run_demo(capsys, "--steps", "4", "--budget-mib", "48", "--sync", "--server", srv.grpc, "--job", "remote")
        assert max(row[4] for row in rows) >= 1, rows
        plans = httpx.get(f"{srv.url}/api/v1/jobs/remote/plans", timeout=10).json()["plans"]
        assert plans and plans[-1]["version"] >= max(row[4] for row in rows), plans


def test_the_demo_help_is_plain_text_and_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        demo.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and "rematd demo: a small GPT trains on the CPU" in out, out
    unexplained = [a.option_strings for a in demo._parser()._actions if not a.help]
    assert unexplained == [], f"options without help: {unexplained}"
    assert "--job JOB             the job's name" in out, out
