"""Pages of the REST lists: ``limit`` rows from after ``cursor``, and the cursor of the next page.

A cursor is opaque to clients (URL-safe base64 of where the page ended): the store's row id for a
job's plans and OOM events, (creation time, name) for jobs. A list of 10,000 jobs answered at once
was 21 MiB; a page is bounded by its limit.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Generic, TypeVar

from rematd.planner.messages import InvalidMessage

JOBS_PAGE = 500
"""Jobs a page holds unless it asks for another number (at most ``MAX_JOBS_PAGE``)."""
MAX_JOBS_PAGE = 5000
ROWS_PAGE = 1000
"""Plans or OOM events a page holds unless it asks for another number (at most ``MAX_ROWS_PAGE``)."""
MAX_ROWS_PAGE = 10_000


_Row = TypeVar("_Row")
_Position = TypeVar("_Position")


@dataclass(frozen=True, slots=True)
class Page(Generic[_Row]):
    rows: list[_Row]
    next_cursor: str | None
    """Where the next page starts; None on the last page."""


def encode(position: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(position, separators=(",", ":")).encode()).decode().rstrip("=")


def decode(cursor: str | None, kind: type[_Position]) -> _Position | None:
    """The position a cursor holds (of type ``kind``), None for none; InvalidMessage naming ``cursor`` else."""
    if cursor is None:
        return None
    try:
        position = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        position = None
    if not isinstance(position, kind):
        raise InvalidMessage("cursor", "is not a cursor this list gave (pass next_cursor as it came)")
    return position
