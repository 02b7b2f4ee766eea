"""The distributed tests' launcher: a rank's native crash runs the ranks once more, said as a warning with the
rank's log; a second one fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_ranks


def test_ranks_run_again_once_after_a_native_crash_and_say_so(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"ran again after a native crash: rank \d exited -11") as said:
        results = run_ranks("crash_once", tmp_path, world=2, config={})
    assert results == [{"rank": 0}, {"rank": 1}]
    assert "Fatal Python error: Segmentation fault" in str(said[0].message), "the rank's stacks are shown"


def test_a_second_native_crash_fails_the_test(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="exited -11"), pytest.warns(UserWarning, match="native crash"):
        run_ranks("crash_once", tmp_path, world=2, config={"always": True})
