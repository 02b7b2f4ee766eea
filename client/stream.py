"""The background gRPC stream: a named daemon thread owns the channel.

The training thread only puts records on a bounded queue (dropping the
oldest when full) and reads the latest plan; it never waits on the network.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from rematd import wire
from rematd.client.backends import PlanCallback
from rematd.records import Hello, OomReport, StepStats
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

log = logging.getLogger("rematd.client")

# Worth another try after a pause: the service may come back.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)
# The service will never accept this stream as it is: stop and keep the plan in force.
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

_STOP = object()


class StreamBackend:
    """Streams a rank's hello, stats and OOM events to a service; delivers plans."""

    def __init__(
        self,
        target: str,
        on_plan: PlanCallback,
        *,
        queue_size: int = 256,
        backoff_initial: float = 0.2,
        backoff_max: float = 10.0,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.target = target
        self._on_plan = on_plan
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._lock = threading.Lock()
        self._acked = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._hello: Hello | None = None
        self._plan_version = 0
        self._call: Any = None
        self.sent_step = -1
        self.acked_step = -1
        self.dropped = 0
        self.reconnects = 0
        self.connected = False
        self.last_error: str | None = None

    # -- training-thread side -------------------------------------------------

    def open(self, hello: Hello) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("stream already open")
            self._hello = hello
            self._thread = threading.Thread(target=self._run, name="rematd-stream", daemon=True)
            self._thread.start()

    def _put(self, item: object) -> None:
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def send_stats(self, stats: StepStats) -> None:
        with self._lock:
            self.sent_step = max(self.sent_step, stats.step)
        self._put(stats)

    def send_oom(self, oom: OomReport) -> None:
        self._put(oom)

    def flush(self, timeout: float) -> bool:
        """Wait until the service has answered every step sent; False on timeout."""
        with self._acked:
            return self._acked.wait_for(lambda: self.acked_step >= self.sent_step or self._stopping.is_set(), timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        self._put(_STOP)
        thread.join(timeout)
        self._stopping.set()
        call = self._call
        if call is not None:
            call.cancel()
        thread.join(timeout)
        with self._acked:
            self._acked.notify_all()

    # -- stream thread ------------------------------------------------------

    def _requests(self, hello: Hello, done: threading.Event) -> Iterator[pb.ClientMessage]:
        yield pb.ClientMessage(hello=wire.hello_to_pb(hello))
        while not done.is_set() and not self._stopping.is_set():
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is _STOP:
                yield pb.ClientMessage(goodbye=pb.Goodbye(reason="client closed"))
                self._stopping.set()
                return
            if isinstance(item, StepStats):
                yield pb.ClientMessage(stats=wire.stats_to_pb(item))
            elif isinstance(item, OomReport):
                yield pb.ClientMessage(oom=wire.oom_to_pb(item))

    def _run(self) -> None:
        delay = self._backoff_initial
        while not self._stopping.is_set():
            assert self._hello is not None
            hello = dataclasses.replace(self._hello, plan_version=self._plan_version)
            done = threading.Event()
            try:
                with grpc.insecure_channel(self.target) as channel:
                    stub = pb_grpc.AdvisorStub(channel)
                    call = stub.Session(self._requests(hello, done))
                    self._call = call
                    for msg in call:
                        if not self.connected:
                            self.connected = True
                            delay = self._backoff_initial
                        self._receive(msg)
                    return
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
                detail = err.details() if hasattr(err, "details") else str(err)
                self.last_error = f"{code.name}: {detail}"
                if self._stopping.is_set():
                    return
                if code in TERMINAL:
                    log.error("rematd service refused the stream (%s); keeping the plan in force", self.last_error)
                    return
                log.warning("rematd stream to %s lost (%s); retrying in %.1fs", self.target, self.last_error, delay)
            except Exception as err:  # the training job must never die because of rematd
                self.last_error = f"{type(err).__name__}: {err}"
                log.exception("rematd stream failed; retrying")
            finally:
                done.set()
                self.connected = False
                self._call = None
            self.reconnects += 1
            self._stopping.wait(delay * random.uniform(0.5, 1.5))
            delay = min(self._backoff_max, delay * 2)

    def _receive(self, msg: pb.ServerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "plan":
            plan = wire.plan_from_pb(msg.plan)
            self._plan_version = plan.version
            self._on_plan(plan)
        elif kind == "ack":
            with self._acked:
                self.acked_step = max(self.acked_step, msg.ack.step)
                self._acked.notify_all()
