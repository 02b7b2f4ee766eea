"""The service's domain errors, mapped once per transport (gRPC status codes, HTTP codes with JSON)."""

from __future__ import annotations

from rematd.planner.messages import InvalidMessage

__all__ = [
    "InvalidMessage",
    "JobEnded",
    "JobNotFound",
    "SessionError",
    "SessionTaken",
    "ShuttingDown",
    "Unauthenticated",
]


class JobNotFound(LookupError):
    """No job of that name is known."""

    def __init__(self, job: str) -> None:
        super().__init__(f"no job named {job!r}")
        self.job = job


class SessionError(RuntimeError):
    """A message that does not fit the session's state (stats before hello, a job ended by an operator)."""


class JobEnded(SessionError):
    """An operator ended the job: its ranks are told so, and stop reporting."""


class SessionTaken(RuntimeError):
    """A hello for a rank whose session is live on another stream, without that session's secret."""


class Unauthenticated(PermissionError):
    """A write, or a read that needs it, came without the right bearer token."""


class ShuttingDown(RuntimeError):
    """The service is draining and takes no new sessions."""


class StoreStalled(RuntimeError):
    """The store's database is not answering (a probe write is overdue): work that would wait on it is
    refused at once rather than held for as long as the database is away."""
