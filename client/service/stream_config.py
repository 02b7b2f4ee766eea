"""How a rank reaches the service: queue, backoff, fallback, token and TLS settings."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKEN_ENV = "REMATD_TOKEN"

CHANNEL_OPTIONS = (("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),)
"""A target that resolves to several replicas (``dns:///rematd-headless.ns.svc:50051`` on a headless
Service, or ``ipv4:10.0.0.1:50051,10.0.0.2:50051``) gets a stream on one of them per rank, the ranks
spread over them (round_robin); a stream stays where it is until that replica goes away."""


def _read_roots(value: str | os.PathLike[str] | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    path = Path(value)
    try:
        return path.read_bytes()
    except OSError as err:
        raise ValueError(f"root_certificates: cannot read {str(path)!r}: {err.strerror or err}") from err


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamConfig:
    """How a rank talks to the service."""

    queue_size: int = 256
    """Records waiting for the stream; when full the oldest is dropped (and counted)."""
    backoff_initial_s: float = 0.2
    """First pause before reconnecting; doubles per failed attempt."""
    backoff_max_s: float = 4.0
    """Longest pause between attempts; each pause is jittered to 50-100% of the current one."""
    fallback_after_s: float | None = 60.0
    """Seconds without the service after which plans are made in-process; ``None`` never does."""
    token: str | None = None
    """Bearer token sent as ``authorization`` metadata; ``None`` sends none."""
    tls: bool = False
    """Use TLS (``grpc.secure_channel``); implied by ``root_certificates``."""
    root_certificates: bytes | None = None
    """PEM roots that sign the service's certificate; ``None`` uses the system's."""

    def __post_init__(self) -> None:
        if isinstance(self.queue_size, bool) or not isinstance(self.queue_size, int) or self.queue_size < 1:
            raise ValueError(f"queue_size must be an integer >= 1, got {self.queue_size!r}")
        if not self.backoff_initial_s > 0:
            raise ValueError(f"backoff_initial_s must be positive, got {self.backoff_initial_s!r}")
        if not self.backoff_max_s >= self.backoff_initial_s:
            raise ValueError(f"backoff_max_s must be >= backoff_initial_s, got {self.backoff_max_s!r}")
        if self.fallback_after_s is not None and not self.fallback_after_s >= 0:
            raise ValueError(f"fallback_after_s must be >= 0 or None, got {self.fallback_after_s!r}")
        if self.token is not None and (
            not self.token or any(not (0x20 < ord(c) < 0x7F) for c in self.token) or len(self.token) > 4096
        ):
            raise ValueError("token must be 1-4096 printable ASCII characters without spaces")

    @classmethod
    def build(
        cls,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: str | os.PathLike[str] | bytes | None = None,
        **rest: Any,
    ) -> StreamConfig:
        """From ``attach``'s arguments: the token defaults to ``$REMATD_TOKEN``, a path of roots is read."""
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        roots = _read_roots(root_certificates)
        return cls(token=token, tls=tls or roots is not None, root_certificates=roots, **rest)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()
