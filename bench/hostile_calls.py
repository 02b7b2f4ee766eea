"""Hostile callers that hold what they open, against a real ``rematd serve``: health ``Watch`` calls (no token
needed), readers that stop reading a large answer, many large reads at once, and takeover attempts.

Run by ``python -m bench.hostile``; each function returns what it measured, for its JSON report.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.rejected_streams import rss_bytes
from bench.store_rows import more_plans, more_steps
from rematd import wire
from rematd.planner import Shape
from rematd.planner.messages import BlockProfile, Hello, StepStats
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

MIB = 1 << 20


def hello(job: str, blocks: int = 4) -> pb.Hello:
    """A small rank's hello (``blocks`` blocks)."""
    profile = tuple(
        BlockProfile(index=i, name=f"b{i}", saved_bytes=1000, input_bytes=100, forward_seconds=0.01)
        for i in range(blocks)
    )
    shape = Shape(batch=1, seq_len=64, tokens=64)
    return wire.hello_to_pb(Hello(job_id=job, blocks=profile, profile_shape=shape, budget_bytes=2_500 * blocks))


def stats(step: int) -> pb.StepStats:
    shape = Shape(batch=1, seq_len=64, tokens=64)
    return wire.stats_to_pb(StepStats(step=step, saved_peak_bytes=3000, budget_bytes=10_000, shape=shape))


def held_from(pid: int, ports: set[int]) -> int:
    """How many connections from the local ports ``ports`` process ``pid`` holds a descriptor of."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    held = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        held += int(fields[2].split(":")[1], 16) in ports and fields[9] in inodes
    return held


def watch_flood(grpc_target: str, pid: int, calls: int, idle_seconds: float) -> dict[str, object]:
    """``calls`` health Watch calls on one connection: how many are answered (held until the idle limit ends
    them; as one ends another may take its place), the memory they take, and how long the answered ones last."""
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.insecure_channel(grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        next(stub.Watch(request, timeout=30))
        before = rss_bytes(pid)
        started = time.monotonic()
        opened = [stub.Watch(request, timeout=idle_seconds + 60) for _ in range(calls)]
        held, refused = [], 0
        for call in opened:
            try:
                next(call)
                held.append(call)
            except grpc.RpcError:
                refused += 1
        grown = rss_bytes(pid) - before
        for call in held:
            for _ in call:
                pass
        lasted = time.monotonic() - started
    return {
        "watch_calls": calls,
        "answered": len(held),
        "refused": refused,
        "rss_growth_mib": round(grown / MIB, 1),
        "held_ones_ended_after_s": round(lasted, 1),
    }


def fill(db: Path, grpc_target: str, http_base: str) -> None:
    """A job "long" of 20,000 steps and a job "wide" (256 blocks) of 500 plans with tables: large answers."""
    with grpc.insecure_channel(grpc_target) as ch:
        for job, blocks in (("long", 4), ("wide", 256)):
            msgs = [
                pb.ClientMessage(hello=hello(job, blocks)),
                pb.ClientMessage(stats=stats(0)),
                pb.ClientMessage(goodbye=pb.Goodbye()),
            ]
            list(pb_grpc.AdvisorStub(ch).Session(iter(msgs), timeout=30))
    httpx.get(f"{http_base}/api/v1/jobs/long/stats", timeout=30)  # written, not buffered
    more_steps(db, "long", 20_000)
    more_plans(db, "wide", 256, 500)


def large_reads(http_base: str, pid: int, readers: int, rows: int) -> dict[str, object]:
    """``readers`` threads reading ``rows`` steps twice each: the largest answer, and the memory left after."""
    url = f"{http_base}/api/v1/jobs/long/stats"
    refused = httpx.get(url, params={"limit": 100_000}, timeout=30).status_code
    time.sleep(1)
    before = rss_bytes(pid)
    sizes: list[int] = []

    def read() -> None:
        for _ in range(2):
            sizes.append(len(httpx.get(url, params={"limit": rows}, timeout=120).content))

    threads = [threading.Thread(target=read) for _ in range(readers)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - started
    peak_after = rss_bytes(pid)
    time.sleep(2)
    return {
        "limit_100000_answer": refused,
        "reads": len(sizes),
        "answer_mib": round(max(sizes) / MIB, 2),
        "seconds": round(took, 1),
        "rss_growth_right_after_mib": round((peak_after - before) / MIB, 1),
        "rss_growth_2s_after_mib": round((rss_bytes(pid) - before) / MIB, 1),
    }


def stalled_readers(http_base: str, pid: int, readers: int, response_seconds: float) -> dict[str, object]:
    """``readers`` connections that ask for an 11 MiB page and never read: what they hold, and for how long."""
    host, port = http_base.removeprefix("http://").rsplit(":", 1)
    before_rss = rss_bytes(pid)
    stalled = []
    try:
        for _ in range(readers):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"GET /api/v1/jobs/wide/plans?limit=500 HTTP/1.1\r\nhost: x\r\n\r\n")
            stalled.append(s)
        ports = {s.getsockname()[1] for s in stalled}
        started = time.monotonic()
        most, grown = 0, 0
        while time.monotonic() - started < response_seconds + 60:
            held = held_from(pid, ports)
            most, grown = max(most, held), max(grown, rss_bytes(pid) - before_rss)
            if not held and most:
                break
            time.sleep(0.1)
        cut_after = time.monotonic() - started
        still = held_from(pid, ports)
    finally:
        for s in stalled:
            s.close()
    return {
        "stalled_readers": readers,
        "held_at_most": most,
        "rss_growth_at_most_mib": round(grown / MIB, 1),
        "all_cut_after_s": round(cut_after, 1),
        "held_after": still,
    }


def takeovers(grpc_target: str, http_base: str) -> dict[str, object]:
    """A hello with a live rank's session secret but another credential, and an old stream's next report after
    an operator's end and a re-open by another process: what each is answered."""
    trainer = hello("held")
    trainer.job_secret = "trainer-credential-0123456789"
    outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
    outbox.put(pb.ClientMessage(hello=trainer))
    outbox.put(pb.ClientMessage(stats=stats(0)))
    with grpc.insecure_channel(grpc_target) as ch:
        call = pb_grpc.AdvisorStub(ch).Session(iter(outbox.get, None), timeout=60)
        next(call)
        secret = next(call).ack.session_secret
        stranger = hello("held")
        stranger.job_secret = "stranger-credential-0123456789"
        stranger.session_secret = secret
        taken = answer(grpc_target, [pb.ClientMessage(hello=stranger), pb.ClientMessage(stats=stats(1))])
        httpx.post(f"{http_base}/api/v1/jobs/held/end", timeout=30)
        newcomer = hello("held")
        newcomer.job_secret = "newcomer-credential-0123456789"
        reopened = answer(grpc_target, [pb.ClientMessage(hello=newcomer), pb.ClientMessage(stats=stats(0))])
        outbox.put(pb.ClientMessage(stats=stats(1)))
        try:
            next(call)
            old_stream = "OK"
        except grpc.RpcError as err:
            old_stream = err.code().name
        outbox.put(None)
    return {"secret_without_credential": taken, "reopen_by_another": reopened, "old_stream_after_end": old_stream}


def answer(target: str, msgs: list[pb.ClientMessage]) -> str:
    """How a stream of ``msgs`` ends: OK, or its status code's name."""
    with grpc.insecure_channel(target) as ch:
        try:
            list(pb_grpc.AdvisorStub(ch).Session(iter(msgs), timeout=120))
        except grpc.RpcError as err:
            return err.code().name
    return "OK"
