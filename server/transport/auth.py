"""Bearer-token checks shared by both transports."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from rematd.server.config import ServeConfig, is_loopback
from rematd.server.core.errors import Unauthenticated
from rematd.server.credentials import token_problem

METADATA_KEY = "authorization"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenAuth:
    """Who may write, and who may read."""

    token: str | None = None
    """The bearer token writes need; None: HTTP writes are open only while ``open_writes``."""
    open_reads: bool = True
    """Reads need no token (true when the HTTP side binds loopback, or with --public-reads)."""
    open_writes: bool = True
    """With no token, HTTP writes are open (true only when the HTTP side binds loopback)."""
    closed_metrics: bool = False
    """/metrics needs the token (--metrics-need-token)."""

    def __post_init__(self) -> None:
        problem = token_problem(self.token)
        if problem:
            raise ValueError(problem)

    @classmethod
    def serving(cls, cfg: ServeConfig) -> TokenAuth:
        """Who may write and read a service started with ``cfg``."""
        loopback = is_loopback(cfg.http_host)
        return cls(
            token=cfg.token,
            open_reads=cfg.public_reads or loopback,
            open_writes=loopback,
            closed_metrics=cfg.metrics_need_token,
        )

    def check(self, header: str | None) -> None:
        """Raise Unauthenticated unless ``header`` is ``Bearer <token>``."""
        if self.token is None:
            return
        if not header:
            raise Unauthenticated("this needs 'authorization: Bearer <token>'")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise Unauthenticated("the bearer token is wrong")

    def check_write(self, header: str | None) -> None:
        """An HTTP write: the token when there is one; with none, only on a loopback service."""
        if self.token is None and not self.open_writes:
            raise Unauthenticated("writes need a token, and this service has none: it binds HTTP beyond loopback")
        self.check(header)

    def check_read(self, header: str | None) -> None:
        if not self.open_reads:
            self.check(header)
