"""The background gRPC stream: a named daemon thread owns the channel.

The training thread only puts records on a bounded queue (dropping the
oldest when full) and reads the latest plan; it never waits on the network.

While the service cannot be reached the plan in force stays. After
``fallback_after_s`` without it, the stream thread plans locally from the
same profile with the same planner (plan versions continue from the plan in
force); when the service answers again its plans take over, and the hello
it receives carries the local plan's version so its history continues.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from rematd import wire
from rematd.client.backends import PlanCallback
from rematd.planner import Plan, PlannerSession
from rematd.records import Hello, OomReport, StepStats, observation, open_planner
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

TOKEN_ENV = "REMATD_TOKEN"

_STOP = object()


def _read_roots(value: str | os.PathLike[str] | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    path = Path(value)
    try:
        return path.read_bytes()
    except OSError as err:
        raise ValueError(f"root_certificates: cannot read {str(path)!r}: {err.strerror or err}") from err


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamConfig:
    """How a rank talks to the service."""

    queue_size: int = 256
    """Records waiting for the stream; when full the oldest is dropped (and counted)."""
    backoff_initial_s: float = 0.2
    """First pause before reconnecting; doubles per failed attempt."""
    backoff_max_s: float = 4.0
    """Longest pause between attempts; each pause is jittered to 50-100% of the current one."""
    fallback_after_s: float | None = 60.0
    """Seconds without the service after which plans are made in-process; ``None`` never does."""
    token: str | None = None
    """Bearer token sent as ``authorization`` metadata; ``None`` sends none."""
    tls: bool = False
    """Use TLS (``grpc.secure_channel``); implied by ``root_certificates``."""
    root_certificates: bytes | None = None
    """PEM roots that sign the service's certificate; ``None`` uses the system's."""

    def __post_init__(self) -> None:
        if isinstance(self.queue_size, bool) or not isinstance(self.queue_size, int) or self.queue_size < 1:
            raise ValueError(f"queue_size must be an integer >= 1, got {self.queue_size!r}")
        if not self.backoff_initial_s > 0:
            raise ValueError(f"backoff_initial_s must be positive, got {self.backoff_initial_s!r}")
        if not self.backoff_max_s >= self.backoff_initial_s:
            raise ValueError(f"backoff_max_s must be >= backoff_initial_s, got {self.backoff_max_s!r}")
        if self.fallback_after_s is not None and not self.fallback_after_s >= 0:
            raise ValueError(f"fallback_after_s must be >= 0 or None, got {self.fallback_after_s!r}")
        if self.token is not None and (
            not self.token or any(not (0x20 < ord(c) < 0x7F) for c in self.token) or len(self.token) > 4096
        ):
            raise ValueError("token must be 1-4096 printable ASCII characters without spaces")

    @classmethod
    def build(
        cls,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: str | os.PathLike[str] | bytes | None = None,
        **rest: Any,
    ) -> StreamConfig:
        """From ``attach``'s arguments: the token defaults to ``$REMATD_TOKEN``, a path of roots is read."""
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        roots = _read_roots(root_certificates)
        return cls(token=token, tls=tls or roots is not None, root_certificates=roots, **rest)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


class StreamBackend:
    """Streams a rank's hello, stats and OOM events to a service; delivers plans."""

    def __init__(self, target: str, on_plan: PlanCallback, config: StreamConfig | None = None) -> None:
        if not isinstance(target, str) or not target.strip():
            raise ValueError(f"server must be 'host:port', got {target!r}")
        self.target = target
        self.config = config or StreamConfig()
        self._on_plan = on_plan
        self._queue: queue.Queue[object] = queue.Queue(maxsize=self.config.queue_size)
        self._lock = threading.Lock()
        self._acked = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closing = threading.Event()
        self._hello: Hello | None = None
        self._plan_version = 0
        self._last_blocks: tuple[int, ...] | None = None
        self._call: Any = None
        self._fallback: PlannerSession | None = None
        self._lost_at = time.monotonic()
        self.sent_step = -1
        self.acked_step = -1
        self.dropped = 0
        """Records dropped because the queue was full."""
        self.reconnects = 0
        """Connection attempts after the first."""
        self.connected = False
        """True while the service answers on the stream."""
        self.connected_at: float | None = None
        """``time.monotonic()`` of the last (re)connection."""
        self.planning_locally = False
        """True while plans come from the in-process fallback planner."""
        self.last_error: str | None = None

    # -- training-thread side -------------------------------------------------

    def open(self, hello: Hello) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("stream already open")
            self._hello = hello
            self._lost_at = time.monotonic()
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
        """Wait until every step sent was answered (by the service or the fallback); False on timeout."""
        with self._acked:
            return self._acked.wait_for(lambda: self.acked_step >= self.sent_step or self._stopping.is_set(), timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        self._put(_STOP)
        self._closing.set()
        thread.join(timeout)
        self._stopping.set()
        call = self._call
        if call is not None:
            call.cancel()
        thread.join(timeout)
        with self._acked:
            self._acked.notify_all()

    # -- stream thread ------------------------------------------------------

    def _channel(self) -> grpc.Channel:
        if self.config.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self.config.root_certificates)
            return grpc.secure_channel(self.target, creds)
        return grpc.insecure_channel(self.target)

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
        delay = self.config.backoff_initial_s
        while not self._stopping.is_set():
            assert self._hello is not None
            hello = dataclasses.replace(self._hello, plan_version=self._plan_version)
            done = threading.Event()
            try:
                with self._channel() as channel:
                    stub = pb_grpc.AdvisorStub(channel)
                    call = stub.Session(self._requests(hello, done), metadata=self.config.metadata)
                    self._call = call
                    for msg in call:
                        if not self.connected:
                            self._on_connected()
                            delay = self.config.backoff_initial_s
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
                    self._stopping.set()
                    return
                log.warning("rematd stream to %s lost (%s); retrying in %.1fs", self.target, self.last_error, delay)
            except Exception as err:  # the training job must never die because of rematd
                self.last_error = f"{type(err).__name__}: {err}"
                log.exception("rematd stream failed; retrying")
            finally:
                done.set()
                if self.connected:
                    self._lost_at = time.monotonic()
                self.connected = False
                self._call = None
            self.reconnects += 1
            self._pause(delay * random.uniform(0.5, 1.0))
            delay = min(self.config.backoff_max_s, delay * 2)

    def _on_connected(self) -> None:
        self.connected = True
        self.connected_at = time.monotonic()
        if self._fallback is not None:
            log.info("rematd service is back; its plans replace the in-process planner's")
        self._fallback = None
        self.planning_locally = False

    def _pause(self, seconds: float) -> None:
        """Wait before reconnecting; plan locally meanwhile once the service has been gone long enough."""
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set():
            if self._closing.is_set():
                # Nobody to say goodbye to: stop at once rather than hold up close().
                self._stopping.set()
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            after = self.config.fallback_after_s
            if after is not None and time.monotonic() - self._lost_at >= after:
                self._plan_locally(min(left, 0.1))
            else:
                self._closing.wait(min(left, 0.1))

    def _plan_locally(self, timeout: float) -> None:
        assert self._hello is not None
        if self._fallback is None:
            hello = dataclasses.replace(self._hello, plan_version=self._plan_version)
            self._fallback = open_planner(hello, first_version=self._plan_version + 1)
            self.planning_locally = True
            log.warning("rematd service unreachable for %.0fs; planning in-process", time.monotonic() - self._lost_at)
            self._deliver(self._fallback.plan, only_if_changed=True)
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return
        if item is _STOP:
            self._stopping.set()
            return
        plan: Plan | None = None
        if isinstance(item, StepStats):
            plan = self._fallback.observe(observation(self._hello, item))
            self._ack(item.step)
        elif isinstance(item, OomReport):
            plan = self._fallback.report_oom()
        if plan is not None:
            self._deliver(plan)

    def _deliver(self, plan: Plan, *, only_if_changed: bool = False) -> None:
        if only_if_changed and plan.blocks == self._last_blocks:
            return
        self._plan_version = max(self._plan_version, plan.version)
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
            self._ack(msg.ack.step)
