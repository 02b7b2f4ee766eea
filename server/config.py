"""The service's settings: each has one default, here, and the ``rematd serve`` flags are built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
            raise ValueError(f"warm_after_steps must be >= 1, got {self.warm_after_steps}")
        if not self.session_expiry_seconds > 0:
            raise ValueError(f"session-expiry-seconds must be positive, got {self.session_expiry_seconds}")
        if not 0 <= self.max_report_interval_seconds <= 3600:
            raise ValueError(f"max-report-interval-seconds must be in 0-3600, got {self.max_report_interval_seconds}")
        if self.quiet_steps < 1:
            raise ValueError(f"quiet_steps must be >= 1, got {self.quiet_steps}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How the record is kept."""

    url: str = "sqlite:///:memory:"
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
            raise ValueError(f"keep_steps must be >= 1, got {self.keep_steps}")
        if not self.bucket_seconds > 0:
            raise ValueError(f"bucket_seconds must be positive, got {self.bucket_seconds}")
        if not self.retention_days > 0:
            raise ValueError(f"retention-days must be positive, got {self.retention_days}")
        if not self.flush_seconds > 0:
            raise ValueError(f"flush_seconds must be positive, got {self.flush_seconds}")
        if self.max_buffered < 1:
            raise ValueError(f"max_buffered must be >= 1, got {self.max_buffered}")


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
    reuse_port: bool = False
    """SO_REUSEPORT: several worker processes share the port (else a second bind of it fails)."""

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024:
            raise ValueError(f"max-message-bytes must be >= 1024, got {self.max_message_bytes}")
        for name in ("keepalive_seconds", "keepalive_timeout_seconds", "min_client_ping_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def channel_options(self) -> list[tuple[str, Any]]:
        # Streams live for days: no max connection age or idle limit; liveness comes from pings instead.
        return [
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
        ]
