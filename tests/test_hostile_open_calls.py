"""The health service's Watch needs no token, and is bounded against a real ``rematd serve``: a flood of them
on one connection is mostly refused (count and memory bounded), each one ends after
``--idle-connection-seconds``, and under a low descriptor limit they do not keep a trainer out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.served import addresses, launch, stop
from rematd import wire
from rematd.server.transport.open_calls import MAX_OPEN_CALLS
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_hostile_input import rss_bytes
from .test_service import hello

IDLE = 2.0
TOKEN = "open-calls-token-0123456789"
WATCH = health_pb2.HealthCheckRequest(service="")


def _watch(channel: grpc.Channel) -> grpc.Call:
    return health_pb2_grpc.HealthStub(channel).Watch(WATCH, timeout=30)  # type: ignore[no-any-return]


def _first(call: grpc.Call) -> grpc.StatusCode | None:
    """None when the call is open (its first status came), else the status that refused it."""
    try:
        next(call)  # type: ignore[call-overload]
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return None


def test_watch_calls_are_bounded_in_number_memory_and_time(tmp_path: Path) -> None:
    srv = launch(tmp_path / "r.db", "--log-level", "error", "--idle-connection-seconds", str(IDLE))
    try:
        with grpc.insecure_channel(srv.grpc) as channel:
            assert _first(_watch(channel)) is None  # warms the connection and the service up
            time.sleep(IDLE + 1)
            before = rss_bytes(srv.proc.pid)
            started = time.monotonic()
            calls = [_watch(channel) for _ in range(3000)]
            firsts = [_first(c) for c in calls]
            flood = time.monotonic() - started
            held = [c for c, f in zip(calls, firsts, strict=True) if f is None]
            refused = [f for f in firsts if f is not None]
            grown = rss_bytes(srv.proc.pid) - before
            # A held call keeps its slot for IDLE seconds, so a flood read slower than that (a loaded machine)
            # may see a slot serve a second call once the first ended: the bound allows for it, no more.
            rounds = 1 + int(flood // IDLE)
            assert len(held) <= MAX_OPEN_CALLS * rounds, f"{len(held)} Watch calls held in {flood:.1f} s"
            assert len(refused) >= 3000 - MAX_OPEN_CALLS * rounds
            # Refused; HTTP/2 resets some of a flood's streams itself, which the client reads as CANCELLED, and the
            # transport refuses those over --max-streams-per-connection opened before the client knew the bound
            # (UNAVAILABLE).
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in refused
            allowed = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}
            assert set(refused) <= allowed
            # Handling the flood costs some 25-30 MiB on this machine; holding every call took twice that.
            assert grown < 40 << 20, f"the service grew by {grown >> 20} MiB"
            # Each held one ends (OK) after the idle limit, well before the caller's own deadline.
            for call in held:
                for _ in call:  # type: ignore[attr-defined]
                    pass
                assert call.code() == grpc.StatusCode.OK
            assert time.monotonic() - started < flood + IDLE + 8
            # A watcher that calls again is served again.
            assert _first(_watch(channel)) is None
    finally:
        stop(srv.proc)


def _serve_with_few_descriptors(db: Path, limit: int) -> subprocess.Popen[str]:
    """``rematd serve`` with a token, under a hard descriptor limit of ``limit``."""
    return subprocess.Popen(
        [
            *("prlimit", f"--nofile={limit}:{limit}", "--"),
            *(sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0"),
            *("--db", str(db), "--log-level", "error", "--idle-connection-seconds", str(IDLE)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "REMATD_TOKEN": TOKEN},
    )


def _trainer_gets_in(target: str, within: float) -> float:
    """Seconds until a trainer's hello with the token is answered with a plan (each try 3 s at most)."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        opts = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(target, options=opts) as ch:
            msgs = iter([pb.ClientMessage(hello=wire.hello_to_pb(hello(job="trainer")))])
            call = pb_grpc.AdvisorStub(ch).Session(msgs, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=3)
            try:
                if next(call).WhichOneof("kind") == "plan":
                    return time.monotonic() - started
            except grpc.RpcError:
                time.sleep(0.2)
    raise AssertionError(f"the trainer did not get in within {within} s")


@pytest.fixture
def channels() -> Iterator[list[grpc.Channel]]:
    opened: list[grpc.Channel] = []
    yield opened
    for ch in opened:
        ch.close()


def test_watch_calls_do_not_keep_a_trainer_out_under_a_descriptor_limit(
    tmp_path: Path, channels: list[grpc.Channel]
) -> None:
    proc = _serve_with_few_descriptors(tmp_path / "r.db", 300)
    try:
        target, _ = addresses(proc)
        # 200 connections, a Watch each: more than the gRPC share of 300 descriptors.
        for _ in range(200):
            channels.append(grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]))
        calls = [_watch(ch) for ch in channels]
        firsts = [_first(c) for c in calls]
        assert sum(f is None for f in firsts) <= MAX_OPEN_CALLS
        # They stay where they are (the callers hold their channels); the trainer gets in once the idle
        # limit has closed what they hold.
        took = _trainer_gets_in(target, within=6 * IDLE + 10)
        assert took < 6 * IDLE + 10
    finally:
        stop(proc)
