"""The load generator: one process holds many simulated ranks on real gRPC streams (asyncio, grpc.aio).

Each rank ends a step every ``interval`` seconds and reports as the rematd client
does: every step at first, then, once the service's acks allow it, its steady
steps folded into one report per report interval. The parent (``bench.load``)
drives each process over a pipe: ``grow`` to a number of ranks, ``measure`` for
some seconds, ``stop``.

The generator measures itself too, since it takes CPU from the server on the
same machine: its CPU, how late each scheduled report was sent (``lag``:
scheduled step end to the write) and how late its event loop woke from a 10 ms
sleep (``loop``). To keep up it is light: a folded step costs nothing (a rank
sleeps until its next report, counting the steps between), reports are built
from bytes serialized once with only the changing fields encoded per report,
and replies are read as bytes and parsed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import random
import resource
import signal
import time
from dataclasses import dataclass, field
from typing import Any

RANKS_PER_CHANNEL = 50
"""Ranks sharing one connection: well under the service's --max-streams-per-connection (100)."""
BLOCKS = 24
MAX_REPLIES = 16
"""Replies read for one report at most (plans, then its ack): a service that sends more is an error."""
PEAK_BYTES = (20 << 30) + BLOCKS * (64 << 20)
"""What the profile predicts (static + every block's activations); each report adds up to 1 MiB."""
PROBE_SECONDS = 0.01
HELLOS_IN_FLIGHT = 16
"""Hellos a generator process has unanswered at once: the ramp goes at the pace the service answers them."""
GROW_SECONDS = 180.0
"""How long a level's new ranks may take to connect (the service plans for each hello)."""
MAX_STREAMS = 6
"""Streams one rank opens at most: the first and five more after failures."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _uint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _hello_template() -> Any:
    from rematd.v1 import advisor_pb2 as pb

    return pb.ClientMessage(
        hello=pb.Hello(
            world_size=8,
            device_name="NVIDIA H100",
            model_fingerprint="bench-model",
            blocks=[
                pb.BlockProfile(
                    index=i, name=f"h.{i}", saved_bytes=64 << 20, input_bytes=8 << 20, forward_seconds=0.002
                )
                for i in range(BLOCKS)
            ],
            profile_shape=pb.Shape(batch=8, seq_len=2048, tokens=16384),
            budget_bytes=80 << 30,
            static_bytes=20 << 30,
            memory_source=pb.MEMORY_SOURCE_CUDA_ALLOCATOR,
        )
    )


class _Reports:
    """StepStats reports as bytes: the fixed fields serialized once, the four that change encoded per report."""

    def __init__(self) -> None:
        from rematd.v1 import advisor_pb2 as pb

        self._fixed = pb.StepStats(
            budget_bytes=80 << 30,
            static_bytes=20 << 30,
            total_bytes=80 << 30,
            step_seconds=1.0,
            shape=pb.Shape(batch=8, seq_len=2048, tokens=16384),
        ).SerializeToString()
        self._peaks = [_uint_field(2, PEAK_BYTES + random.randrange(1 << 20)) for _ in range(64)]
        self._numbers = {name: f.number for name, f in pb.StepStats.DESCRIPTOR.fields_by_name.items()}
        self._tag = _varint((pb.ClientMessage.DESCRIPTOR.fields_by_name["stats"].number << 3) | 2)
        probe = pb.ClientMessage.FromString(self.encode(step=3, steps=10, plan_version=2))
        if (probe.stats.step, probe.stats.steps, probe.stats.plan_version) != (3, 10, 2) or not (
            PEAK_BYTES <= probe.stats.peak_allocated_bytes < PEAK_BYTES + (1 << 20)
        ):
            raise RuntimeError(f"the hand-encoded report does not parse back: {probe}")

    def encode(self, *, step: int, steps: int, plan_version: int) -> bytes:
        n = self._numbers
        inner = b"".join(
            (
                self._fixed,
                _uint_field(n["step"], step),
                _uint_field(n["steps"], steps),
                _uint_field(n["plan_version"], plan_version),
                random.choice(self._peaks),
            )
        )
        return self._tag + _varint(len(inner)) + inner


@dataclass
class _Gen:
    """One generator process's ranks' shared state: counters, and the samples of the level being measured."""

    interval: float
    fold: bool
    reports: _Reports
    hellos: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(HELLOS_IN_FLIGHT))
    stop: bool = False
    measuring: bool = False
    live: int = 0
    """Ranks whose stream is open (hello answered)."""
    failed: int = 0
    """Streams that failed since the start (each rank opens another, up to ``MAX_STREAMS``)."""
    gave_up: int = 0
    sent: int = 0
    acked: int = 0
    errors: int = 0
    steps: int = 0
    stale: float = 0.0
    lat: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    loop: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.sent = self.acked = self.errors = self.steps = 0
        self.stale = 0.0
        self.lat, self.lag, self.loop = [], [], []


_PLAN_TAG = 0x0A  # ServerMessage field 1 (plan), length-delimited: the generator reads only this byte of a plan


def _describe(err: BaseException) -> str:
    code, details = getattr(err, "code", None), getattr(err, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"[:200]
    return repr(err)[:200]


async def _rank(session: Any, hello: bytes, gen: _Gen) -> None:
    """A rank's streams: a failed one is counted and opened again after a backoff, as the rematd client does."""
    for attempt in range(MAX_STREAMS):
        if gen.stop:
            return
        try:
            await _stream(session, hello, gen)
            return
        except asyncio.CancelledError:
            return
        except Exception as err:  # counted, not raised: one rank's failure is data
            gen.failed += 1
            if gen.measuring:
                gen.errors += 1
            if len(gen.error_samples) < 5:
                gen.error_samples.append(_describe(err))
        await asyncio.sleep(min(8.0, 0.5 * 2**attempt) * (0.5 + random.random()))
    gen.gave_up += 1


async def _stream(session: Any, hello: bytes, gen: _Gen) -> None:
    from rematd.v1 import advisor_pb2 as pb

    live = False
    # The stream opens only once a hello may go: one the service has not yet taken up is cancelled.
    await gen.hellos.acquire()
    call = session()
    try:
        try:
            await call.write(hello)
            version = pb.ServerMessage.FromString(await call.read()).plan.version
        finally:
            gen.hellos.release()
        gen.live += 1
        live = True
        loop = asyncio.get_running_loop()
        interval = gen.interval
        # Random phases, like jobs that started at different times.
        due = loop.time() + random.random() * interval  # when the step being run ends
        step = 0
        reported_at = due - interval
        report_every = 0.0  # what the service's last ack allows
        while not gen.stop:
            covers = 1
            if gen.fold and report_every > 0:
                # Steady steps the client would fold: no message, so no wake-up either; counted, not slept.
                skip = max(0, math.ceil((reported_at + report_every - due) / interval - 1e-9))
                due += skip * interval
                step += skip
                covers += skip
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            data = gen.reports.encode(step=step, steps=covers, plan_version=version)
            sent = loop.time()
            await call.write(data)
            gen.sent += 1
            for _ in range(MAX_REPLIES):
                reply = await call.read()
                if not isinstance(reply, bytes):
                    raise RuntimeError("stream ended")
                if reply[:1] != bytes([_PLAN_TAG]):
                    break
                version = pb.ServerMessage.FromString(reply).plan.version
            else:
                raise RuntimeError(f"more than {MAX_REPLIES} replies to one report")
            acked = loop.time()
            if gen.measuring:
                gen.lat.append(acked - sent)
                gen.lag.append(sent - due)
                gen.stale = max(gen.stale, sent - reported_at)
                gen.acked += 1
                gen.steps += covers
            report_every = pb.ServerMessage.FromString(reply).ack.report_interval_seconds
            reported_at = acked
            step += 1
            due += interval
    finally:
        if live:
            gen.live -= 1
        call.cancel()


async def _probe_loop(gen: _Gen) -> None:
    """How late the event loop wakes: the generator's own share of every latency it measures."""
    loop = asyncio.get_running_loop()
    while not gen.stop:
        t = loop.time()
        await asyncio.sleep(PROBE_SECONDS)
        if gen.measuring:
            gen.loop.append(loop.time() - t - PROBE_SECONDS)


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _client_main(target: str, conn: Any, index: int, interval: float, fold: bool, deadline: float) -> None:
    import grpc

    from rematd.client.service.stream_config import CHANNEL_OPTIONS
    from rematd.v1 import advisor_pb2 as pb

    gen = _Gen(interval=interval, fold=fold, reports=_Reports())
    template = _hello_template()
    channels: list[Any] = []
    tasks: list[asyncio.Task[None]] = []
    loop = asyncio.get_running_loop()
    probe = asyncio.create_task(_probe_loop(gen))
    try:
        while time.monotonic() < deadline:
            if not await loop.run_in_executor(None, conn.poll, 1.0):
                continue
            cmd, arg = conn.recv()
            if cmd == "grow":
                want = int(arg)
                while len(tasks) < want and time.monotonic() < deadline:
                    if len(tasks) % RANKS_PER_CHANNEL == 0:
                        # A connection of its own: channels to one target otherwise share one (gRPC's global
                        # subchannel pool), and one connection reaches one worker of the service, whatever
                        # the kernel would spread over them (SO_REUSEPORT).
                        # The rematd client's balancing: a target of several replicas spreads the ranks.
                        options = [("grpc.use_local_subchannel_pool", 1), *CHANNEL_OPTIONS]
                        channels.append(grpc.aio.insecure_channel(target, options=options))
                        # Streams started on a channel still connecting fail at once (CANCELLED, INTERNAL).
                        await asyncio.wait_for(channels[-1].channel_ready(), 30)
                    session = channels[-1].stream_stream(
                        "/rematd.v1.Advisor/Session", request_serializer=None, response_deserializer=None
                    )
                    n = len(tasks)
                    hello = pb.ClientMessage()
                    hello.CopyFrom(template)
                    # A job of 8 ranks per 8 tasks, so jobs look like real ones.
                    hello.hello.job_id = f"bench-{index}-{n // 8}"
                    hello.hello.rank = n % 8
                    tasks.append(asyncio.create_task(_rank(session, hello.SerializeToString(), gen)))
                    if n % 100 == 99:
                        await asyncio.sleep(0)  # the ranks already connected keep their schedule
                until = min(deadline, time.monotonic() + GROW_SECONDS)
                while gen.live + gen.gave_up < want and time.monotonic() < until:
                    await asyncio.sleep(0.1)
                gc.collect()
                gc.freeze()  # the ranks' long-lived objects: out of every later collection
                conn.send(("grown", None))
            elif cmd == "measure":
                gen.reset()
                cpu0, t0 = _cpu_self(), time.monotonic()
                gen.measuring = True
                await asyncio.sleep(float(arg))
                gen.measuring = False
                cpu = (_cpu_self() - cpu0) / (time.monotonic() - t0)
                out = {k: getattr(gen, k) for k in ("lat", "lag", "loop", "sent", "acked", "errors", "steps")}
                out.update(stale=gen.stale, live=gen.live, failed=gen.failed, gave_up=gen.gave_up, cpu=cpu)
                out.update(error_samples=gen.error_samples)
                conn.send(("measured", out))
            elif cmd == "stop":
                break
    finally:
        gen.stop = True
        for task in [*tasks, probe]:
            task.cancel()
        await asyncio.wait([*tasks, probe], timeout=10)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(ch.close(grace=None) for ch in channels)), 10)
        with contextlib.suppress(OSError):
            conn.send(("stopped", None))


def client_process(target: str, conn: Any, index: int, interval: float, fold: bool, deadline: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The generator's own collector pauses would show up as service latency.
    gc.set_threshold(100_000, 50, 1000)
    asyncio.run(_client_main(target, conn, index, interval, fold, deadline))
