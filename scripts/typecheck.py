"""Type-check rematd with mypy.

The source folders (proto/rematd, cli, planner, client, server, integrations) map onto one
package, ``rematd``, which mypy cannot see through an editable install; this
lays the package out under build/typecheck with symbolic links and checks it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / "build" / "typecheck"
SUBPACKAGES = {
    "cli": "cli",
    "planner": "planner",
    "client": "client",
    "server": "server",
    "integrations": "integrations",
}


def stage() -> Path:
    if STAGE.exists():
        shutil.rmtree(STAGE)
    pkg = STAGE / "rematd"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "proto" / "rematd").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in SUBPACKAGES.items():
        (pkg / name).symlink_to(ROOT / folder)
    return STAGE


def main() -> int:
    where = stage()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "rematd"]
    return subprocess.call(cmd, cwd=where)


if __name__ == "__main__":
    sys.exit(main())
