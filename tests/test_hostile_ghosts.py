"""Ranks a killed service left connected (ghosts) read as lost after a restart, and their jobs are retained as any
idle job's: a real ``rematd serve`` is SIGKILLed with live streams and started again on the same store."""

from __future__ import annotations

import queue
import signal
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.served import launch, stop
from rematd import wire
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_hostile_store_file import _until
from .test_service import hello, stats

RETENTION_SECONDS = 2.0
FLAGS = ("--log-level", "warning", "--compact-seconds", "0.5", "--session-expiry-seconds", "3")
GHOSTS = [f"ghost-{i}" for i in range(5)]


def _jobs(http: str) -> dict[str, Any]:
    return {j["job"]: j for j in httpx.get(f"{http}/api/v1/jobs", timeout=10).json()["jobs"]}


def test_ghosts_of_a_killed_service_read_as_lost_and_are_retained_like_idle_jobs(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    first = launch(db, *FLAGS)
    channels: list[grpc.Channel] = []
    calls: list[Any] = []
    try:
        for job in GHOSTS:  # streams left open when the service dies
            outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
            for msg in (pb.ClientMessage(hello=wire.hello_to_pb(hello(job=job))),
                        pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 500)))):  # fmt: skip
                outbox.put(msg)
            channels.append(grpc.insecure_channel(first.grpc))
            call = pb_grpc.AdvisorStub(channels[-1]).Session(iter(outbox.get, None), timeout=60)
            assert next(call).WhichOneof("kind") == "plan" and next(call).WhichOneof("kind") == "ack"
            calls.append((call, outbox))
        done = [
            pb.ClientMessage(hello=wire.hello_to_pb(hello(job="control"))),
            pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 500))),
            pb.ClientMessage(goodbye=pb.Goodbye()),
        ]
        with grpc.insecure_channel(first.grpc) as ch:
            list(pb_grpc.AdvisorStub(ch).Session(iter(done), timeout=10))
        assert _until(lambda: all(_jobs(first.http).get(j, {}).get("state") == "running" for j in GHOSTS), 10)
        first.proc.send_signal(signal.SIGKILL)
        assert first.proc.wait(10) == -signal.SIGKILL
    finally:
        for call, outbox in calls:
            outbox.put(None)
            call.cancel()
        for ch in channels:
            ch.close()
        stop(first.proc)

    second = launch(db, *FLAGS)
    try:
        # At once: the process that held them ran on this host and is gone.
        jobs = _jobs(second.http)
        for job in GHOSTS:
            assert jobs[job]["state"] == "disconnected", jobs[job]
            assert [(r["state"], r["connected"]) for r in jobs[job]["ranks"]] == [("disconnected", False)]
        assert jobs["control"]["state"] == "ended"
    finally:
        stop(second.proc)
    # And retention takes them as it takes the job that ended.
    third = launch(db, *FLAGS, "--retention-days", str(RETENTION_SECONDS / 86400))
    try:
        gone = _until(lambda: not set(_jobs(third.http)) & {*GHOSTS, "control"}, 10 + RETENTION_SECONDS)
        assert gone, sorted(_jobs(third.http))
    finally:
        stop(third.proc)
