"""Several workers, one ``/metrics``: each worker publishes its live ranks and its counts; worker 0,
which serves HTTP, adds them to its own at scrape time.

A rank's stream stays on the worker that accepted it, so without this worker 0
would export only its own ranks: a job spread over two workers would show half
its ranks connected (and its stream-lost alert would fire), and an OOM on
another worker would never reach ``rematd_oom_events_total``. Workers write a
small JSON file every ``PUBLISH_SECONDS`` into a folder of the run's own;
files older than ``STALE_SECONDS`` (a worker that died) are left out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from rematd.server.metrics import Metrics, RankSample

log = logging.getLogger("rematd.server")

PUBLISH_SECONDS = 1.0
STALE_SECONDS = 5.0


def _path(directory: Path, index: int) -> Path:
    return directory / f"worker-{index}.json"


def publish(metrics: Metrics, samples: list[RankSample], directory: Path, index: int) -> None:
    """Write this worker's live ranks and counts, atomically (a reader never sees half a file)."""
    state = {"samples": [dataclasses.asdict(s) for s in samples], "counts": metrics.local_counts()}
    tmp = directory / f".worker-{index}.json.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, _path(directory, index))


def gather(directory: Path, skip: int, now: float | None = None) -> list[dict[str, Any]]:
    """The fresh states the other workers published."""
    now = time.time() if now is None else now
    out = []
    for path in directory.glob("worker-*.json"):
        if path == _path(directory, skip):
            continue
        try:
            if now - path.stat().st_mtime > STALE_SECONDS:
                continue
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            log.warning("reading %s failed (%s); its ranks are left out of this scrape", path.name, err)
    return out
