"""A launcher without a main guard, run as a script: it prints a line as it is imported (once, in the launcher,
unless a rank imports it again), then starts one warm rank of ``tests.workers.describe`` and prints what the rank
saw."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench import warm  # noqa: E402 - the path above first

print("launcher imported", flush=True)
with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "out"
    rank = warm.start(
        "tests.workers.describe", ["0"], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=out, stderr=out
    )
    warm.wait_all([rank], 60.0, stop_on_failure=False)
    print(out.read_text(), end="", flush=True)
    sys.exit(rank.returncode)
