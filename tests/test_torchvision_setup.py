"""torch and torchvision load together after ``make setup``, and torchvision's ``nms`` and ``batched_nms`` keep
the boxes a plain greedy suppression keeps: in the user's own scripts (fresh interpreters), not only here.

Where the torchvision installed was built for another torch, set-up installs ``scripts/torchvision_cpu.py``
(a CPU kernel for ``nms``); where it matches, torchvision's own kernel runs. Either way the same is asserted.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "torchvision_cpu.py"


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


def test_the_check_says_torch_and_torchvision_load_together_and_nms_runs() -> None:
    pytest.importorskip("torchvision")
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("torch and torchvision load together, nms runs: ")
    assert "RuntimeWarning" not in out.stderr


def _reference_nms(boxes: list[list[float]], scores: list[float], threshold: float) -> list[int]:
    """Greedy suppression, box by box: the highest score left is kept, and every box overlapping it by more than
    ``threshold`` (intersection over union) is dropped."""
    order = sorted(range(len(boxes)), key=lambda i: -scores[i])
    dropped: set[int] = set()
    keep = []
    for a, i in enumerate(order):
        if i in dropped:
            continue
        keep.append(i)
        ax1, ay1, ax2, ay2 = boxes[i]
        for j in order[a + 1 :]:
            bx1, by1, bx2, by2 = boxes[j]
            inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
            union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
            if inter / union > threshold:
                dropped.add(j)
    return keep


def _reference_batched(boxes: list[list[float]], scores: list[float], classes: list[int], t: float) -> list[int]:
    """Each class's boxes suppressed among themselves only; all kept, by decreasing score."""
    kept: list[int] = []
    for c in sorted(set(classes)):
        members = [i for i, k in enumerate(classes) if k == c]
        kept += [members[i] for i in _reference_nms([boxes[m] for m in members], [scores[m] for m in members], t)]
    return sorted(kept, key=lambda i: -scores[i])


# Boxes on a grid of whole numbers, so that areas and intersections are exact in float32 too: an overlap
# within float32's rounding of a threshold, where a kernel and this reference could honestly differ, cannot occur.
_CASES = """
import json, sys, torch, torchvision
out = []
for seed, n, classes, threshold in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(seed)
    corner = torch.randint(0, 48, (n, 2), generator=g)
    size = torch.randint(1, 24, (n, 2), generator=g)
    boxes = torch.cat([corner, corner + size], 1).float()
    scores = (torch.randperm(n, generator=g).float() + 1) / n  # distinct: which of two tied boxes wins is open
    idxs = torch.randint(0, classes, (n,), generator=g)
    out.append({
        "boxes": boxes.tolist(), "scores": scores.tolist(), "classes": idxs.tolist(), "threshold": threshold,
        "nms": torchvision.ops.nms(boxes, scores, threshold).tolist(),
        "batched": torchvision.ops.batched_nms(boxes, scores, idxs, threshold).tolist(),
        "nms64": torchvision.ops.nms(boxes.double(), scores.double(), threshold).tolist(),
    })
print(json.dumps(out))
"""


def test_nms_and_batched_nms_keep_what_greedy_suppression_keeps() -> None:
    pytest.importorskip("torchvision")
    # Small sets (batched_nms offsets the classes apart) and one past 4000 coordinates on the CPU (it then runs
    # nms class by class).
    cases = [[seed, 60, 3, t] for seed, t in enumerate((0.0, 0.3, 0.5, 0.7, 0.9))] + [[7, 1200, 5, 0.5]]
    out = subprocess.run([sys.executable, "-c", _CASES, json.dumps(cases)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    for case in json.loads(out.stdout):
        boxes, scores, t = case["boxes"], case["scores"], case["threshold"]
        expected = _reference_nms(boxes, scores, t)
        assert case["nms"] == expected, (t, len(boxes))
        assert case["nms64"] == expected, (t, len(boxes))
        assert 0 < len(expected) < len(boxes) or t == 0.9, "a case where suppression decides nothing"
        assert case["batched"] == _reference_batched(boxes, scores, case["classes"], t), (t, len(boxes))


def test_nms_of_nothing_and_of_bad_shapes() -> None:
    pytest.importorskip("torchvision")
    out = _python(
        "import torch, torchvision\n"
        "print(torchvision.ops.nms(torch.zeros(0, 4), torch.zeros(0), 0.5).tolist())\n"
        "torchvision.ops.nms(torch.zeros(3, 5), torch.zeros(3), 0.5)\n"
    )
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
    assert out.returncode != 0 and "RuntimeError" in out.stderr and "4" in out.stderr.splitlines()[-1]


def _fake_torchvision(root: Path, body: str) -> Path:
    pkg = root / "torchvision"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(body), encoding="utf-8")
    return root


def test_the_hook_hides_no_other_error(tmp_path: Path) -> None:
    # A torchvision without its compiled library that fails for a reason of its own: the kernel is defined
    # (the hook installed by set-up, or this script's where set-up installed none), the error still surfaces.
    root = _fake_torchvision(tmp_path, 'raise RuntimeError("something else broke")\n')
    code = f"import runpy; runpy.run_path({str(SCRIPT)!r})['install']()\nimport torchvision"
    out = _python(code, path=root)
    assert out.returncode != 0 and "RuntimeError: something else broke" in out.stderr


def test_an_environment_without_torchvision_passes_the_check(tmp_path: Path) -> None:
    check = runpy.run_path(str(SCRIPT))["check"]
    # The same Python without site-packages: no torchvision to load, so nothing fails to.
    bare = tmp_path / "python-without-site"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n', encoding="utf-8")
    bare.chmod(0o755)
    ok, said = check(str(bare))
    assert ok and said.startswith("torchvision is not installed"), said
