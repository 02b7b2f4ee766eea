"""Both servers, gRPC and HTTP, in one asyncio loop with graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvicorn

from rematd.server import peers
from rematd.server.auth import TokenAuth
from rematd.server.config import CoreConfig, GrpcOptions, StoreConfig
from rematd.server.core import AdvisorCore
from rematd.server.grpc_service import build_server
from rematd.server.metrics import Metrics
from rematd.server.rest import create_app
from rematd.server.store import Store, database_url, redact_url

log = logging.getLogger("rematd.server")


def default_db_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "rematd" / "rematd.db"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ExposedWithoutToken(ValueError):
    """A service that would listen beyond loopback with no token: anyone who reaches a port could stream
    into the record, or pin and end jobs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """Where the service listens, who may do what, and how it keeps its record."""

    grpc_host: str = "127.0.0.1"
    """Address the gRPC service binds to."""
    grpc_port: int = 50051
    """gRPC port; 0 picks a free one."""
    http_host: str = "127.0.0.1"
    """Address of the REST API, dashboard and /metrics."""
    http_port: int = 8080
    """HTTP port; 0 picks a free one."""
    http: bool = True
    """Serve HTTP at all (extra workers of a multi-process service serve gRPC only)."""
    db: str = ""
    """SQLite file or database URL of the record (default: a SQLite file under the user's data directory)."""
    grace_seconds: float = 5.0
    """At shutdown, after open streams are told to reconnect, how long their last messages get to finish."""
    drain_seconds: float = 0.0
    """How long health says NOT_SERVING before the servers stop, so load balancers move away first."""
    token: str | None = None
    """Bearer token that writes (and non-loopback reads) need; None: HTTP writes are open on loopback only."""
    public_reads: bool = False
    """Serve reads without a token even when HTTP binds a non-loopback address."""
    tls_cert: str = ""
    """PEM certificate chain for TLS on gRPC and HTTP (with tls_key)."""
    tls_key: str = ""
    """PEM private key for TLS."""
    retention_days: float = 30.0
    """Stats and OOM events older than this are deleted, and jobs idle that long."""
    keep_steps: int = 2000
    """Per rank, the latest steps kept at full resolution."""
    bucket_seconds: float = 300.0
    """Older steps keep one row per rank per bucket of this many seconds."""
    compact_seconds: float = 600.0
    """How often old statistics are down-sampled and expired."""
    controls_poll_seconds: float = 1.0
    """How often operator controls written by another worker or replica are picked up."""
    session_expiry_seconds: float = 900.0
    """A rank whose stream has been gone this long is forgotten; a job's series go with its last rank."""
    max_report_interval_seconds: float = 10.0
    """How long a rank may fold steady steps into one report (0: every step is reported)."""
    per_rank_metrics: bool = False
    """Export per-rank series besides the per-job ones."""
    max_message_bytes: int = 1 << 20
    """Largest gRPC message a rank may send."""
    reuse_port: bool = False
    """Bind gRPC with SO_REUSEPORT so several worker processes share the port."""
    worker_index: int = 0
    """Which of several workers this process is (0 serves HTTP)."""
    shared_dir: str = ""
    """Where the workers of one service leave what worker 0 adds to its /metrics ("" with one process)."""

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name.replace('_', '-')} must be in 0-65535, got {port}")
        for name in ("grace_seconds", "drain_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("compact_seconds", "controls_poll_seconds", "session_expiry_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls-cert and tls-key go together")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name.replace('_', '-')} {path!r} is not a readable file")
        # These raise ValueError naming the setting.
        CoreConfig(
            session_expiry_seconds=self.session_expiry_seconds,
            max_report_interval_seconds=self.max_report_interval_seconds,
        )
        TokenAuth(token=self.token)
        GrpcOptions(max_message_bytes=self.max_message_bytes)
        self.store_config()
        # Here, so that every way of starting the service (the CLI, Service, ServiceThread) refuses it.
        exposed = self._exposed_without_token()
        if exposed:
            raise ExposedWithoutToken(
                f"{exposed} is not a loopback address, and writes there need a token: set REMATD_TOKEN "
                "or --token-file (e.g. REMATD_TOKEN=$(openssl rand -hex 32)), or bind 127.0.0.1"
            )

    def _exposed_without_token(self) -> str:
        """What would listen beyond loopback with no token, as the flag that set it ("" when nothing)."""
        if self.token is not None:
            return ""
        if not is_loopback(self.grpc_host):
            return f"--grpc-host {self.grpc_host}"
        if self.http and not is_loopback(self.http_host):
            return f"--http-host {self.http_host}"
        return ""

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            url=database_url(self.db or default_db_path()),
            keep_steps=self.keep_steps,
            bucket_seconds=self.bucket_seconds,
            retention_days=self.retention_days,
        )

    @property
    def auth(self) -> TokenAuth:
        loopback = is_loopback(self.http_host)
        return TokenAuth(token=self.token, open_reads=self.public_reads or loopback, open_writes=loopback)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


@dataclass(frozen=True, slots=True)
class Bound:
    """The addresses the servers actually bound."""

    grpc: str
    http: str
    db: str
    tls: bool = False

    @property
    def dashboard(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.http}/"


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service's loop owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Service:
    """The running service. ``await run(stop)`` serves until ``stop`` is set."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        store_config = config.store_config()
        self.db_path = config.db or str(default_db_path())
        self.store = Store(store_config)
        self.core = AdvisorCore(
            self.store,
            Metrics(per_rank=config.per_rank_metrics),
            CoreConfig(
                session_expiry_seconds=config.session_expiry_seconds,
                max_report_interval_seconds=config.max_report_interval_seconds,
            ),
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
            except Exception:
                log.exception("periodic %s failed; trying again in %.0f s", work, seconds)

    async def run(self, stop: asyncio.Event, ready: threading.Event | None = None) -> None:
        cfg = self.config
        options = GrpcOptions(max_message_bytes=cfg.max_message_bytes, reuse_port=cfg.reuse_port)
        server, servicer, health = build_server(self.core, auth=cfg.auth, options=options)
        grpc_port = self._bind_grpc(server)
        web: _QuietServer | None = None
        sock: socket.socket | None = None
        http_port = 0
        if cfg.http:
            family = socket.AF_INET6 if ":" in cfg.http_host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((cfg.http_host, cfg.http_port))
            except OSError as err:
                sock.close()
                raise OSError(f"cannot bind HTTP to {cfg.http_host}:{cfg.http_port}: {err}") from err
            http_port = sock.getsockname()[1]
            web = _QuietServer(
                uvicorn.Config(
                    create_app(self.core, cfg.auth, serving=lambda: self.serving),
                    log_level="warning",
                    lifespan="off",
                    access_log=False,
                    ssl_certfile=cfg.tls_cert or None,
                    ssl_keyfile=cfg.tls_key or None,
                )
            )
        await server.start()
        await health.set(True)
        self.serving = True
        web_task = asyncio.create_task(web.serve(sockets=[sock])) if web is not None and sock is not None else None
        if web is not None and web_task is not None:
            while not web.started and not web_task.done():
                await asyncio.sleep(0.01)
            if web_task.done():
                await web_task
        chores = [
            asyncio.create_task(self._every(cfg.controls_poll_seconds, "controls", self.core.refresh_controls)),
            asyncio.create_task(self._every(cfg.compact_seconds, "compact", self.store.compact)),
            # Often enough that a rank goes within a quarter of the expiry after it is due.
            asyncio.create_task(
                self._every(min(30.0, cfg.session_expiry_seconds / 4), "expiry", self.core.expire_sessions)
            ),
        ]
        if cfg.shared_dir:
            shared = Path(cfg.shared_dir)
            if cfg.worker_index == 0:
                self.core.metrics.peers = lambda: peers.gather(shared, skip=0)
            else:
                chores.append(
                    asyncio.create_task(
                        self._every(
                            peers.PUBLISH_SECONDS,
                            "publishing to worker 0",
                            lambda: peers.publish(
                                self.core.metrics, self.core.rank_samples(), shared, cfg.worker_index
                            ),
                        )
                    )
                )
        self.bound = Bound(
            grpc=f"{cfg.grpc_host}:{grpc_port}",
            http=f"{cfg.http_host}:{http_port}",
            db=redact_url(self.store.path if "://" in (cfg.db or "") else self.db_path),
            tls=cfg.tls,
        )
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
        finally:
            # Health says NOT_SERVING first, so probes and balancers move away; then streams get their grace.
            self.serving = False
            servicer.draining = True
            await health.set(False)
            if cfg.drain_seconds:
                await asyncio.sleep(cfg.drain_seconds)
            for chore in chores:
                chore.cancel()
            if web is not None:
                web.should_exit = True
            # Open streams are told to reconnect elsewhere now, rather than cut off when the grace
            # ends; what they sent is written first, so the replica they reach next has it.
            servicer.close_streams()
            await asyncio.to_thread(self.core.drain_writes)
            pending = self.store.pending()
            try:
                await asyncio.to_thread(self.store.flush)
            except Exception:
                # Said in one line: a failing disk is an operator's problem, not a bug with a traceback.
                log.error(
                    "the record cannot be written at shutdown (%s): %d buffered step report(s) are lost",
                    self.store.last_failure,
                    pending,
                )
            servicer.flushed.set()
            await server.stop(cfg.grace_seconds)
            if web_task is not None:
                await web_task
            if sock is not None:
                sock.close()
            await asyncio.to_thread(self.core.close)
            await asyncio.to_thread(self.store.close)


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
