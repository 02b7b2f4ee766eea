"""The service's settings: each has one default, here, and the ``rematd serve`` flags are built from them.

Each setting's attribute docstring is its flag's help; a ``REMATD_*`` variable may set it too
(``rematd.server.flags``). A setting an operator does not set on the command line says why in its field's
``NO_FLAG`` metadata. Errors name a setting as its flag is spelled, without the dashes (``keep-steps``), so
the same message reads right from Python and from the CLI.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from rematd.server.credentials import load_job_tokens, token_problem

NO_FLAG = "no_flag"
"""Field metadata key: why the setting has no ``rematd serve`` flag of its own."""


def _flag(name: str) -> str:
    return name.replace("_", "-")


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """How the core plans beyond what the planner decides."""

    warm_after_steps: int = 20
    """Steps a plan must run without an OOM before it is remembered for warm starts."""
    warm_start: bool = True
    """Start a new job of a known model from the last plan that held for it."""
    session_expiry_seconds: float = 900.0
    """A rank whose stream has been gone this long is forgotten (its job's series go with its last rank)."""
    max_report_interval_seconds: float = 10.0
    """How long a rank may fold steady steps into one report; 0: every step is reported."""
    quiet_steps: int = 16
    """Steps on one plan, without risk or a loosening under way, before a rank may fold its reports."""

    def __post_init__(self) -> None:
        if self.warm_after_steps < 1:
            raise ValueError(f"warm-after-steps must be >= 1, got {self.warm_after_steps}")
        if not self.session_expiry_seconds > 0:
            raise ValueError(f"session-expiry-seconds must be positive, got {self.session_expiry_seconds}")
        if not 0 <= self.max_report_interval_seconds <= 3600:
            raise ValueError(f"max-report-interval-seconds must be in 0-3600, got {self.max_report_interval_seconds}")
        if self.quiet_steps < 1:
            raise ValueError(f"quiet-steps must be >= 1, got {self.quiet_steps}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How the store is kept."""

    url: str = field(default="sqlite:///:memory:", metadata={NO_FLAG: "rematd serve names the store with --db"})
    """SQLAlchemy URL, or a plain path to a SQLite file."""
    keep_steps: int = 2000
    """Per rank, the latest steps kept at full resolution; older ones are down-sampled."""
    bucket_seconds: float = 300.0
    """Older steps keep one row (the highest peak) per rank per bucket of this many seconds."""
    retention_days: float = 30.0
    """Stats and OOM events older than this are deleted, and so are jobs idle that long."""
    flush_seconds: float = 0.25
    """Longest time step statistics wait in the write-behind buffer."""
    max_buffered: int = 5000
    """Buffered statistics rows that force a flush before the timer does."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("db must name a SQLite file or a database URL")
        if self.keep_steps < 1:
            raise ValueError(f"keep-steps must be >= 1, got {self.keep_steps}")
        if not self.bucket_seconds > 0:
            raise ValueError(f"bucket-seconds must be positive, got {self.bucket_seconds}")
        if not self.retention_days > 0:
            raise ValueError(f"retention-days must be positive, got {self.retention_days}")
        if not self.flush_seconds > 0:
            raise ValueError(f"flush-seconds must be positive, got {self.flush_seconds}")
        if self.max_buffered < 1:
            raise ValueError(f"max-buffered must be >= 1, got {self.max_buffered}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpcOptions:
    """Transport settings of the gRPC server."""

    max_message_bytes: int = 1 << 20
    """Largest message a rank may send; a profile of 4096 blocks is well under it."""
    keepalive_seconds: float = 60.0
    """The server pings an idle connection this often, to find peers that vanished without a FIN."""
    keepalive_timeout_seconds: float = 20.0
    """A ping unanswered this long closes the connection."""
    min_client_ping_seconds: float = 10.0
    """Clients may ping this often without being told off (GOAWAY too_many_pings)."""
    handshake_timeout_seconds: float = 10.0
    """A connection that has not finished its handshake this long is closed: TLS and the HTTP/2 preface on the
    gRPC port, TLS on the HTTPS port."""
    idle_connection_seconds: float = 300.0
    """A connection with no call open this long is closed (a rank's stream keeps its connection busy)."""
    max_streams_per_connection: int = 100
    """Calls one connection holds open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); a stream over it is
    refused (REFUSED_STREAM) by the transport before the service sees it, so a flood of streams opened and reset
    on one connection (rapid reset) cannot take the service from other connections' ranks. A rank needs one."""
    reuse_port: bool = field(default=False, metadata={NO_FLAG: "set by --workers above 1"})
    """SO_REUSEPORT: several worker processes share the port (else a second bind of it fails)."""

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024:
            raise ValueError(f"max-message-bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_streams_per_connection < 1:
            raise ValueError(f"max-streams-per-connection must be >= 1, got {self.max_streams_per_connection}")
        for name in (
            "keepalive_seconds",
            "keepalive_timeout_seconds",
            "min_client_ping_seconds",
            "handshake_timeout_seconds",
            "idle_connection_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag(name)} must be positive, got {getattr(self, name)}")

    def channel_options(self, max_connections: int = 0) -> list[tuple[str, int]]:
        """The server's options; ``max_connections`` (0: no cap) bounds the connections it accepts at once."""
        # Streams live for days: no max connection age; liveness comes from pings. A connection without a
        # call (one that never sent a preface or a stream) holds a file descriptor for nothing, and is closed.
        capped = [("grpc.max_allowed_incoming_connections", max_connections)] if max_connections else []
        return [
            *capped,
            ("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_seconds * 1000)),
            ("grpc.max_connection_idle_ms", int(self.idle_connection_seconds * 1000)),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_seconds * 1000)),
            # What closes a connection whose ping goes unanswered: keepalive_timeout_ms alone does not.
            ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", int(self.min_client_ping_seconds * 1000)),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.so_reuseport", 1 if self.reuse_port else 0),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpOptions:
    """How many HTTP connections the service holds, and for how long: each one is a file descriptor."""

    max_http_connections: int = 512
    """Most HTTP connections open at once (more are answered 503 and closed); lowered to a quarter of the
    process's file-descriptor limit when that is less, so gRPC streams and the store keep theirs."""
    http_request_seconds: float = 10.0
    """A connection that has not sent a whole request this long after it opened (or after the first byte
    of its next request) is closed: idle and slow-header connections hold no descriptor for long."""
    http_keepalive_seconds: float = 5.0
    """An idle keep-alive connection is closed this long after its last response."""
    http_response_seconds: float = 30.0
    """A response whose unsent bytes the client leaves waiting this long (a reader that stops reading, a zero TCP
    window) is cut off and its connection closed: it holds no descriptor or buffer for long."""

    def __post_init__(self) -> None:
        if self.max_http_connections < 1:
            raise ValueError(f"max-http-connections must be >= 1, got {self.max_http_connections}")
        for name in ("http_request_seconds", "http_keepalive_seconds", "http_response_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag(name)} must be positive, got {getattr(self, name)}")


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
    into the store, or pin and end jobs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """Where the service listens, who may do what, and how it keeps its store.

    ``core``, ``store`` and ``grpc`` are the parts' own settings; their flags are their fields' names.
    """

    grpc_host: str = "127.0.0.1"
    """Address the gRPC service binds to."""
    grpc_port: int = 50051
    """gRPC port; 0 picks a free one."""
    http_host: str = "127.0.0.1"
    """Address of the REST API, dashboard and /metrics."""
    http_port: int = 8080
    """HTTP port; 0 picks a free one."""
    db: str = ""
    """The store: a SQLite file, or a database URL such as postgresql://user@host/rematd
    (default: rematd/rematd.db under $XDG_DATA_HOME, else under ~/.local/share)."""
    public_reads: bool = False
    """Serve reads without a token even when HTTP binds a non-loopback address."""
    tls_cert: str = ""
    """PEM certificate chain: TLS for gRPC and HTTP (with --tls-key)."""
    tls_key: str = ""
    """PEM private key for --tls-cert."""
    job_tokens_file: str = ""
    """File of per-job tokens, 'JOB TOKEN' per line (JOB may be a pattern such as team-a-*): a job it names is
    opened only by a trainer whose REMATD_JOB_TOKEN is that token."""
    per_rank_metrics: bool = False
    """Export per-rank series besides the per-job ones."""
    max_job_series: int = 1000
    """Live jobs with per-job series on /metrics, at most (those most at risk of an OOM first); the rest are
    counted in rematd_job_series_dropped."""
    metrics_need_token: bool = False
    """/metrics needs the bearer token too (a scraper sends it as its bearer_token)."""
    metrics_cache_seconds: float = 1.0
    """How long one render of /metrics serves every scraper (concurrent scrapes share one render rather than each
    rendering); 0 renders for each scrape, still shared by the scrapes that wait at once."""
    grace_seconds: float = 5.0
    """At shutdown, after open streams are told to reconnect, how long their last messages get to finish."""
    drain_seconds: float = 0.0
    """How long health says NOT_SERVING before the servers stop, so load balancers move away first."""
    compact_seconds: float = 600.0
    """How often old statistics are down-sampled and expired."""
    controls_poll_seconds: float = 1.0
    """How often operator controls written by another worker or replica are picked up."""
    core: CoreConfig = field(default_factory=CoreConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    grpc: GrpcOptions = field(default_factory=GrpcOptions)
    http_options: HttpOptions = field(default_factory=HttpOptions)
    token: str | None = field(default=None, metadata={NO_FLAG: "read from --token-file, else $REMATD_TOKEN"})
    """Bearer token that writes (and non-loopback reads) need; None: HTTP writes are open on loopback only."""
    http: bool = field(default=True, metadata={NO_FLAG: "the extra workers of --workers serve gRPC only"})
    """Serve HTTP at all."""
    worker_index: int = field(default=0, metadata={NO_FLAG: "set for each process of --workers"})
    """Which of several workers this process is (0 serves HTTP)."""
    shared_dir: str = field(default="", metadata={NO_FLAG: "set for the processes of --workers"})
    """Where the workers of one service leave what worker 0 adds to its /metrics ("" with one process)."""

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_security()

    def _check_numbers(self) -> None:
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{_flag(name)} must be in 0-65535, got {port}")
        for name in ("grace_seconds", "drain_seconds", "metrics_cache_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.max_job_series < 1:
            raise ValueError(f"max-job-series must be >= 1, got {self.max_job_series}")
        for name in ("compact_seconds", "controls_poll_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag(name)} must be positive, got {getattr(self, name)}")

    def _check_security(self) -> None:
        if self.metrics_need_token and self.token is None:
            raise ValueError("metrics-need-token needs a token (REMATD_TOKEN or --token-file)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls-cert and tls-key go together")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{_flag(name)} {path!r} is not a readable file")
        if self.tls_cert:
            _check_tls_pair(self.tls_cert, self.tls_key)
        load_job_tokens(self.job_tokens_file)  # raises ValueError naming the file and line
        problem = token_problem(self.token)
        if problem:
            raise ValueError(problem)
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

    @property
    def db_path(self) -> str:
        """The store as given, or the default SQLite file."""
        return self.db or str(default_db_path())

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


def _check_tls_pair(cert: str, key: str) -> None:
    """Loads the certificate chain and its key as the servers will: a file that is no PEM, or a key that is not
    the certificate's, is refused here naming the flag, not later as a port that failed to bind."""
    for flag, path, marker, what in (
        ("--tls-cert", cert, b"-----BEGIN CERTIFICATE-----", "PEM certificate"),
        ("--tls-key", key, b"PRIVATE KEY-----", "PEM private key"),
    ):
        try:
            text = Path(path).read_bytes()
        except OSError as err:
            raise ValueError(f"{flag} {path!r} could not be read: {err.strerror or err}") from err
        if marker not in text:
            raise ValueError(f"{flag} {path!r} holds no {what}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(certfile=cert, keyfile=key)
    except ssl.SSLError as err:
        if err.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"--tls-key {key!r} is not the private key of --tls-cert {cert!r}") from err
        raise ValueError(
            f"--tls-cert {cert!r} and --tls-key {key!r} do not load as a certificate chain and its key "
            f"({err.reason or err}): check both files"
        ) from err
