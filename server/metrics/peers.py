"""Several workers, one ``/metrics``: each worker publishes its live ranks and its counts; worker 0,
which serves HTTP, adds them to its own at scrape time.

A rank's stream stays on the worker that accepted it, so without this worker 0
would export only its own ranks: a job spread over two workers would show half
its ranks connected (and its stream-lost alert would fire), and an OOM on
another worker would never reach ``rematd_oom_events_total``. Workers write a
small JSON file every ``PUBLISH_SECONDS`` into a folder of the run's own;
files older than ``STALE_SECONDS`` (a worker that died) are left out.

Why not prometheus_client's multiprocess mode: it aggregates each series on its own (sum, max,
min), but a job's gauges are computed over its ranks wherever they live (the headroom of the
largest peak against the smallest budget, the jobs that get series when there are more than
``--max-job-series``, chosen by risk), which needs the ranks themselves, not per-process values;
its custom collectors are not read across processes; and a dead worker's files stay counted until
they are cleaned by hand. Why not a scrape per worker, summed in PromQL: the workers share one port
(SO_REUSEPORT), so Prometheus cannot address one of them, and a job's per-job series would be split
across scrapes. Replicas (separate pods) are scraped one by one and summed by ``exported_job``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from rematd.server.metrics.live import RankSample
from rematd.server.metrics.registry import Metrics

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
