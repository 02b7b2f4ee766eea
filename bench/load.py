"""Load curve of ``rematd serve``: simulated ranks on real gRPC streams, a step a second each.

Starts a ``rematd serve`` subprocess on loopback, then client processes that
each hold many ranks (asyncio, grpc.aio, many streams per channel), growing
the number of ranks level by level. Each rank ends a step every ``--interval``
seconds and reports it as the rematd client does: every step at first, then,
once the service's acks allow it (the plan has held, no risk), its steady
steps folded into one report per report interval (``--no-fold``: every step
regardless). At each level, after a settle, for a bounded time, it measures
the time from sending a report to reading its ack, how stale the service's
view of any rank got, the server's CPU (all its processes) and its memory
per rank. Prints a table and writes JSON.

    .venv/bin/python bench/load.py --ranks 1000,2000,5000,10000 --seconds 20 --workers 2

The load generator runs on the same machine and takes CPU from the server:
on a small machine the figures are a floor on what the service can do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RANKS_PER_CHANNEL = 100
SERVER_OUTPUT: list[Any] = []
BLOCKS = 24


@dataclass
class Level:
    ranks: int
    seconds: float
    sent: int
    acked: int
    errors: int
    rate_per_s: float
    steps_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    stale_s: float
    server_cpu_cores: float
    server_rss_mib: float
    server_kib_per_rank: float
    ok: bool


# -- the client side: one process holds many ranks ----------------------------------------------------


def _hello(job: str, rank: int, world: int) -> Any:
    from rematd.v1 import advisor_pb2 as pb

    return pb.ClientMessage(
        hello=pb.Hello(
            job_id=job,
            rank=rank,
            world_size=world,
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


_PLAN_TAG = 0x0A  # ServerMessage field 1 (plan), length-delimited: the generator reads only this byte of a reply


async def _rank(session: Any, job: str, rank: int, world: int, state: dict[str, Any]) -> None:
    from rematd.v1 import advisor_pb2 as pb

    # Bytes in, bytes out: the generator must cost less than the service it measures.
    call = session()
    try:
        await call.write(_hello(job, rank, world).SerializeToString())
        first = pb.ServerMessage.FromString(await call.read())
        version = first.plan.version
        state["connected"] += 1
        step = 0
        # Ranks tick at 1 Hz with random phases, like jobs that started at different times.
        interval = state["interval"]
        await asyncio.sleep(random.random() * interval)
        next_at = time.monotonic()
        report_every = 0.0  # what the service's last ack allows
        folded = 0
        reported_at = time.monotonic()
        while not state["stop"]:
            next_at += interval
            folded += 1
            now = time.monotonic()
            if report_every > 0 and now - reported_at < report_every and state["fold"]:
                step += 1  # a steady step, folded into the next report
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                continue
            if state["measuring"]:
                state["stale"] = max(state["stale"], now - reported_at)
            msg = pb.StepStats(
                step=step,
                steps=folded,
                # What the profile predicts (static + every block's activations), give or take 1 MiB.
                peak_allocated_bytes=(20 << 30) + BLOCKS * (64 << 20) + random.randrange(1 << 20),
                budget_bytes=80 << 30,
                static_bytes=20 << 30,
                total_bytes=80 << 30,
                step_seconds=1.0,
                plan_version=version,
                shape=pb.Shape(batch=8, seq_len=2048, tokens=16384),
            )
            data = pb.ClientMessage(stats=msg).SerializeToString()
            t = time.perf_counter()
            await call.write(data)
            state["sent"] += 1
            while True:
                reply = await call.read()
                if not isinstance(reply, bytes):
                    raise RuntimeError("stream ended")
                if reply[:1] == bytes([_PLAN_TAG]):
                    version = pb.ServerMessage.FromString(reply).plan.version
                    continue
                break
            if state["measuring"]:
                state["lat"].append(time.perf_counter() - t)
                state["acked"] += 1
                state["steps"] += folded
            report_every = pb.ServerMessage.FromString(reply).ack.report_interval_seconds
            reported_at = time.monotonic()
            folded = 0
            step += 1
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await call.done_writing()
    except Exception as err:  # counted, not raised: one rank's failure is data
        state["errors"] += 1
        if len(state["error_samples"]) < 5:
            state["error_samples"].append(repr(err)[:200])


async def _client_main(target: str, conn: Any, index: int, interval: float, fold: bool) -> None:
    import grpc

    state: dict[str, Any] = {
        "stop": False, "measuring": False, "lat": [], "sent": 0, "acked": 0, "errors": 0, "connected": 0,
        "error_samples": [], "interval": interval, "fold": fold, "steps": 0, "stale": 0.0,
    }  # fmt: skip
    channels: list[Any] = []
    tasks: list[asyncio.Task[None]] = []
    loop = asyncio.get_running_loop()
    while True:
        cmd, arg = await loop.run_in_executor(None, conn.recv)
        if cmd == "grow":
            want = int(arg)
            while len(tasks) < want:
                if len(tasks) % RANKS_PER_CHANNEL == 0:
                    channels.append(grpc.aio.insecure_channel(target))
                session = channels[-1].stream_stream(
                    "/rematd.v1.Advisor/Session", request_serializer=None, response_deserializer=None
                )
                n = len(tasks)
                # A job of 8 ranks per 8 tasks, so jobs look like real ones.
                job = f"bench-{index}-{n // 8}"
                tasks.append(asyncio.create_task(_rank(session, job, n % 8, 8, state)))
                if n % 200 == 199:
                    await asyncio.sleep(0.05)  # a ramp, not a thundering herd of hellos
            deadline = time.monotonic() + 60
            while state["connected"] + state["errors"] < want and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            conn.send(("grown", state["connected"]))
        elif cmd == "measure":
            state.update(lat=[], sent=0, acked=0, errors=0, steps=0, stale=0.0, measuring=True)
            await asyncio.sleep(float(arg))
            state["measuring"] = False
            keys = ("lat", "sent", "acked", "errors", "connected", "error_samples", "steps", "stale")
            conn.send(("measured", {k: state[k] for k in keys}))
        elif cmd == "stop":
            state["stop"] = True
            await asyncio.wait(tasks, timeout=5)
            for ch in channels:
                await ch.close()
            conn.send(("stopped", None))
            return


def _client_process(target: str, conn: Any, index: int, interval: float, fold: bool) -> None:
    import gc

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The generator's own collector pauses would show up as service latency.
    gc.set_threshold(100_000, 50, 1000)
    asyncio.run(_client_main(target, conn, index, interval, fold))


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


def _start_server(db: Path, workers: int, report_interval: float) -> tuple[subprocess.Popen[str], str]:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cmd = [
        sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", str(port), "--http-port", "0",
        "--db", str(db), "--log-level", "warning", "--workers", str(workers),
        "--max-report-interval-seconds", str(report_interval),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("rematd serve exited at start")
        if "serving gRPC on" in line:
            break
    # Keep the server's output flowing (a full pipe would stall it) and at hand if it dies.
    import collections
    import threading

    tail: collections.deque[str] = collections.deque(maxlen=40)
    SERVER_OUTPUT.append(tail)
    threading.Thread(target=lambda: tail.extend(iter(proc.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    # The other workers print nothing; give them a moment to bind.
    time.sleep(2.0 if workers > 1 else 0.2)
    return proc, f"127.0.0.1:{port}"


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="500,1000,2000,5000,10000", help="comma-separated levels of ranks")
    p.add_argument("--seconds", type=float, default=15.0, help="measured seconds per level (after a settle)")
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
    if any(n < 1 for n in levels) or levels != sorted(levels):
        p.error("ranks must be positive and ascending")
    if not 1 <= args.seconds <= 120:
        p.error("seconds must be in 1-120 (the run is bounded)")

    tmp = Path(tempfile.mkdtemp(prefix="rematd-load-"))
    server, target = _start_server(tmp / "load.db", args.workers, args.report_interval)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    results: list[Level] = []
    try:
        time.sleep(0.5)
        if server.poll() is not None:
            raise RuntimeError("rematd serve exited at start:\n" + "".join(SERVER_OUTPUT[-1]))
        base_rss = _rss_bytes(_proc_tree(server.pid))
        for i in range(args.clients):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_client_process, args=(target, child, i, args.interval, not args.no_fold), daemon=True
            )
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        print(
            f"server {target}, {args.workers} worker(s), base RSS {base_rss / 2**20:.0f} MiB, "
            f"a step every {args.interval:g} s per rank, "
            + ("every step reported" if args.no_fold else f"steady steps folded for up to {args.report_interval:g} s"),
            flush=True,
        )
        header = (
            f"{'ranks':>7} {'msg/s':>8} {'steps/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'stale s':>8} "
            f"{'errors':>7} {'cpu cores':>9} {'RSS MiB':>8} {'KiB/rank':>9}  ok"
        )
        print(header, flush=True)
        for n in levels:
            share = [n // args.clients + (1 if i < n % args.clients else 0) for i in range(args.clients)]
            for conn, want in zip(pipes, share, strict=True):
                conn.send(("grow", want))
            for conn in pipes:
                conn.recv()
            time.sleep(args.settle)
            pids = _proc_tree(server.pid)
            cpu0, t0 = _cpu_seconds(pids), time.monotonic()
            for conn in pipes:
                conn.send(("measure", args.seconds))
            got = [conn.recv()[1] for conn in pipes]
            pids = _proc_tree(server.pid)
            cpu = (_cpu_seconds(pids) - cpu0) / (time.monotonic() - t0)
            rss = _rss_bytes(pids)
            lat = [x for g in got for x in g["lat"]]
            errors = sum(g["errors"] for g in got)
            sent = sum(g["sent"] for g in got)
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
                and p99 < args.p99_ms
                and stale <= longest + args.interval + 1.0
                and kib < args.kib_per_rank
                and acked > 0
            )
            level = Level(
                ranks=n, seconds=args.seconds, sent=sent, acked=acked, errors=errors, rate_per_s=round(rate, 1),
                steps_per_s=round(steps, 1), p50_ms=round(_pct(lat, 0.5), 2), p99_ms=round(p99, 2),
                max_ms=round(max(lat) * 1000 if lat else 0, 1), stale_s=round(stale, 2),
                server_cpu_cores=round(cpu, 2), server_rss_mib=round(rss / 2**20, 1),
                server_kib_per_rank=round(kib, 1), ok=ok,
            )  # fmt: skip
            results.append(level)
            print(
                f"{n:>7} {rate:>8.0f} {steps:>8.0f} {level.p50_ms:>8.2f} {level.p99_ms:>8.2f} {level.max_ms:>8.1f} "
                f"{stale:>8.1f} {errors:>7} {cpu:>9.2f} {rss / 2**20:>8.0f} {level.server_kib_per_rank:>9.1f}  "
                f"{'yes' if ok else 'NO'}",
                flush=True,
            )
            for g in got if errors else []:
                for e in g["error_samples"][:2]:
                    print(f"    error: {e}", flush=True)
            if server.poll() is not None:
                print("the server exited:\n" + "".join(SERVER_OUTPUT[-1]), flush=True)
                break
    finally:
        for conn in pipes:
            with contextlib.suppress(OSError):
                conn.send(("stop", None))
        for proc in procs:
            proc.join(15)
            if proc.is_alive():
                proc.kill()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    passing = [r.ranks for r in results if r.ok]
    failing = [r.ranks for r in results if not r.ok]
    summary = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
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
