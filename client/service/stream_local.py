"""The stream thread's planning in-process while the service is away (after ``fallback_after_s``): the same
planner over the same profile, its plan versions continuing from the plan in force, fed by the records the
training thread keeps putting on the stream's queue."""

from __future__ import annotations

import logging
import queue
import time
from typing import Protocol

from rematd.client.service.fallback import LocalPlanner
from rematd.client.service.folding import Folder
from rematd.client.service.mailbox import Mailbox
from rematd.client.service.step_record import StepRecord
from rematd.planner import Plan
from rematd.planner.messages import Hello, OomReport, StepStats

log = logging.getLogger("rematd.client")

STOP = object()
"""Put on the stream's queue by ``close()``: the stream thread says goodbye and ends."""


class AwayStream(Protocol):
    """What planning in-process needs of the stream (:class:`rematd.client.service.stream.StreamBackend`)."""

    _local: LocalPlanner
    _folder: Folder
    _queue: Mailbox[object]
    _plan_version: int
    _lost_at: float

    def _current_hello(self) -> Hello: ...
    def _deliver(self, plan: Plan, *, only_if_changed: bool = False) -> None: ...
    def _ack(self, step: int) -> None: ...
    def _stop(self) -> None: ...
    def _fault(self, what: str, err: BaseException) -> None: ...


def plan_locally(stream: AwayStream, timeout: float) -> None:
    """One turn of planning in-process while the service is away: the first plan from the profile, then a
    plan for each record the stream thread takes off the queue (waiting at most ``timeout`` for one)."""
    try:
        _plan_one(stream, timeout)
    except Exception as err:
        stream._fault("the in-process planner", err)
        stream._local.failed()
    else:
        stream._local.succeeded()


def _plan_one(stream: AwayStream, timeout: float) -> None:
    if not stream._local.active:
        first = stream._local.start(stream._current_hello(), next_version=stream._plan_version + 1)
        log.warning("rematd service unreachable for %.0fs; planning in-process", time.monotonic() - stream._lost_at)
        stream._deliver(first, only_if_changed=True)
    try:
        item = stream._folder.due(time.monotonic(), force=True) or stream._queue.get(timeout=timeout)
    except queue.Empty:
        return
    if item is STOP:
        stream._stop()
        return
    if isinstance(item, StepRecord | StepStats | OomReport):
        record = item.stats() if isinstance(item, StepRecord) else item
        plan = stream._local.take(record, stream._current_hello())
        if isinstance(record, StepStats):
            stream._ack(record.step)
        if plan is not None:
            stream._deliver(plan)
