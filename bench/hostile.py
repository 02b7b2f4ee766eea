"""What hostile input costs a real ``rematd serve`` on loopback: how long each kind holds the event loop, what
idle connections cost in file descriptors, what callers that hold what they open cost, and what a SIGKILL loses.

For each input, a client polls /healthz back to back while the input is sent; the longest answer bounds how
long the input held the loop (the median is the loop's ordinary pace). Then ``--idle`` HTTP connections and as
many gRPC connections are opened and left silent: the service's descriptors are counted while they are held,
/healthz is timed, and a new gRPC stream is opened; after ``--request-seconds`` they should be closed. Then
``--watches`` health Watch calls on one connection, many large reads at once, readers that stop reading, and
takeover attempts (``bench.hostile_calls``); last, another service is killed as plans answering OOMs arrive,
and started again on its store (``bench.hostile_kill``).

    python -m bench.hostile --idle 2000
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench import hostile_calls as calls
from bench.hostile_calls import answer, hello, stats
from bench.hostile_kill import kill_while_answering
from bench.loop_stall import while_probing
from bench.rejected_streams import packed_hello
from bench.served import Served, served
from rematd.v1 import advisor_pb2 as pb


def big_stats(target: str) -> str:
    report = stats(1)
    report.mode_seconds.extend(pb.ModeSeconds(mode=pb.MODE_RECOMPUTE) for _ in range(200_000))
    return answer(target, [pb.ClientMessage(hello=hello("big-stats")), pb.ClientMessage(stats=report)])


def packed(target: str) -> str:
    return answer(target, [packed_hello()])


def plan_table(target: str) -> str:
    resumed = hello("big-table")
    resumed.plan_version = 3
    resumed.plan.version = 3
    for i in range(75_000):  # entries without modes: the most of them 1 MiB holds
        resumed.plan.shape_plans.add(max_seq_len=i + 1, max_tokens=i + 1)
    return answer(target, [pb.ClientMessage(hello=resumed)])


def oom_flood(target: str) -> str:
    oom = pb.OomEvent(step=1, shape=pb.Shape(batch=1, seq_len=64, tokens=64))
    return answer(target, [pb.ClientMessage(hello=hello("oom-flood")), *[pb.ClientMessage(oom=oom)] * 2000])


INPUTS: dict[str, Callable[[str], str]] = {
    "StepStats with 200,000 mode_seconds (1 MiB)": big_stats,
    "hello packed with 237,000 size terms (1 MiB)": packed,
    "resumed hello with 75,000 shape_plans": plan_table,
    "2,000 OOM events on one stream": oom_flood,
}


def stall(http_base: str, send: Callable[[], str]) -> dict[str, object]:
    """/healthz times while ``send`` runs."""
    answer, lags = while_probing(http_base, send)
    return {
        "answer": answer,
        "healthz_p50_ms": round(statistics.median(lags) * 1000, 2),
        "healthz_max_ms": round(max(lags) * 1000, 1),
    }


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def idle_load(grpc_target: str, http_base: str, pid: int, idle: int, request_seconds: float) -> dict[str, object]:
    """Descriptors, /healthz and a new stream while ``idle`` silent HTTP and gRPC connections are open, and after."""
    http_host, http_port = http_base.removeprefix("http://").rsplit(":", 1)
    grpc_host, grpc_port = grpc_target.rsplit(":", 1)
    before = _fds(pid)
    with ExitStack() as held:
        for _ in range(idle):
            held.enter_context(socket.create_connection((http_host, int(http_port)), timeout=5))
            held.enter_context(socket.create_connection((grpc_host, int(grpc_port)), timeout=5))
        time.sleep(0.5)
        during = _fds(pid)
        t = time.perf_counter()
        healthz = httpx.get(http_base + "/healthz", timeout=30).status_code
        healthz_ms = (time.perf_counter() - t) * 1000
        stream = answer(grpc_target, [pb.ClientMessage(hello=hello("after-idle")), pb.ClientMessage(stats=stats(0))])
        time.sleep(request_seconds + 1.5)
        after = _fds(pid)
    return {
        "idle_http_connections": idle,
        "idle_grpc_connections": idle,
        "fds_before": before,
        "fds_while_held": during,
        "healthz_while_held": healthz,
        "healthz_while_held_ms": round(healthz_ms, 1),
        "new_stream_while_held": stream,
        "fds_after_timeouts": after,
    }


def held_calls(srv: Served, db: Path, args: argparse.Namespace) -> dict[str, object]:
    """What callers that hold what they open cost (``bench.hostile_calls``), /healthz timed around each."""
    calls.fill(db, srv.grpc, srv.http)
    pid = srv.proc.pid
    kinds: dict[str, Callable[[], dict[str, object]]] = {
        f"{args.watches} health Watch calls on one connection": lambda: calls.watch_flood(
            srv.grpc, pid, args.watches, args.idle_seconds
        ),
        "16 readers of 10,000 steps, two reads each": lambda: calls.large_reads(srv.http, pid, 16, 10_000),
        "8 readers of an 11 MiB page that never read": lambda: calls.stalled_readers(
            srv.http, pid, 8, args.response_seconds
        ),
        "takeover attempts": lambda: calls.takeovers(srv.grpc, srv.http),
    }
    report: dict[str, object] = {}
    for name, run in kinds.items():
        answer, lags = while_probing(srv.http, run)
        report[name] = {
            **answer,
            "healthz_p50_ms": round(statistics.median(lags) * 1000, 2),
            "healthz_max_ms": round(max(lags) * 1000, 1),
        }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=2000, help="idle HTTP connections, and as many gRPC ones")
    parser.add_argument("--request-seconds", type=float, default=3.0, help="the service's --http-request-seconds")
    parser.add_argument("--watches", type=int, default=3000, help="health Watch calls opened on one connection")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="the service's --idle-connection-seconds")
    parser.add_argument("--response-seconds", type=float, default=3.0, help="the service's --http-response-seconds")
    parser.add_argument("--kill-ranks", type=int, default=16, help="ranks bursting OOMs when the service is killed")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rematd-bench-"))
    db = base / "r.db"
    timeouts = (
        *("--http-request-seconds", str(args.request_seconds), "--handshake-timeout-seconds", "3"),
        *("--idle-connection-seconds", str(args.idle_seconds), "--http-response-seconds", str(args.response_seconds)),
    )
    with served(db, *timeouts) as srv:
        report: dict[str, object] = {name: stall(srv.http, lambda f=f: f(srv.grpc)) for name, f in INPUTS.items()}
        report["idle connections"] = idle_load(srv.grpc, srv.http, srv.proc.pid, args.idle, args.request_seconds)
        report.update(held_calls(srv, db, args))
    report["SIGKILL as plans answering OOMs arrive"] = kill_while_answering(
        base / "killed.db", args.kill_ranks, 2 * args.kill_ranks
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
