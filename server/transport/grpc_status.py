"""The domain's errors as gRPC status codes, in one place."""

from __future__ import annotations

import grpc

from rematd.planner.messages import InvalidMessage
from rematd.server.core.errors import (
    JobNotFound,
    SessionError,
    SessionTaken,
    ShuttingDown,
    StoreStalled,
    Unauthenticated,
)


def status_of(err: BaseException) -> grpc.StatusCode:
    """The one place domain errors become gRPC status codes.

    Only a message the client got wrong (InvalidMessage, which names the field) is INVALID_ARGUMENT,
    which the client takes as final. Every other error, a plain ValueError from a bug included, is a
    fault of the service: INTERNAL, which the client retries with backoff.
    """
    if isinstance(err, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(err, JobNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(err, SessionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(err, SessionTaken):
        # Retried by clients: once the other stream has ended, the rank may start a session of its own.
        return grpc.StatusCode.ABORTED
    if isinstance(err, (ShuttingDown, StoreStalled)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(err, InvalidMessage):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


DOMAIN_ERRORS = (
    InvalidMessage,
    SessionError,
    SessionTaken,
    JobNotFound,
    Unauthenticated,
    ShuttingDown,
    StoreStalled,
)
RECONNECT = "server shutting down; reconnect"
