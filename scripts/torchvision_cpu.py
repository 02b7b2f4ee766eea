"""torchvision's box NMS on torch's CPU build, where the torchvision installed was built for another torch.

``make setup`` installs torch's CPU build on a machine without an NVIDIA GPU. The torchvision built for it comes
from PyTorch's own index (download.pytorch.org); where that cannot be reached, pip takes PyPI's torchvision,
which is built against torch's CUDA build: its compiled ops library (``torchvision/_C.so``) does not load beside
the CPU build, and ``import torchvision`` fails (``operator torchvision::nms does not exist``), and with it
``timm`` and the parts of ``transformers`` that reach for it.

When its library does not load, this module defines torchvision's ``nms`` with a CPU kernel written in torch
(the same greedy suppression as torchvision's C++ kernel, in the boxes' own dtype) before torchvision runs, so
that ``import torchvision`` works and so do ``torchvision.ops.nms`` and ``batched_nms``. ``qnms`` is declared
(torchvision registers a shape function for it at import) without a kernel; every other compiled op (RoI
align and pooling, deformable convolution, rotated box IoU, image decoding) still fails with torchvision's
own message. A torchvision whose library loads is left alone.

It lives outside the package: set-up copies it into the environment's site-packages with a ``.pth`` file that
calls :func:`install` at every start of Python, which only adds an import hook (torch is imported when
torchvision is). ``python scripts/torchvision_cpu.py --check`` says whether torchvision loads and its ``nms``
runs; ``--install`` installs it into the running Python's environment and checks again. Standard library only
at import: torch is imported inside the functions that need it.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

MODULE = "torchvision_cpu"
"""The name this file is installed under in site-packages."""
PTH_NAME = "torchvision_cpu.pth"
STALE_PTH = ("rematd_torchvision_ops.pth",)
""".pth files of earlier set-ups that imported a hook from the package, which no longer holds it."""

_LIBS: list[Any] = []  # the definitions live as long as their library objects


def _nms(dets: Any, scores: Any, iou_threshold: float) -> Any:
    """Indices of the boxes kept, by decreasing score: torchvision's CPU kernel (``nms_kernel.cpp``) in torch.

    Boxes are taken by decreasing score (a stable sort, as there); each one kept suppresses every later box whose
    intersection over union with it exceeds ``iou_threshold``, computed in the boxes' dtype in the same order of
    operations, so the same boxes are kept."""
    import torch

    if dets.dim() != 2 or dets.size(1) != 4:
        raise RuntimeError(f"boxes should be a 2d tensor of shape [N, 4], got {tuple(dets.shape)}")
    if scores.dim() != 1 or scores.size(0) != dets.size(0):
        raise RuntimeError(
            f"scores should be a 1d tensor with one score per box, got {tuple(scores.shape)} for {dets.size(0)} boxes"
        )
    if dets.dtype != scores.dtype:
        raise RuntimeError(f"boxes and scores should have the same dtype, got {dets.dtype} and {scores.dtype}")
    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=dets.device)
    order = scores.argsort(stable=True, descending=True)
    boxes = dets[order]
    x1, y1, x2, y2 = boxes.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    alive = torch.ones(len(order), dtype=torch.bool)
    keep = []
    for i in range(len(order)):
        if not alive[i]:
            continue
        keep.append(i)
        later = slice(i + 1, None)
        w = (torch.minimum(x2[i], x2[later]) - torch.maximum(x1[i], x1[later])).clamp(min=0)
        h = (torch.minimum(y2[i], y2[later]) - torch.maximum(y1[i], y1[later])).clamp(min=0)
        inter = w * h
        # Compared in double, as C++ compares a float with a double: not with the threshold rounded to the dtype.
        alive[later] &= ~((inter / (areas[i] + areas[later] - inter)).double() > iou_threshold)
    return order[torch.tensor(keep, dtype=torch.long)]


def _define_ops() -> None:
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.impl("nms", _nms, "CPU")
    _LIBS.append(lib)


def _library_loads(package: importlib.machinery.ModuleSpec) -> bool:
    """Whether torchvision's compiled ops load here (loading them, as torchvision's import would)."""
    import torch

    folders = package.submodule_search_locations or []
    libraries = [p for folder in folders for p in Path(folder).glob("_C.*") if p.suffix in (".so", ".pyd")]
    for path in libraries:
        try:
            torch.ops.load_library(str(path))
            return True
        except OSError:  # built against another torch: undefined symbols, or a CUDA library missing
            continue
    return False


def _let_nms_run(torchvision: ModuleType) -> None:
    """torchvision's ``nms`` asks first whether the compiled library loaded (it did not): for ``nms`` alone the
    question is answered by the kernel above; ``box_iou_rotated``, which asks too, still gets torchvision's error."""
    boxes = torchvision.ops.boxes
    check = boxes._assert_has_ops
    nms_code = boxes.nms.__code__

    def assert_has_ops() -> None:
        if sys._getframe(1).f_code is not nms_code:
            check()

    boxes._assert_has_ops = assert_has_ops


class _Loader(importlib.abc.Loader):
    """torchvision's own loader; the kernel defined first when torchvision's library does not load."""

    def __init__(self, real: importlib.abc.Loader, spec: importlib.machinery.ModuleSpec) -> None:
        self.real = real
        self.spec = spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if not _LIBS and not _library_loads(self.spec):
            _define_ops()
        self.real.exec_module(module)
        if _LIBS:
            _let_nms_run(module)


class _Finder(importlib.abc.MetaPathFinder):
    provides = MODULE
    """Marks this hook, from whichever copy of this file (the installed one, the script run by hand)."""

    def find_spec(
        self, name: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torchvision":
            return None
        # The spec of the finders after this one (a package's availability check asks too: every spec handed
        # out carries the loader, for whichever is used to import).
        for finder in sys.meta_path:
            if getattr(finder, "provides", None) == MODULE or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, spec)
                return spec
        return None


def install() -> None:
    """Apply this to the process's next ``import torchvision`` (nothing is imported now): the ``.pth`` calls it."""
    if not any(getattr(f, "provides", None) == MODULE for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


_CHECK = """
import importlib.util, sys
if importlib.util.find_spec("torchvision") is None:
    sys.exit("torchvision is not installed (transformers works without it; timm needs it)")
import torch, torchvision
boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [20.0, 20.0, 30.0, 30.0]])
kept = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist()
if kept != [0, 2]:
    sys.exit(f"torchvision.ops.nms kept boxes {kept}, not [0, 2]")
print(torch.__version__, torchvision.__version__)
"""


def check(python: str = sys.executable) -> tuple[bool, str]:
    """Whether ``python`` imports torch and torchvision together and runs ``nms``, in a fresh process; and what
    it said. An environment without torchvision passes: nothing of it can fail to load."""
    out = subprocess.run([python, "-c", _CHECK], capture_output=True, text=True, timeout=300)
    lines = (out.stdout + out.stderr).strip().splitlines()
    said = lines[-1] if lines else ""
    return out.returncode == 0 or said.startswith("torchvision is not installed"), said


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def install_here() -> Path:
    """Copy this file into the running Python's site-packages, with the ``.pth`` that installs it at start."""
    where = site_packages()
    for stale in STALE_PTH:
        (where / stale).unlink(missing_ok=True)
    shutil.copyfile(__file__, where / f"{MODULE}.py")
    (where / PTH_NAME).write_text(f"import {MODULE}; {MODULE}.install()\n", encoding="utf-8")
    return where / PTH_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/torchvision_cpu.py", description=(__doc__ or "").splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true", help="say whether torchvision loads and its nms runs")
    group.add_argument("--install", action="store_true", help="install the CPU nms into this Python's environment")
    args = parser.parse_args(argv)
    if args.install:
        print(f"installed {install_here()}")
    ok, said = check()
    if not ok:
        print(f"torchvision does not load beside this torch: {said}")
    elif said.startswith("torchvision is not installed"):
        print(said)
    else:
        print(f"torch and torchvision load together, nms runs: {said}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
