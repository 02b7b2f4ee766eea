"""Several service processes on one gRPC port (SO_REUSEPORT).

The kernel spreads new connections over the processes; a rank's stream stays
on the process that accepted it, so its in-memory session state is per
process. Worker 0 also serves HTTP; the others serve gRPC only. All share the
store, and operator controls written through worker 0 reach the others by
polling it; the others publish their live ranks and counts for worker 0's
/metrics (``peers``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

from rematd.server.app import store_config
from rematd.server.config import ServeConfig
from rematd.server.run import run_one
from rematd.server.store.store import Store


def _worker(config: ServeConfig, index: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Worker 0 serves HTTP and says where; the others only serve gRPC.
    sys.exit(run_one(config, announce=index == 0))


def serve_workers(config: ServeConfig, workers: int) -> int:
    """Run ``workers`` processes; returns when all have stopped."""
    if config.grpc_port == 0:
        # Every worker must bind the same port: pick it once, here.
        family = socket.AF_INET6 if ":" in config.grpc_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((config.grpc_host, 0))
            port = s.getsockname()[1]
        config = dataclasses.replace(config, grpc_port=port)
    # Every worker binds the same port.
    config = dataclasses.replace(config, grpc=dataclasses.replace(config.grpc, reuse_port=True))
    # Migrate once, here, before the workers open the store.
    Store(store_config(config)).close()
    shared = tempfile.mkdtemp(prefix="rematd-workers-")
    ctx = mp.get_context("spawn")
    procs = []
    for i in range(workers):
        cfg = dataclasses.replace(config, worker_index=i, shared_dir=shared, http=config.http and i == 0)
        p = ctx.Process(target=_worker, args=(cfg, i), name=f"rematd-worker-{i}", daemon=False)
        p.start()
        procs.append(p)
    stopping = False

    def _stop(_sig: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"rematd: {workers} worker processes share gRPC port {config.grpc_port}", flush=True)
    try:
        while any(p.is_alive() for p in procs):
            time.sleep(0.2)
            if not stopping and any(p.exitcode not in (None, 0) for p in procs):
                _stop(0, None)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    return max((p.exitcode or 0) for p in procs)
