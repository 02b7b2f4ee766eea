"""A rank that dies of a segmentation fault the first time it runs (every time with ``{"always": true}``),
and otherwise writes its rank: what ``tests.distributed.run_ranks`` does with a native crash."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path


def main() -> None:
    result = Path(os.environ["REMATD_RESULT"])
    ran = result.with_suffix(".ran")
    if json.loads(os.environ["REMATD_CONFIG"]).get("always") or not ran.exists():
        ran.touch()
        os.kill(os.getpid(), signal.SIGSEGV)
    result.write_text(json.dumps({"rank": int(os.environ["RANK"])}))


if __name__ == "__main__":
    main()
