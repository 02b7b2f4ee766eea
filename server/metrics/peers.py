"""Several workers, one ``/metrics``: what the worker serving HTTP reads of the others.

Counters and latency histograms are prometheus_client's multiprocess files: every worker writes its
own in the run's folder (``metrics_dir``), the worker serving HTTP adds them up at scrape time, and
a worker that died stays counted (its files stay), so no counter goes back when one is restarted.

The per-job gauges cannot be done that way: a job's gauges are computed over its ranks wherever they
live (the headroom of the largest peak against the smallest budget, the jobs that get series when
there are more than ``--max-job-series``, chosen by risk), which needs the ranks themselves, not
per-process values. So each worker but 0 also writes its live ranks to a small JSON file every
``PUBLISH_SECONDS``; files older than ``STALE_SECONDS`` (a worker that died) are left out. The
supervisor reads a dead worker's last file to mark its ranks disconnected in the store.

Why not a scrape per worker, summed in PromQL: the workers share one port (SO_REUSEPORT), so
Prometheus cannot address one of them, and a job's per-job series would be split across scrapes.
Replicas (separate pods) are scraped one by one; the shipped alert rules aggregate by the training
job (``exported_job``) across them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from rematd.server.metrics.live import RankSample

log = logging.getLogger("rematd.server")

PUBLISH_SECONDS = 1.0
STALE_SECONDS = 5.0
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client reads it when it is first imported: set by the supervisor before it starts workers."""


def metrics_dir(shared: Path) -> Path:
    """Where the workers' counters and histograms are kept (prometheus_client's multiprocess files)."""
    return shared / "metrics"


def _path(directory: Path, index: int) -> Path:
    return directory / f"worker-{index}.json"


def publish(samples: list[RankSample], directory: Path, index: int) -> None:
    """Write this worker's live ranks, atomically (a reader never sees half a file)."""
    state = {"samples": [dataclasses.asdict(s) for s in samples]}
    tmp = directory / f".worker-{index}.json.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, _path(directory, index))


def gather(directory: Path, skip: int, now: float | None = None) -> list[RankSample]:
    """The live ranks the other workers published, from fresh publications (one that does not read is left
    out, said in the log)."""
    now = time.time() if now is None else now
    out = []
    for path in directory.glob("worker-*.json"):
        if path == _path(directory, skip):
            continue
        try:
            if now - path.stat().st_mtime > STALE_SECONDS:
                continue
            samples = json.loads(path.read_text()).get("samples", ())
            out.extend([RankSample(**s) for s in samples])
        except (OSError, ValueError, TypeError, AttributeError) as err:
            log.warning("reading %s failed (%s); its ranks are left out of this scrape", path.name, err)
    return out


def held_ranks(directory: Path, index: int) -> list[tuple[str, int]]:
    """The (job, rank) pairs with a live stream in worker ``index``'s last publication (none if it never wrote
    one), and removes that publication: the worker is gone."""
    path = _path(directory, index)
    try:
        samples = json.loads(path.read_text()).get("samples", [])
        path.unlink()
    except (OSError, ValueError, AttributeError):
        return []
    return [(str(s["job"]), int(s["rank"])) for s in samples if isinstance(s, dict) and s.get("connected")]
