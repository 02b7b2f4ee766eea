"""What a status the service ends a stream with means for the stream: refused for good (``TERMINAL``), ended
by an operator, the rank held by another process, or lost (retried after a pause: the service may come back);
each said in the training job's log as it deserves."""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger("rematd.client")

# The service will never accept this stream as it is: stop and keep the plan in force. Any other
# status, and a stream the service ends normally, is retried after a pause: the service may come back.
TERMINAL = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)

# How the service words a stream it ends because an operator ended the job.
ENDED_BY_OPERATOR = "was ended by an operator"
HELD_BY = "is held by"
"""What the service says of a rank another process holds (it names that process)."""


def rpc_status(err: grpc.RpcError) -> tuple[grpc.StatusCode, str | None]:
    """The status code and details a failed stream ended with."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = err.details() if hasattr(err, "details") else str(err)
    return code, detail


class StreamEndings:
    """Reads the status each stream to one service ended with; says in the log what follows."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._told_held = False

    def final(self, code: grpc.StatusCode, detail: str | None, error: str, delay: float) -> bool:
        """Whether a stream that ended with ``code`` and ``detail`` (``error``: both in words) stops for good;
        else it is retried after ``delay`` seconds or so."""
        if code == grpc.StatusCode.FAILED_PRECONDITION and ENDED_BY_OPERATOR in (detail or ""):
            # Not a fault: an operator's decision, which the training job's log must show.
            log.warning(
                "rematd: an operator ended this job at %s (%s); reports stop, the plan in force stays",
                self.target,
                detail,
            )
            return True
        if code in TERMINAL:
            log.error("rematd service refused the stream (%s); keeping the plan in force", error)
            return True
        if code == grpc.StatusCode.ABORTED and HELD_BY in (detail or ""):
            # Another process holds this rank: said once, then retried quietly while training goes on.
            level = logging.DEBUG if self._told_held else logging.WARNING
            self._told_held = True
            log.log(level, "rematd: the service refused this rank (%s); training goes on, retrying", detail)
        else:
            log.warning("rematd stream to %s lost (%s); retrying in %.1fs", self.target, error, delay)
        return False
