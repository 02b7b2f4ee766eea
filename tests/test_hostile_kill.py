"""What a rank is answered with survives a SIGKILL of the service: every plan a rank received, and every OOM
event a plan answered, is in the store when a real ``rematd serve`` is killed as the plans arrive."""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import sqlite3
import threading
from pathlib import Path

import grpc

from bench.served import launch, stop
from rematd import wire
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_service import hello

RANKS = 12
OOMS = 10
"""OOM reports a rank sends at once (its rate limit's burst), at lengths that each bring a tighter plan."""
KILL_AFTER = 24
"""Plans answering OOMs received across the ranks before the service is killed: while most are in flight."""
_LENGTH = re.compile(r"out-of-memory reported at length (\d+)")


@dataclasses.dataclass
class _Received:
    plans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(rank, version) of every plan a rank received."""
    answered: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(rank, length) of every OOM a plan answered."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def _rank(target: str, rank: int, go: threading.Barrier, got: _Received, kill: threading.Event, pid: int) -> None:
    outbox: queue.Queue[pb.ClientMessage | None] = queue.Queue()
    h = dataclasses.replace(hello(job="killed", rank=rank, n=16, budget=200_000), world_size=RANKS)
    outbox.put(pb.ClientMessage(hello=wire.hello_to_pb(h)))
    with grpc.insecure_channel(target) as channel:
        call = pb_grpc.AdvisorStub(channel).Session(iter(outbox.get, None), timeout=60)
        try:
            first = next(call)
            with got.lock:
                got.plans.append((rank, first.plan.version))
            go.wait(30)
            for i in range(OOMS):
                seq = 64 * (i + 1)
                oom = pb.OomEvent(step=i, shape=pb.Shape(batch=1, seq_len=seq, tokens=seq), plan_version=1)
                outbox.put(pb.ClientMessage(oom=oom))
            for msg in call:
                if msg.WhichOneof("kind") != "plan":
                    continue
                length = _LENGTH.search(msg.plan.reason)
                with got.lock:
                    got.plans.append((rank, msg.plan.version))
                    if length:
                        got.answered.append((rank, int(length.group(1))))
                    if len(got.answered) >= KILL_AFTER and not kill.is_set():
                        kill.set()
                        os.kill(pid, signal.SIGKILL)  # as the plan arrives, not a moment later
        except grpc.RpcError:
            pass  # the service is gone
        finally:
            outbox.put(None)
            call.cancel()


def _kill_while_answering(db: Path) -> tuple[_Received, set[tuple[int, int]], set[tuple[int, int]]]:
    """One try: ranks burst OOMs, the service is killed as the plans answering them arrive; what the ranks
    received, and the plans and OOM events the store holds after."""
    srv = launch(db, "--log-level", "warning")
    got = _Received()
    kill = threading.Event()
    go = threading.Barrier(RANKS)
    threads = [
        threading.Thread(target=_rank, args=(srv.grpc, r, go, got, kill, srv.proc.pid), daemon=True)
        for r in range(RANKS)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a rank's stream did not end"
        assert kill.is_set(), f"only {len(got.answered)} OOMs were answered"
        assert srv.proc.wait(10) == -signal.SIGKILL
    finally:
        stop(srv.proc)
    con = sqlite3.connect(db)  # after the kill: SQLite reads what the service committed, its WAL included
    try:
        plans = {(int(r), int(v)) for r, v in con.execute("SELECT rank, version FROM plans WHERE job='killed'")}
        ooms = {(int(r), int(s)) for r, s in con.execute("SELECT rank, seq_len FROM oom_events WHERE job='killed'")}
    finally:
        con.close()
    return got, plans, ooms


def test_every_plan_and_oom_answered_survives_a_sigkill(tmp_path: Path) -> None:
    for attempt in range(2):
        got, plans, ooms = _kill_while_answering(tmp_path / f"r{attempt}.db")
        lost_plans = sorted(set(got.plans) - plans)
        lost_ooms = sorted(set(got.answered) - ooms)
        assert not lost_plans, f"{len(lost_plans)} of {len(got.plans)} plans received are not in the store"
        assert not lost_ooms, f"{len(lost_ooms)} of {len(got.answered)} OOMs answered are not in the store"
