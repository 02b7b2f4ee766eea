"""FSDP2 on a real GPU (world size 1): the plan at a new length fits on the first try, FSDP's memory included.
Skipped without CUDA; the CPU accounting path has its own test (tests/test_fsdp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .distributed import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_first_step_at_a_new_length_fits_under_fsdp2(tmp_path: Path) -> None:
    (r,) = run_ranks("fsdp_cuda", tmp_path, world=1, config={}, timeout=600)
    assert r["measured"]["STORE"] > r["budget"] > r["measured"]["RECOMPUTE"], r
    assert max(r["short"][2:]) <= r["budget"], r
    assert r["first_long"] <= r["budget"], r
    assert "RECOMPUTE" in r["modes"] or "SELECTIVE" in r["modes"], r
