"""A rank that says what it was started with (command line, an environment variable, working directory, whether
torch was imported before it) on its standard output, writes a line to its standard error, and exits with the
code its command line gives."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    seen = {
        "argv": sys.argv[1:],
        "setting": os.environ.get("REMATD_DESCRIBE"),
        "cwd": os.getcwd(),
        "torch_before": "torch" in sys.modules,
        "main": __name__,
        # multiprocessing names a main module it imports for a child "__mp_main__"
        "launcher_imported": getattr(sys.modules.get("__mp_main__"), "__file__", None),
    }
    print(json.dumps(seen))
    print("to standard error", file=sys.stderr)
    raise SystemExit(int(sys.argv[1]))


if __name__ == "__main__":
    main()
