"""bench.torchtitan's contenders in one process, their steps in turn: each trains as it would alone."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.torchtitan import in_turns, parse, pinned, rematd_peak
from bench.torchtitan_cpu import make_assets
from bench.torchtitan_turns import order


def test_each_round_turns_the_order() -> None:
    names = list("abcd")
    rounds = [order(names, k) for k in range(2 * len(names))]
    assert all(sorted(r) == names for r in rounds), "every contender steps once a round"
    for place in range(len(names)):
        assert {r[place] for r in rounds} == set(names), f"every contender takes place {place} in turn"
    before = {(r[k], r[k + 1]) for r in rounds for k in range(len(names) - 1)}
    assert ("b", "a") in before and ("a", "b") in before, "no contender always steps after the same one"


def test_contenders_in_turns_train_as_they_would_alone(tmp_path: Path) -> None:
    args = parse(["--seq", "64", "--batch", "2", "--steps", "3", "--timeout", "300"])
    contenders = {
        "none": ("torchtitan.train", ["activation-checkpoint:none"]),
        "full": ("torchtitan.train", ["activation-checkpoint:full"]),
        "rematd pinned store": pinned("store"),
        "rematd pinned recompute": pinned("recompute"),
    }
    runs = tmp_path / "runs"
    runs.mkdir()
    done = in_turns(args, make_assets(tmp_path / "assets"), runs, contenders, 3)
    records = {name: ranks[0] for name, ranks in done.items()}
    for name, r in records.items():
        assert len(r["seconds"]) == 3 and all(s > 0 for s in r["seconds"]), name
        assert len(r["peaks"]) == 1, f"{name}: the last step's memory profiled"
    reference = records["none"]["losses"]
    for name, r in records.items():
        # The same computation step for step, though the trainers share the process and take turns.
        assert all(torch.equal(a, b) for a, b in zip(reference, r["losses"], strict=True)), name
    # Pinned to what torchtitan's modes keep, rematd holds what they hold, to the byte.
    assert records["rematd pinned store"]["peaks"] == records["none"]["peaks"]
    assert records["rematd pinned recompute"]["peaks"] == records["full"]["peaks"]
    assert records["full"]["peaks"][0] < records["none"]["peaks"][0]
    assert [s[0]["modes"] for s in records["rematd pinned store"]["steps"]][1:] == [["store"] * 6] * 2
    # The budgets rematd then plans under: the pinned runs' peaks in rematd's own measure, past profiling.
    lean, loose = (rematd_peak(done[f"rematd pinned {pin}"]) for pin in ("recompute", "store"))
    assert 0 < lean < loose
