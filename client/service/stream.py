"""The background gRPC stream: a named daemon thread owns the channel.

The training thread only puts records on a bounded queue (dropping the
oldest when full) and reads the latest plan; it never waits on the network.

While the service cannot be reached the plan in force stays. After
``fallback_after_s`` without it, the stream thread plans locally from the
same profile with the same planner (plan versions continue from the plan in
force); when the service answers again its plans take over, and the hello
it receives carries the local plan's version so its history continues.

Nothing that goes wrong on the stream thread ends it: a failure is logged
(at most every 30 s), counted in ``errors``, and the thread goes on; only
the service refusing the stream (a status in ``TERMINAL``) or ``close()``
stop it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from rematd import wire
from rematd.client.service.budget_hold import BudgetHold
from rematd.client.service.fallback import FALLBACK_MAX_FAILURES, LocalPlanner
from rematd.client.service.folding import Folder
from rematd.client.service.mailbox import Mailbox
from rematd.client.service.step_record import StepRecord
from rematd.client.service.stream_config import CHANNEL_OPTIONS, StreamConfig
from rematd.client.service.stream_local import STOP, plan_locally
from rematd.client.service.stream_status import StreamEndings, rpc_status
from rematd.client.service.throttle import Throttled
from rematd.planner import Mode, Plan, PlannerSession, Shape
from rematd.planner.messages import Hello, OomReport, open_planner
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

__all__ = ["FALLBACK_MAX_FAILURES", "StreamBackend", "StreamConfig"]

log = logging.getLogger("rematd.client")

# The longest report interval taken from a service; anything else is taken as 0 (report every step).
MAX_INTERVAL_S = 3600.0


class StreamBackend:
    """Streams a rank's hello, stats and OOM events to a service; delivers plans."""

    served = True
    budget_hold = BudgetHold.UNTIL_NEWER_PLAN

    def __init__(self, target: str, on_plan: Callable[[Plan], None], config: StreamConfig | None = None) -> None:
        if not isinstance(target, str) or not target.strip():
            raise ValueError(f"server must be 'host:port', got {target!r}")
        self.target = target
        self.config = config or StreamConfig()
        self._on_plan = on_plan
        self._queue: Mailbox[object] = Mailbox(self.config.queue_size)
        self._sizes: tuple[int, int] | None = None
        """The budget and static bytes last handed to the hello (training thread only)."""
        self._last_shape: Shape | None = None
        """The shape of the last step sent (training thread only)."""
        self._lock = threading.Lock()
        self._acked = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping, self._closing, self._flush_now = threading.Event(), threading.Event(), threading.Event()
        self._hello: Hello | None = None
        self._hello_updates: dict[str, Any] = {}
        self._plan_version = 0
        self._plan_in_force: Plan | None = None
        self._session_secret = ""
        """What proves this rank's next stream is its own; never logged."""
        self._endings = StreamEndings(target)
        self._last_blocks: tuple[int, ...] | None = None
        self._folder = Folder()
        self._call: Any = None
        self._local = LocalPlanner()
        self._pricer: PlannerSession | None = None
        """A planner over this rank's profile that prices a pin in the training process (made when first asked)."""
        self._lost_at, self._throttled = time.monotonic(), Throttled()
        self.sent_step = self.acked_step = -1
        self.dropped = 0
        """Records dropped because the queue was full."""
        self.reconnects = 0
        """Connection attempts after the first."""
        self.errors = 0
        """Failures caught on the stream thread (the in-process planner's included); it goes on after each."""
        self.connected = False
        """True while the service answers on the stream."""
        self.connected_at: float | None = None
        """``time.monotonic()`` of the last (re)connection."""
        self.last_error: str | None = None

    @property
    def planning_locally(self) -> bool:
        """True while plans come from the in-process fallback planner."""
        return self._local.active

    # -- training-thread side -------------------------------------------------

    def open(self, hello: Hello) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("stream already open")
            self._hello = hello
            self._lost_at = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="rematd-stream", daemon=True)
            self._thread.start()

    def update_hello(self, **fields: Any) -> None:
        """Fields of the hello that changed since it was sent (the budget): a reconnect sends them."""
        with self._lock:
            self._hello_updates.update(fields)

    def _put(self, item: object, *, wake: bool = True) -> None:
        if not self._queue.post(item, wake=wake):
            self.dropped += 1

    def send_stats(self, step: StepRecord) -> None:
        # On the training thread: no lock and, while the stream's thread polls, no wake-up, but for a step of a
        # new length (its plan is needed by the next step).
        self.sent_step = max(self.sent_step, step.step)
        sizes = (step.budget_bytes, step.static_bytes)
        if sizes != self._sizes:
            self._sizes = sizes
            with self._lock:
                self._hello_updates.update(budget_bytes=step.budget_bytes, static_bytes=step.static_bytes)
        new_length = step.shape is not self._last_shape and step.shape != self._last_shape
        self._last_shape = step.shape
        self._put(step, wake=new_length)

    def send_oom(self, oom: OomReport) -> None:
        self._put(oom)

    def flush(self, timeout: float) -> bool:
        """Wait until every step sent was answered (by the service or the fallback).

        False when one is still unanswered after ``timeout``, or never will be: the
        service refused the stream, or it was closed.
        """
        return self._wait_acked(timeout, lambda: False)

    def _wait_acked(self, timeout: float, give_up: Callable[[], bool]) -> bool:
        """Wait until every step sent was answered, the stream stopped, or ``give_up()`` (looked at again
        whenever an answer comes or a connection ends); whether every step was answered."""
        self._flush_now.set()  # steps folded into a later report go out now
        self._queue.wake()
        try:
            with self._acked:
                self._acked.wait_for(
                    lambda: self.acked_step >= self.sent_step or self._stopping.is_set() or give_up(), timeout
                )
                return self.acked_step >= self.sent_step
        finally:
            self._flush_now.clear()

    def plan_of(self, modes: tuple[Mode, ...], version: int, reason: str, shape: Shape | None = None) -> Plan | None:
        """``modes`` as a plan priced by this rank's profile, as the service would (a pin in the training
        process: the service plans on, and hears of the modes run with each step); None before the profile."""
        if self._hello is None:
            return None
        if self._pricer is None:
            self._pricer = open_planner(self._hello)
        return self._pricer.plan_of(modes, version=version, reason=reason, shape=shape)

    def close(self, timeout: float = 5.0) -> None:
        """Deliver every step sent so far (folded ones too), waiting at most ``timeout`` as :meth:`flush` does,
        then say goodbye and stop the stream thread. Where the service is known to be away (it was lost, or
        refused the stream), nothing is waited for: what it missed is lost with the stream."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        # A first connection still being tried when close began may fail meanwhile: then nothing more is
        # owed to a service known to be away.
        if self._reachable() and not self._stopping.is_set():
            self._wait_acked(timeout, lambda: not self._reachable())
        self._put(STOP)
        self._closing.set()
        thread.join(timeout)
        self._stop()
        call = self._call
        if call is not None:
            call.cancel()
        thread.join(timeout)

    def _reachable(self) -> bool:
        """Whether the service may still answer: connected, planned for by the fallback, or its first
        connection not yet failed."""
        return self.connected or self._local.active or (self.reconnects == 0 and self.last_error is None)

    # -- stream thread ------------------------------------------------------

    def _stop(self) -> None:
        self._stopping.set()
        with self._acked:
            self._acked.notify_all()

    def _current_hello(self) -> Hello:
        """The hello as it stands now: the plan in force and its version, the budget last set."""
        assert self._hello is not None
        with self._lock:
            updates = dict(self._hello_updates)
        plan = self._plan_in_force
        return dataclasses.replace(
            self._hello,
            session_secret=self._session_secret,
            plan_version=self._plan_version,
            plan=plan if plan is not None and plan.version == self._plan_version else None,
            **updates,
        )

    def _fault(self, what: str, err: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(err).__name__}: {err}"
        self._throttled.error("rematd: %s failed (%s); the stream goes on", what, self.last_error, exc_info=err)

    def _channel(self) -> grpc.Channel:
        if self.config.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self.config.root_certificates)
            return grpc.secure_channel(self.target, creds, options=CHANNEL_OPTIONS)
        return grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)

    def _requests(self, hello: Hello, done: threading.Event) -> Iterator[pb.ClientMessage]:
        yield pb.ClientMessage(hello=wire.hello_to_pb(hello))
        folder = self._folder
        folder.restart()
        while not done.is_set() and not self._stopping.is_set():
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                report = folder.due(time.monotonic(), force=self._flush_now.is_set())
                if report is not None:
                    yield pb.ClientMessage(stats=wire.stats_to_pb(report))
                continue
            if item is STOP:
                # What was folded goes out before the goodbye (a close that could not wait for its answer).
                folded = folder.due(time.monotonic(), force=True)
                if folded is not None:
                    yield pb.ClientMessage(stats=wire.stats_to_pb(folded))
                # Before the goodbye: the service ends the stream on it, which must not read as a lost stream.
                self._stop()
                yield pb.ClientMessage(goodbye=pb.Goodbye(reason="client closed"))
                return
            try:
                if isinstance(item, StepRecord):
                    stats = item.stats()
                    self._queue.poll_s = stats.step_seconds
                    reports = folder.offer(stats, time.monotonic())
                    if self._flush_now.is_set():
                        reports.extend(r for r in (folder.due(time.monotonic(), force=True),) if r is not None)
                    msgs = [pb.ClientMessage(stats=wire.stats_to_pb(r)) for r in reports]
                elif isinstance(item, OomReport):
                    # What was folded happened before the error: it goes first.
                    folded = folder.due(time.monotonic(), force=True)
                    msgs = [pb.ClientMessage(stats=wire.stats_to_pb(folded))] if folded is not None else []
                    msgs.append(pb.ClientMessage(oom=wire.oom_to_pb(item)))
                else:
                    continue
            except Exception as err:  # one bad record is dropped; the stream carries the next
                self._fault("converting a store for the wire", err)
                continue
            yield from msgs

    def _run(self) -> None:
        delay = self.config.backoff_initial_s
        while not self._stopping.is_set():
            try:
                if self._session(delay):
                    # A stream that held is a fresh start; one that ends as soon as it is answered (a service
                    # that keeps ending streams) keeps backing off rather than reconnect several times a second.
                    delay = self.config.backoff_initial_s
                if self._stopping.is_set():
                    return
                self.reconnects += 1
                self._pause(delay * random.uniform(0.5, 1.0))
            except Exception as err:  # the training job must never die because of rematd, nor its plans stop
                self._fault("the stream thread", err)
                if self._closing.wait(delay):
                    self._stop()
            delay = min(self.config.backoff_max_s, delay * 2)

    def _session(self, delay: float) -> bool:
        """One stream to the service, until it ends; True when it held for ``backoff_max_s`` or more."""
        hello = self._current_hello()
        done = threading.Event()
        answered = False
        try:
            with self._channel() as channel:
                stub = pb_grpc.AdvisorStub(channel)
                call = stub.Session(self._requests(hello, done), metadata=self.config.metadata)
                self._call = call
                for msg in call:
                    if not self.connected:
                        self._on_connected()
                        answered = True
                    self._receive(msg)
            if not self._stopping.is_set():
                self.last_error = "the service ended the stream"
                log.warning("rematd: the service at %s ended the stream; reconnecting", self.target)
        except grpc.RpcError as err:
            code, detail = rpc_status(err)
            self.last_error = f"{code.name}: {detail}"
            if self._stopping.is_set():
                return answered
            if self._endings.final(code, detail, self.last_error, delay):
                self._stop()
        finally:
            done.set()
            self._ended()
        return answered and self._lost_at - (self.connected_at or self._lost_at) >= self.config.backoff_max_s

    def _ended(self) -> None:
        """A stream to the service is over, answered or not."""
        if self.connected:
            self._lost_at = time.monotonic()
        self.connected = False
        self._call = None
        with self._acked:
            self._acked.notify_all()  # a close waiting on this service looks again whether it is away

    def _on_connected(self) -> None:
        self.connected = True
        self.connected_at = time.monotonic()
        self._local.stop()

    def _pause(self, seconds: float) -> None:
        """Wait before reconnecting; plan locally meanwhile once the service has been gone long enough."""
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set():
            if self._closing.is_set():
                # Nobody to say goodbye to: stop at once rather than hold up close().
                self._stop()
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            after = self.config.fallback_after_s
            if after is not None and not self._local.given_up and time.monotonic() - self._lost_at >= after:
                plan_locally(self, min(left, 0.1))
            else:
                self._closing.wait(min(left, 0.1))

    def _deliver(self, plan: Plan, *, only_if_changed: bool = False) -> None:
        if only_if_changed and plan.blocks == self._last_blocks:
            return
        if plan.version >= self._plan_version:
            self._plan_version = plan.version
            self._plan_in_force = plan
        self._last_blocks = plan.blocks
        self._on_plan(plan)

    def _ack(self, step: int) -> None:
        with self._acked:
            self.acked_step = max(self.acked_step, step)
            self._acked.notify_all()

    def _receive(self, msg: pb.ServerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "plan":
            self._deliver(wire.plan_from_pb(msg.plan))
        elif kind == "ack":
            if msg.ack.session_secret:
                with self._lock:
                    self._session_secret = msg.ack.session_secret
            interval = msg.ack.report_interval_seconds
            self._folder.interval = interval if math.isfinite(interval) and 0 <= interval <= MAX_INTERVAL_S else 0.0
            self._ack(msg.ack.step)
