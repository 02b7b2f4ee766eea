"""Both servers, gRPC and HTTP, in one asyncio loop with graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvicorn

from rematd.server.core import AdvisorCore
from rematd.server.grpc_service import AdvisorServicer
from rematd.server.metrics import Metrics
from rematd.server.rest import create_app
from rematd.server.store import Store
from rematd.v1 import advisor_pb2_grpc as pb_grpc

log = logging.getLogger("rematd.server")


def default_db_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "rematd" / "rematd.db"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """Where the service listens and keeps its record."""

    grpc_host: str = "127.0.0.1"
    """Address the gRPC service binds to."""
    grpc_port: int = 50051
    """gRPC port; 0 picks a free one."""
    http_host: str = "127.0.0.1"
    """Address of the REST API, dashboard and /metrics."""
    http_port: int = 8080
    """HTTP port; 0 picks a free one."""
    db: str = ""
    """SQLite file of the record (default: under the user's data directory)."""
    grace_seconds: float = 5.0
    """How long streams get to finish at shutdown."""

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name.replace('_', '-')} must be in 0-65535, got {port}")


@dataclass(frozen=True, slots=True)
class Bound:
    """The addresses the servers actually bound."""

    grpc: str
    http: str
    db: str

    @property
    def dashboard(self) -> str:
        return f"http://{self.http}/"


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service's loop owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Service:
    """The running service. ``await run(stop)`` serves until ``stop`` is set."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.db_path = config.db or str(default_db_path())
        self.store = Store(self.db_path)
        self.core = AdvisorCore(self.store, Metrics())
        self.bound: Bound | None = None

    async def run(self, stop: asyncio.Event, ready: threading.Event | None = None) -> None:
        cfg = self.config
        server = grpc.aio.server()
        pb_grpc.add_AdvisorServicer_to_server(AdvisorServicer(self.core), server)
        grpc_port = server.add_insecure_port(f"{cfg.grpc_host}:{cfg.grpc_port}")
        if grpc_port == 0:
            raise OSError(f"cannot bind gRPC to {cfg.grpc_host}:{cfg.grpc_port}")
        family = socket.AF_INET6 if ":" in cfg.http_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.http_host, cfg.http_port))
        except OSError as err:
            sock.close()
            raise OSError(f"cannot bind HTTP to {cfg.http_host}:{cfg.http_port}: {err}") from err
        http_port = sock.getsockname()[1]
        web = _QuietServer(uvicorn.Config(create_app(self.core), log_level="warning", lifespan="off", access_log=False))
        await server.start()
        web_task = asyncio.create_task(web.serve(sockets=[sock]))
        while not web.started and not web_task.done():
            await asyncio.sleep(0.01)
        if web_task.done():
            await web_task
        self.bound = Bound(grpc=f"{cfg.grpc_host}:{grpc_port}", http=f"{cfg.http_host}:{http_port}", db=self.db_path)
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
        finally:
            web.should_exit = True
            await server.stop(cfg.grace_seconds)
            await web_task
            sock.close()
            self.store.close()


class ServiceThread:
    """The service on a background thread, for the demo and tests."""

    def __init__(self, config: ServeConfig) -> None:
        self.service = Service(config)
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="rematd-service", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def go() -> None:
            self._stop = asyncio.Event()
            await self.service.run(self._stop, self._ready)

        try:
            self._loop.run_until_complete(go())
        except BaseException as err:
            self._error = err
            self._ready.set()
        finally:
            self._loop.close()

    def start(self, timeout: float = 30.0) -> Bound:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the rematd service did not start in time")
        if self._error is not None:
            raise self._error
        assert self.service.bound is not None
        return self.service.bound

    def stop(self, timeout: float = 15.0) -> None:
        if self._stop is not None and not self._loop.is_closed():
            stop = self._stop
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout)
