"""Whether torch and torchvision load together here, and the fix for every Python of this environment.

``python -m rematd.torchvision_ops --check`` says whether they do; ``--install`` writes a ``.pth`` file
into site-packages that installs :mod:`rematd.torchvision_hook` at every start of Python (it imports
nothing else), then checks again. ``make setup`` runs both when the first check fails.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "rematd_torchvision_ops.pth"
"""Sorted after setuptools' editable-install hook, so that ``rematd`` is importable when it runs."""
_PTH_LINE = (
    "import sys; exec('try:\\n import rematd.torchvision_hook as m\\n m.install()\\nexcept ImportError:\\n pass')\n"
)


_CHECK = """
import importlib.util, sys
if importlib.util.find_spec("torchvision") is None:
    sys.exit("torchvision is not installed (transformers works without it; timm needs it)")
import torch, torchvision
print(torch.__version__, torchvision.__version__)
"""


def check(python: str = sys.executable) -> tuple[bool, str]:
    """Whether ``python`` imports torch and torchvision together, in a fresh process; and what it said.

    An environment without torchvision passes: nothing of it can fail to load.
    """
    out = subprocess.run([python, "-c", _CHECK], capture_output=True, text=True, timeout=300)
    lines = (out.stdout + out.stderr).strip().splitlines()
    said = lines[-1] if lines else ""
    return out.returncode == 0 or said.startswith("torchvision is not installed"), said


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rematd.torchvision_ops", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true", help="say whether torch and torchvision load together")
    group.add_argument("--install", action="store_true", help="fix every Python of this environment (a .pth file)")
    args = parser.parse_args(argv)
    if args.install:
        pth_path().write_text(_PTH_LINE, encoding="utf-8")
    ok, said = check()
    if not ok:
        print(f"torchvision does not load: {said}")
    elif said.startswith("torchvision is not installed"):
        print(said)
    else:
        print(f"torch and torchvision load together: {said}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
