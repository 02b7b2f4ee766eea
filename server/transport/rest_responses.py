"""What the API's schema says a route may answer besides its success, and a read view as its JSON answer."""

from __future__ import annotations

from fastapi import Response
from pydantic_core import to_json

from rematd.server.transport.http_guard import MAX_BODY_BYTES
from rematd.server.transport.rest_models import Invalid, Problem


def as_json(view: object) -> Response:
    """A read view as JSON, as it is. The endpoint's response model documents it, and the tests hold every view
    to its model; validating each row here would cost more than ten times the encoding on a large read, in the
    process that serves the training ranks' streams."""
    return Response(to_json(view), media_type="application/json")


Responses = dict[int | str, dict[str, object]]


def _problem(description: str) -> dict[str, object]:
    return {"model": Problem, "description": description}


EVERY: Responses = {
    400: _problem(
        "a request that reads two ways or not at all: a header that says who is asking given twice, a body framed "
        "by both Content-Length and Transfer-Encoding, a line ending in a bare LF, a folded header, a head over "
        "64 KiB, or one HTTP cannot parse"
    ),
    500: _problem("the service failed handling this request (its log says why)"),
}
"""What any request may be answered besides its route's own."""
UNAUTHORIZED: Responses = {401: _problem("missing or wrong bearer token")}
STORE_AWAY: Responses = {503: _problem("the store is out of reach, or other large reads are under way (Retry-After)")}
NO_JOB: Responses = {404: _problem("no job of that name")}
INVALID: Responses = {422: {"model": Invalid, "description": "a parameter or body the service cannot take"}}
WRITES: Responses = {
    **UNAUTHORIZED,
    **STORE_AWAY,
    **NO_JOB,
    **INVALID,
    403: _problem("sent from another site, or without a token to a name that is not loopback's"),
    413: _problem(f"a body over {MAX_BODY_BYTES} bytes"),
}
