"""Load curve of ``rematd serve``: simulated ranks on real gRPC streams, a step a second each.

Starts a ``rematd serve`` subprocess on loopback, then load-generator
processes that each hold many ranks (asyncio, grpc.aio, many streams per
channel), growing the number of ranks level by level. Each rank ends a step
every ``--interval`` seconds and reports it as the rematd client does: every
step at first, then, once the service's acks allow it (the plan has held, no
risk), its steady steps folded into one report per report interval
(``--no-fold``: every step regardless). At each level, after a settle, for a
bounded time, it measures the time from sending a report to reading its ack,
how stale the service's view of any rank got, the server's CPU (all its
processes) and its memory per rank. Prints a table and writes JSON.

    .venv/bin/python bench/load.py --ranks 1000,5000,10000 --seconds 20 --workers 2

The generator runs on the same machine and takes CPU from the server, so it
measures itself too: its CPU, how late each scheduled report was sent
(``lag``: scheduled step end to the write) and how late its event loop woke
from a 10 ms sleep (``loop``). A generator that keeps up sends within a few
milliseconds of schedule; when it does not, its lag is in the latency too.
To keep up it is light: a folded step costs nothing (a rank sleeps until its
next report, counting the steps between), reports are built from bytes
serialized once with only the changing fields encoded per report, and replies
are read as bytes and parsed once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import random
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RANKS_PER_CHANNEL = 100
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


@dataclass
class Level:
    ranks: int
    seconds: float
    sent: int
    acked: int
    errors: int
    """Streams that failed while measuring."""
    live: int
    """Ranks with an open stream at the end of the measurement."""
    failed_streams: int
    ramp_s: float
    """Seconds this level's new ranks took to connect (hellos answered)."""
    """Streams that failed at this level, its ramp included (each rank opens another after a backoff)."""
    gave_up: int
    """Ranks that stopped after ``MAX_STREAMS`` failed streams, since the start."""
    rate_per_s: float
    steps_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    stale_s: float
    server_cpu_cores: float
    server_rss_mib: float
    server_kib_per_rank: float
    gen_cpu_cores: float
    gen_lag_p50_ms: float
    gen_lag_p99_ms: float
    gen_lag_max_ms: float
    gen_loop_p99_ms: float
    load_1m: float
    """The machine's load average at the end of the measurement: other work competes for the same cores."""
    ok: bool


# -- the client side: one process holds many ranks ----------------------------------------------------


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
                        channels.append(grpc.aio.insecure_channel(target))
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


def _client_process(target: str, conn: Any, index: int, interval: float, fold: bool, deadline: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The generator's own collector pauses would show up as service latency.
    gc.set_threshold(100_000, 50, 1000)
    asyncio.run(_client_main(target, conn, index, interval, fold, deadline))


# -- the server side ------------------------------------------------------------------------------------


def _proc_tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    out.extend(_proc_tree(int(child)))
    except OSError:
        pass
    return out


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
            total += int(m.group(1)) * 1024 if m else 0
        except OSError:
            pass
    return total


@dataclass
class _Server:
    proc: subprocess.Popen[str]
    target: str
    output: collections.deque[str]

    def stop(self) -> None:
        """SIGTERM to the server's process group (its workers too), SIGKILL if it has not gone in 30 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _start_server(db: Path, workers: int, report_interval: float) -> _Server:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cmd = [
        sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", str(port), "--http-port", "0",
        "--db", str(db), "--log-level", "warning", "--workers", str(workers),
        "--max-report-interval-seconds", str(report_interval),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    server = _Server(proc, f"127.0.0.1:{port}", collections.deque(maxlen=40))
    serving = threading.Event()

    def drain() -> None:  # a full pipe would stall the server; the tail is kept for when it dies
        assert proc.stdout is not None
        for line in proc.stdout:
            server.output.append(line)
            if "serving gRPC on" in line:
                serving.set()

    threading.Thread(target=drain, daemon=True).start()
    if not serving.wait(60) or proc.poll() is not None:
        server.stop()
        raise RuntimeError("rematd serve did not start:\n" + "".join(server.output))
    # The other workers print nothing; give them a moment to bind.
    time.sleep(2.0 if workers > 1 else 0.2)
    return server


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def _recv(conn: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"a load generator did not answer {what} within {timeout:g} s")
    return conn.recv()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1000,5000,10000", help="comma-separated levels of ranks")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per level (after a settle)")
    p.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="seconds at a level before measuring (new ranks report every step for their first 16)",
    )
    p.add_argument("--workers", type=int, default=2, help="server worker processes (--workers of rematd serve)")
    p.add_argument("--clients", type=int, default=2, help="load-generator processes")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between a rank's steps (1: 1 Hz)")
    p.add_argument(
        "--report-interval",
        type=float,
        default=10.0,
        help="the service's --max-report-interval-seconds: how long a steady rank may fold its steps (10)",
    )
    p.add_argument("--no-fold", action="store_true", help="ranks report every step whatever the service allows")
    p.add_argument("--p99-ms", type=float, default=50.0, help="the p99 latency a level must stay under")
    p.add_argument(
        "--kib-per-rank", type=float, default=30.0, help="the server memory per rank a level must stay under"
    )
    p.add_argument("--out", default="artifacts/load.json")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.ranks.split(",")]
    if any(n < 1 for n in levels) or levels != sorted(levels) or levels[-1] > 100_000:
        p.error("ranks must be ascending, in 1-100000")
    if not 1 <= args.seconds <= 120:
        p.error("seconds must be in 1-120 (the run is bounded)")
    if not 0 <= args.settle <= 120:
        p.error("settle must be in 0-120 (the run is bounded)")
    if not 1 <= args.clients <= 16 or not 1 <= args.workers <= 16:
        p.error("clients and workers must be in 1-16")
    if not 0.01 <= args.interval <= 60:
        p.error("interval must be in 0.01-60 seconds")

    grow_timeout = GROW_SECONDS + 30
    failed_before = 0
    budget = len(levels) * (grow_timeout + args.settle + args.seconds + 30) + 60
    tmp = Path(tempfile.mkdtemp(prefix="rematd-load-"))
    ctx = mp.get_context("spawn")
    pipes: list[Any] = []
    procs: list[Any] = []
    results: list[Level] = []
    server = _start_server(tmp / "load.db", args.workers, args.report_interval)
    try:
        base_rss = _rss_bytes(_proc_tree(server.proc.pid))
        # Every generator stops by itself at the run's deadline, whatever becomes of this process.
        deadline = time.monotonic() + budget
        for i in range(args.clients):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_client_process,
                args=(server.target, child, i, args.interval, not args.no_fold, deadline),
                daemon=True,
            )
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        print(
            f"server {server.target}, {args.workers} worker(s), base RSS {base_rss / 2**20:.0f} MiB, "
            f"{args.clients} generator process(es), {os.cpu_count()} CPUs shared by all, "
            f"a step every {args.interval:g} s per rank, "
            + ("every step reported" if args.no_fold else f"steady steps folded for up to {args.report_interval:g} s"),
            flush=True,
        )
        print(
            f"{'':>7} {'':>6} {'':>6} {'stream':>6} {'':>6} {'':>7} {'service latency, ms':>26} {'':>7} {'':>5}  "
            f"{'server':^19}   {'generator':^39}",
            flush=True,
        )
        print(
            f"{'ranks':>7} {'live':>6} {'ramp s':>6} {'fails':>6} {'msg/s':>6} {'steps/s':>7} "
            f"{'p50':>8} {'p99':>8} {'max':>8} "
            f"{'stale s':>7} {'errs':>5}  {'cores':>5} {'MiB':>6} {'KiB/rk':>6}   {'cores':>5} {'lag p50':>7} "
            f"{'p99':>6} {'max':>6} {'loop p99':>8} {'load':>6}  ok",
            flush=True,
        )
        for n in levels:
            share = [n // args.clients + (1 if i < n % args.clients else 0) for i in range(args.clients)]
            for conn, want in zip(pipes, share, strict=True):
                conn.send(("grow", want))
            t_grow = time.monotonic()
            for conn in pipes:
                _recv(conn, grow_timeout, "grow")
            ramp = time.monotonic() - t_grow
            time.sleep(args.settle)
            pids = _proc_tree(server.proc.pid)
            cpu0, t0 = _cpu_seconds(pids), time.monotonic()
            for conn in pipes:
                conn.send(("measure", args.seconds))
            got = [_recv(conn, args.seconds + 30, "measure") for conn in pipes]
            pids = _proc_tree(server.proc.pid)
            cpu = (_cpu_seconds(pids) - cpu0) / (time.monotonic() - t0)
            rss = _rss_bytes(pids)
            lat = [x for g in got for x in g["lat"]]
            lag = [x for g in got for x in g["lag"]]
            loop = [x for g in got for x in g["loop"]]
            errors = sum(g["errors"] for g in got)
            live = sum(g["live"] for g in got)
            failed = sum(g["failed"] for g in got)
            failed_streams, failed_before = failed - failed_before, failed
            gave_up = sum(g["gave_up"] for g in got)
            acked = sum(g["acked"] for g in got)
            rate = acked / args.seconds
            steps = sum(g["steps"] for g in got) / args.seconds
            stale = max(g["stale"] for g in got)
            p99 = _pct(lat, 0.99)
            kib = (rss - base_rss) / 1024 / n
            # Every rank heard from within its report interval (and a step), at the latency and memory targets.
            longest = args.interval if args.no_fold else max(args.interval, args.report_interval)
            ok = (
                errors == 0
                and live == n
                and p99 < args.p99_ms
                and stale <= longest + args.interval + 1.0
                and kib < args.kib_per_rank
                and acked > 0
            )
            level = Level(
                ranks=n, seconds=args.seconds, sent=sum(g["sent"] for g in got), acked=acked, errors=errors, live=live,
                failed_streams=failed_streams, gave_up=gave_up, ramp_s=round(ramp, 1),
                rate_per_s=round(rate, 1), steps_per_s=round(steps, 1), p50_ms=round(_pct(lat, 0.5), 2),
                p99_ms=round(p99, 2), max_ms=round(max(lat) * 1000 if lat else 0, 1), stale_s=round(stale, 2),
                server_cpu_cores=round(cpu, 2), server_rss_mib=round(rss / 2**20, 1),
                server_kib_per_rank=round(kib, 1), gen_cpu_cores=round(sum(g["cpu"] for g in got), 2),
                gen_lag_p50_ms=round(_pct(lag, 0.5), 2), gen_lag_p99_ms=round(_pct(lag, 0.99), 2),
                gen_lag_max_ms=round(max(lag) * 1000 if lag else 0, 1), gen_loop_p99_ms=round(_pct(loop, 0.99), 2),
                load_1m=round(os.getloadavg()[0], 2),
                ok=ok,
            )  # fmt: skip
            results.append(level)
            print(
                f"{n:>7} {live:>6} {ramp:>6.1f} {failed_streams:>6} {rate:>6.0f} {steps:>7.0f} {level.p50_ms:>8.2f} "
                f"{level.p99_ms:>8.2f} {level.max_ms:>8.1f} {stale:>7.1f} {errors:>5}  {cpu:>5.2f} "
                f"{rss / 2**20:>6.0f} {kib:>6.1f}   {level.gen_cpu_cores:>5.2f} {level.gen_lag_p50_ms:>7.2f} "
                f"{level.gen_lag_p99_ms:>6.1f} {level.gen_lag_max_ms:>6.1f} {level.gen_loop_p99_ms:>8.2f} "
                f"{level.load_1m:>6.2f}  "
                f"{'yes' if ok else 'NO'}",
                flush=True,
            )
            for g in got if errors or failed_streams else []:
                for e in g["error_samples"][:2]:
                    print(f"    error: {e}", flush=True)
            if server.proc.poll() is not None:
                print("the server exited:\n" + "".join(server.output), flush=True)
                break
    finally:
        for conn in pipes:
            with contextlib.suppress(OSError):
                conn.send(("stop", None))
        for proc in procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    passing = [r.ranks for r in results if r.ok]
    failing = [r.ranks for r in results if not r.ok]
    summary = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "workers": args.workers,
        "clients": args.clients,
        "interval_seconds": args.interval,
        "report_interval_seconds": 0.0 if args.no_fold else args.report_interval,
        "p99_target_ms": args.p99_ms,
        "levels": [asdict(r) for r in results],
        "highest_passing_ranks": max(passing) if passing else 0,
        "first_failing_ranks": min(failing) if failing else None,
        "p50_ms_median_over_levels": statistics.median([r.p50_ms for r in results]) if results else None,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"highest level within target: {summary['highest_passing_ranks']} ranks; JSON in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
