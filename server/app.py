"""Both servers, gRPC and HTTP, in one asyncio loop with graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import uvicorn

from rematd.server.config import (
    ExposedWithoutToken,
    ServeConfig,
    StoreConfig,
    default_db_path,
    is_loopback,
)
from rematd.server.core.advisor import AdvisorCore
from rematd.server.core.ownership import JobTokens
from rematd.server.credentials import load_job_tokens
from rematd.server.metrics import peers
from rematd.server.metrics.registry import Metrics
from rematd.server.store.database import STORE_AWAY, database_url, redact_url
from rematd.server.store.holders import HEARTBEAT_SECONDS
from rematd.server.store.store import Store
from rematd.server.transport.auth import TokenAuth
from rematd.server.transport.connections import Budget, fd_budget, guarded_protocol
from rematd.server.transport.grpc_service import AdvisorServicer, Health, build_server
from rematd.server.transport.rest import create_app

# Where they were defined before the settings had a module of their own.
__all__ = [
    "Bound",
    "ExposedWithoutToken",
    "ServeConfig",
    "Service",
    "ServiceThread",
    "default_db_path",
    "is_loopback",
    "store_config",
]

log = logging.getLogger("rematd.server")

SHUTDOWN_WRITES_SECONDS = 30.0
"""At shutdown, how long the core's queued writes get to reach the store."""
SHUTDOWN_RETRY_SECONDS = 15.0
"""At shutdown, how long buffered step reports wait for a store that refuses them (a full disk) to take them."""


def store_config(config: ServeConfig) -> StoreConfig:
    """The store's settings, naming the store ``--db`` gives."""
    return dataclasses.replace(config.store, url=database_url(config.db_path))


@dataclass(frozen=True, slots=True)
class Bound:
    """The addresses the servers actually bound."""

    grpc: str
    http: str
    db: str
    tls: bool = False
    limits: str = ""
    """How many connections each transport holds at once, and the descriptor limit that bounds them."""

    @property
    def dashboard(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.http}/"


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service's loop owns shutdown; a TLS handshake not done
    within ``handshake_seconds`` is cut (uvicorn leaves asyncio's 60 s)."""

    def __init__(self, config: uvicorn.Config, *, handshake_seconds: float) -> None:
        super().__init__(config)
        self.handshake_seconds = handshake_seconds

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        create_server = loop.create_server
        limit = self.handshake_seconds

        def with_limit(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("ssl") is not None:
                kwargs.setdefault("ssl_handshake_timeout", limit)
            return create_server(*args, **kwargs)

        loop.create_server = with_limit  # type: ignore[method-assign]
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server  # the loop's own method again


class Service:
    """The running service. ``await run(stop)`` serves until ``stop`` is set."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.db_path = config.db_path
        self.store = Store(store_config(config))
        self.core = AdvisorCore(
            self.store,
            Metrics(
                per_rank=config.per_rank_metrics,
                max_jobs=config.max_job_series,
                multiprocess_dir=peers.metrics_dir(Path(config.shared_dir)) if config.shared_dir else None,
                cache_seconds=config.metrics_cache_seconds,
            ),
            config.core,
            job_tokens=JobTokens(load_job_tokens(config.job_tokens_file)),
        )
        self.bound: Bound | None = None
        self.serving = False

    def _bind_grpc(self, server: grpc.aio.Server) -> int:
        cfg = self.config
        address = f"{cfg.grpc_host}:{cfg.grpc_port}"
        if cfg.tls:
            creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind gRPC to {address}")
        return port

    async def _every(self, seconds: float, work: str, fn: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await asyncio.to_thread(fn)
            except STORE_AWAY as err:
                # The database out of reach (a restart, a failover): a line each time, not a driver's traceback.
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                log.warning("periodic %s failed: the store is out of reach (%s); trying again in %.0f s",
                            work, first[:200], seconds)  # fmt: skip
            except Exception:
                log.exception("periodic %s failed; trying again in %.0f s", work, seconds)

    async def _flush_patiently(self, seconds: float) -> bool:
        """Write the buffered step reports, trying again while the store refuses them (a full disk may get
        room) for up to ``seconds``; False if it never took them."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                await asyncio.to_thread(self.store.flush)
                return True
            except Exception:
                if self.store.lost or time.monotonic() >= deadline:  # room on the disk would not bring a file back
                    return False
                if deadline - time.monotonic() > seconds - 0.5:
                    log.warning(
                        "the store cannot be written at shutdown (%s): %d step report(s) wait; trying for %.0f s",
                        self.store.last_failure,
                        self.store.pending(),
                        seconds,
                    )
                await asyncio.sleep(0.5)

    async def run(self, stop: asyncio.Event, ready: threading.Event | None = None) -> None:
        """Start, serve until ``stop`` is set, then stop gracefully; ``ready`` is set once both transports listen."""
        running = await self._start()
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
        finally:
            await self._stop(running)

    async def _start(self) -> _Running:
        cfg = self.config
        budget = fd_budget(cfg.http_options)
        server, servicer, health = build_server(
            self.core, auth=TokenAuth.serving(cfg), options=cfg.grpc, max_connections=budget.grpc
        )
        grpc_port = self._bind_grpc(server)
        sock = self._bind_http() if cfg.http else None
        web = self._web(budget) if sock is not None else None
        try:
            # Before the first hello: ranks a killed process of this store left connected read as lost now.
            await asyncio.to_thread(self.core.heartbeat)
        except Exception:
            log.exception("saying in the store that this process is alive failed; trying again in %.0f s",
                          HEARTBEAT_SECONDS)  # fmt: skip
        await server.start()
        await health.set(True)
        self.serving = True
        running = _Running(server=server, servicer=servicer, health=health, web=web, sock=sock)
        if web is not None and sock is not None:
            running.web_task = await self._serve_http(web, sock)
        running.chores = self._chores()
        self.bound = Bound(
            grpc=f"{cfg.grpc_host}:{grpc_port}",
            http=f"{cfg.http_host}:{sock.getsockname()[1] if sock is not None else 0}",
            db=redact_url(self.store.path if "://" in (cfg.db or "") else self.db_path),
            tls=cfg.tls,
            limits=budget.describe(),
        )
        return running

    def _bind_http(self) -> socket.socket:
        cfg = self.config
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.http_host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.http_host, cfg.http_port))
        except OSError as err:
            sock.close()
            raise OSError(f"cannot bind HTTP to {cfg.http_host}:{cfg.http_port}: {err}") from err
        return sock

    def _web(self, budget: Budget) -> _QuietServer:
        cfg = self.config
        return _QuietServer(
            uvicorn.Config(
                create_app(self.core, TokenAuth.serving(cfg), serving=lambda: self.serving),
                log_level="warning",
                lifespan="off",
                access_log=False,
                ssl_certfile=cfg.tls_cert or None,
                ssl_keyfile=cfg.tls_key or None,
                http=guarded_protocol(
                    budget.http, cfg.http_options.http_request_seconds, cfg.http_options.http_response_seconds
                ),
                timeout_keep_alive=max(1, round(cfg.http_options.http_keepalive_seconds)),
            ),
            handshake_seconds=cfg.grpc.handshake_timeout_seconds,
        )

    @staticmethod
    async def _serve_http(web: _QuietServer, sock: socket.socket) -> asyncio.Task[None]:
        """Serve HTTP on ``sock``; returns once it listens (raises if it could not start)."""
        task = asyncio.create_task(web.serve(sockets=[sock]))
        while not web.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            await task
        return task

    def _chores(self) -> list[asyncio.Task[None]]:
        """The periodic work: controls other workers wrote, compaction, expiry, and sharing metrics."""
        cfg = self.config
        core = self.core
        chores = [
            asyncio.create_task(self._every(cfg.controls_poll_seconds, "controls", core.refresh_controls)),
            asyncio.create_task(self._every(cfg.compact_seconds, "compact", core.compact)),
            asyncio.create_task(self._every(HEARTBEAT_SECONDS, "heartbeat", core.heartbeat)),
            # Often enough that a rank goes within a quarter of the expiry after it is due.
            asyncio.create_task(
                self._every(min(30.0, cfg.core.session_expiry_seconds / 4), "expiry", core.expire_sessions)
            ),
        ]
        if not cfg.shared_dir:
            return chores
        shared = Path(cfg.shared_dir)
        if cfg.worker_index == 0:
            core.metrics.peers = lambda: peers.gather(shared, skip=0)

        def publish() -> None:
            # Every worker, 0 too: the supervisor reads a dead worker's last file to mark its ranks disconnected.
            peers.publish(core.rank_samples(), shared, cfg.worker_index)

        chores.append(asyncio.create_task(self._every(peers.PUBLISH_SECONDS, "publishing live ranks", publish)))
        return chores

    async def _stop(self, running: _Running) -> None:
        """Health says NOT_SERVING first, so probes and balancers move away; then streams get their grace,
        and what they sent is written before the servers and the store close."""
        self.serving = False
        running.servicer.draining = True
        await running.health.set(False)
        if self.config.drain_seconds:
            await asyncio.sleep(self.config.drain_seconds)
        for chore in running.chores:
            chore.cancel()
        if running.web is not None:
            running.web.should_exit = True
        # Open streams are told to reconnect elsewhere now, rather than cut off when the grace
        # ends; what they sent is written first, so the replica they reach next has it.
        running.servicer.close_streams()
        await self._write_last()
        running.servicer.flushed.set()
        await running.server.stop(self.config.grace_seconds)
        if running.web_task is not None:
            await running.web_task
        if running.sock is not None:
            running.sock.close()
        await asyncio.to_thread(self.core.close)
        await asyncio.to_thread(self.store.close)

    async def _write_last(self) -> None:
        """The core's queued writes and the buffered step reports, given time for a full disk to get room."""
        if not await asyncio.to_thread(self.core.drain_writes, SHUTDOWN_WRITES_SECONDS):
            log.error(
                "the store did not take the service's last writes within %.0f s; stopping without them",
                SHUTDOWN_WRITES_SECONDS,
            )
        pending = self.store.pending()
        if not await self._flush_patiently(SHUTDOWN_RETRY_SECONDS):
            # Said in one line: a failing disk is an operator's problem, not a bug with a traceback.
            log.error(
                "the store cannot be written at shutdown (%s): %d buffered step report(s) are lost",
                self.store.last_failure,
                pending,
            )


@dataclass(slots=True, kw_only=True)
class _Running:
    """What a started service holds until it stops."""

    server: grpc.aio.Server
    servicer: AdvisorServicer
    health: Health
    web: _QuietServer | None
    sock: socket.socket | None
    web_task: asyncio.Task[None] | None = None
    chores: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)


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

    def begin_stop(self) -> None:
        if self._stop is not None and not self._loop.is_closed():
            stop = self._stop
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(stop.set)

    def stop(self, timeout: float = 15.0) -> None:
        self.begin_stop()
        self._thread.join(timeout)
