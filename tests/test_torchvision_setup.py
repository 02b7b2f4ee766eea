"""torch and torchvision load together after ``make setup``: in the user's own scripts, not only in the tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _python(code: str, *, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = None
    if path is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)


def test_a_script_of_the_user_imports_torchvision_timm_and_a_transformers_model() -> None:
    pytest.importorskip("torchvision")
    # A fresh interpreter: nothing of the test suite's own is in it.
    out = _python(
        "import torchvision, timm\n"
        "from transformers import GPT2LMHeadModel\n"
        "print(torchvision.models.resnet18(num_classes=3)(__import__('torch').zeros(2, 3, 32, 32)).shape)"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch.Size([2, 3])" in out.stdout


def test_the_check_says_torch_and_torchvision_load_together() -> None:
    pytest.importorskip("torchvision")
    out = subprocess.run(
        [sys.executable, "-m", "rematd.torchvision_ops", "--check"], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("torch and torchvision load together: ")
    assert "RuntimeWarning" not in out.stderr


def _fake_torchvision(root: Path, body: str) -> Path:
    pkg = root / "torchvision"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(body), encoding="utf-8")
    return root


_IMPORT = "import rematd.torchvision_hook as h; h.install()\nimport torchvision\nprint(torchvision.ok)"


def test_the_hook_declares_the_missing_ops_and_imports_again(tmp_path: Path) -> None:
    # A torchvision whose ops library did not load: it fails as PyPI's does beside torch's CPU build.
    root = _fake_torchvision(
        tmp_path,
        """
        import torch
        try:
            torch.ops.torchvision.nms.default
        except (AttributeError, RuntimeError):
            raise RuntimeError("operator torchvision::nms does not exist")
        ok = "imported"
        """,
    )
    out = _python(_IMPORT, path=root)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr[-2000:]
    # Without the hook (taken out of the import system) it fails, as the user saw.
    out = _python(
        "import sys, rematd.torchvision_hook as h\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, h._Finder)]\n"
        "import torchvision",
        path=root,
    )
    assert out.returncode != 0 and "torchvision::nms does not exist" in out.stderr


def test_the_hook_hides_no_other_error(tmp_path: Path) -> None:
    root = _fake_torchvision(tmp_path, 'raise RuntimeError("something else broke")\n')
    out = _python(_IMPORT, path=root)
    assert out.returncode != 0 and "RuntimeError: something else broke" in out.stderr


def test_an_environment_without_torchvision_passes_the_check(tmp_path: Path) -> None:
    from rematd.torchvision_ops import check

    # The same Python without site-packages: no torchvision to load, so nothing fails to.
    bare = tmp_path / "python-without-site"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n', encoding="utf-8")
    bare.chmod(0o755)
    ok, said = check(str(bare))
    assert ok and said.startswith("torchvision is not installed"), said
