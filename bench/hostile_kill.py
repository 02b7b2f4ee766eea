"""A real ``rematd serve`` killed (SIGKILL) as plans answering a burst of OOMs arrive: how many plans the ranks
received, how many of them the store lacks, and how the ranks the killed process held read after a restart.

Run by ``python -m bench.hostile``; returns what it measured, for its JSON report.
"""

from __future__ import annotations

import os
import queue
import signal
import sqlite3
import threading
from pathlib import Path

import grpc
import httpx

from bench.hostile_calls import hello
from bench.served import launch, stop
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc


def _rank(
    target: str, job: str, rank: int, go: threading.Barrier, got: list[tuple[int, int]], on_plan: threading.Event
) -> None:
    outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
    first = hello(job, blocks=16)
    first.rank = rank
    first.world_size = 64
    outbox.put(pb.ClientMessage(hello=first))
    with grpc.insecure_channel(target) as channel:
        call = pb_grpc.AdvisorStub(channel).Session(iter(outbox.get, None), timeout=60)
        try:
            got.append((rank, next(call).plan.version))
            go.wait(30)
            for i in range(10):  # the rate limit's burst, at lengths that each bring a tighter plan
                seq = 64 * (i + 1)
                oom = pb.OomEvent(step=i, shape=pb.Shape(batch=1, seq_len=seq, tokens=seq), plan_version=1)
                outbox.put(pb.ClientMessage(oom=oom))
            for msg in call:
                if msg.WhichOneof("kind") == "plan":
                    got.append((rank, msg.plan.version))
                    on_plan.set()
        except grpc.RpcError:
            pass
        finally:
            outbox.put(None)
            call.cancel()


def kill_while_answering(db: Path, ranks: int, kill_after: int) -> dict[str, object]:
    """``ranks`` ranks burst OOMs; the service is killed once ``kill_after`` plans have answered them."""
    srv = launch(db, "--log-level", "error")
    got: list[tuple[int, int]] = []
    on_plan = threading.Event()
    go = threading.Barrier(ranks)
    threads = [
        threading.Thread(target=_rank, args=(srv.grpc, "killed", r, go, got, on_plan), daemon=True)
        for r in range(ranks)
    ]
    try:
        for t in threads:
            t.start()
        while len(got) < ranks + kill_after and any(t.is_alive() for t in threads):
            on_plan.wait(1)
            on_plan.clear()
        os.kill(srv.proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
    finally:
        stop(srv.proc)
    con = sqlite3.connect(db)
    try:
        stored = {(int(r), int(v)) for r, v in con.execute("SELECT rank, version FROM plans WHERE job='killed'")}
    finally:
        con.close()
    received = set(got)
    return {
        "ranks": ranks,
        "plans_received": len(received),
        "plans_received_not_in_store": len(received - stored),
        "ghosts_after_restart": ghosts(db),
    }


def ghosts(db: Path) -> dict[str, int]:
    """How the killed process's ranks read from a service started again on the same store."""
    srv = launch(db, "--log-level", "error")
    try:
        job = httpx.get(f"{srv.http}/api/v1/jobs/killed", timeout=30).json()
        states: dict[str, int] = {}
        for r in job["ranks"]:
            states[r["state"]] = states.get(r["state"], 0) + 1
        return states
    finally:
        stop(srv.proc)
