"""Bearer-token checks shared by both transports."""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from rematd.server.core.errors import Unauthenticated

TOKEN_ENV = "REMATD_TOKEN"
METADATA_KEY = "authorization"


def load_token(token_file: str | None) -> str | None:
    """The token from ``--token-file`` (first line) or else $REMATD_TOKEN; None when neither is set."""
    if token_file:
        path = Path(token_file)
        try:
            token = path.read_text(encoding="utf-8").strip().splitlines()[0].strip() if path.stat().st_size else ""
        except OSError as err:
            raise ValueError(f"token-file {token_file!r} cannot be read: {err.strerror}") from err
        if not token:
            raise ValueError(f"token-file {token_file!r} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def load_job_tokens(path: str) -> dict[str, str]:
    """``--job-tokens-file``: ``JOB TOKEN`` per line (``JOB`` may be a shell pattern such as ``team-a-*``;
    ``#`` starts a comment); ValueError naming the file and line when one is not that."""
    if not path:
        return {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"job-tokens-file {path!r} cannot be read: {err.strerror}") from err
    tokens: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2 or len(words[1]) < 16:
            raise ValueError(f"job-tokens-file {path!r} line {n}: want 'JOB TOKEN' with a token of 16+ characters")
        tokens[words[0]] = words[1]
    return tokens


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
        if self.token is not None and (len(self.token) < 16 or any(c.isspace() for c in self.token)):
            raise ValueError("token must be at least 16 characters with no whitespace")

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
