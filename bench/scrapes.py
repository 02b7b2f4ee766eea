"""Concurrent ``/metrics`` scrapers against a real ``rematd serve`` holding many jobs: how long ``/healthz``
takes meanwhile (the event loop the training ranks' streams share), and what each scrape costs.

Opens ``--jobs`` jobs (a hello and a step each; the ranks stay resumable, so their series stay), then
``--scrapers`` threads scrape back to back for ``--seconds`` while another polls ``/healthz``. Run once
per ``--cache-seconds`` value given (the service's ``--metrics-cache-seconds``), each on a fresh service.

    python -m bench.scrapes --jobs 1000 --scrapers 16 --cache-seconds 1,0
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx

from bench.hostile import _hello, _stats
from bench.loop_stall import while_probing
from bench.served import served
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc


def open_jobs(target: str, jobs: int) -> None:
    """``jobs`` jobs of one rank, each a hello and a step on a stream that then ends (the rank stays resumable)."""
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.AdvisorStub(ch)
        for j in range(jobs):
            msgs = [pb.ClientMessage(hello=_hello(f"scraped-{j:05d}")), pb.ClientMessage(stats=_stats(0))]
            list(stub.Session(iter(msgs), timeout=60))


def scrape_for(http_base: str, scrapers: int, seconds: float) -> dict[str, float]:
    """``scrapers`` threads scraping back to back for ``seconds``: how many scrapes, their size and times."""
    times: list[float] = []
    sizes: list[int] = []
    stop = time.monotonic() + seconds

    def scrape() -> None:
        with httpx.Client(base_url=http_base, timeout=60) as http:
            while time.monotonic() < stop:
                t = time.perf_counter()
                r = http.get("/metrics", headers={"accept-encoding": "gzip"})
                times.append(time.perf_counter() - t)
                sizes.append(len(r.content))

    threads = [threading.Thread(target=scrape) for _ in range(scrapers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    return {
        "scrapes": len(times),
        "scrape_mib": round(statistics.median(sizes) / 2**20, 2),
        "scrape_p50_ms": round(statistics.median(times) * 1000, 1),
        "scrape_max_ms": round(max(times) * 1000, 1),
    }


def run(jobs: int, scrapers: int, seconds: float, cache_seconds: str) -> dict[str, object]:
    db = Path(tempfile.mkdtemp(prefix="rematd-bench-")) / "r.db"
    with served(db, "--metrics-cache-seconds", cache_seconds, "--log-level", "warning") as srv:
        began = time.perf_counter()
        open_jobs(srv.grpc, jobs)
        opened = time.perf_counter() - began
        # The machine's own noise: /healthz with no scraper, for as long.
        _, quiet = while_probing(srv.http, lambda: time.sleep(seconds))
        scrapes, lags = while_probing(srv.http, lambda: scrape_for(srv.http, scrapers, seconds))
    return {
        "metrics_cache_seconds": float(cache_seconds),
        "jobs": jobs,
        "scrapers": scrapers,
        "seconds_to_open_jobs": round(opened, 1),
        **scrapes,
        "healthz_p50_ms": round(statistics.median(lags) * 1000, 1),
        "healthz_p99_ms": round(sorted(lags)[int(len(lags) * 0.99)] * 1000, 1),
        "healthz_max_ms": round(max(lags) * 1000, 1),
        "no_scraper_healthz_p50_ms": round(statistics.median(quiet) * 1000, 1),
        "no_scraper_healthz_p99_ms": round(sorted(quiet)[int(len(quiet) * 0.99)] * 1000, 1),
        "no_scraper_healthz_max_ms": round(max(quiet) * 1000, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--scrapers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--cache-seconds", default="1", help="comma-separated --metrics-cache-seconds values to run")
    args = parser.parse_args()
    if not 1 <= args.jobs <= 100_000 or not 1 <= args.scrapers <= 256 or not 1 <= args.seconds <= 600:
        parser.error("jobs must be in 1-100000, scrapers in 1-256, seconds in 1-600")
    report = [run(args.jobs, args.scrapers, args.seconds, c) for c in args.cache_seconds.split(",")]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
