"""One service process from start to exit: signals, the collector's settings, the lines it prints."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys

from rematd import __version__
from rematd.server.app import Service
from rematd.server.config import ServeConfig
from rematd.server.runtime.allocator import limit_arenas
from rematd.server.store.database import StoreError, redact_url


def bad_db(config: ServeConfig, err: Exception) -> int:
    """Exit status 2, after one line naming the store (its password hidden) and what is wrong with it."""
    print(f"rematd serve: --db {redact_url(config.db_path)}: {err}", file=sys.stderr)
    return 2


def run_one(config: ServeConfig, *, announce: bool = True) -> int:
    """Serve until SIGINT or SIGTERM; the exit status."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        service = Service(config)
        task = asyncio.create_task(service.run(stop))
        while service.bound is None and not task.done():
            await asyncio.sleep(0.01)
        if service.bound is not None:
            # Start-up objects live as long as the process: keep the collector's full passes off them.
            gc.collect()
            gc.freeze()
            if announce:
                b = service.bound
                print(f"rematd {__version__} serving gRPC on {b.grpc}{' (TLS)' if b.tls else ''}", flush=True)
                if config.http:
                    scheme = "https" if b.tls else "http"
                    print(f"dashboard and REST on {scheme}://{b.http}/ (metrics at /metrics)", flush=True)
                print(f"store: {b.db}", flush=True)
                print(b.limits, flush=True)
        await task

    # Fewer, larger young-generation collections: a busy service allocates many short-lived messages.
    # Memory that ended streams held does not wait for these thresholds: the gRPC servicer asks for a
    # collection soon after streams end (rematd.server.runtime.gc_schedule).
    gc.set_threshold(50_000, 20, 100)
    limit_arenas()
    try:
        asyncio.run(main())
    except StoreError as err:
        return bad_db(config, err)
    except (OSError, RuntimeError) as err:
        print(f"rematd serve: {err}", file=sys.stderr)
        return 1
    return 0
