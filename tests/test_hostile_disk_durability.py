"""Step reports acknowledged while the disk is full are not lost once it has room again: a real ``rematd serve``
under a file-size limit that is lifted while it runs."""

from __future__ import annotations

import queue
import resource
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import grpc
import httpx

from rematd import wire
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_hostile_disk import LIMIT_BYTES, _addresses, _serve
from .test_service import hello, stats

STEPS = 1200


def _room(proc: subprocess.Popen[bytes]) -> None:
    """The disk has room again: the file-size limit is lifted while the service runs."""
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _written(db: Path) -> set[int]:
    return {r[0] for r in sqlite3.connect(db).execute("SELECT step FROM stats WHERE job='durable'")}


def test_steps_acknowledged_on_a_full_disk_are_written_once_it_has_room(tmp_path: Path) -> None:
    _acknowledged_on_a_full_disk(tmp_path, room_before_stop=True)


def test_steps_acknowledged_on_a_full_disk_wait_at_shutdown_for_room(tmp_path: Path) -> None:
    _acknowledged_on_a_full_disk(tmp_path, room_before_stop=False)


def _acknowledged_on_a_full_disk(tmp_path: Path, *, room_before_stop: bool) -> None:
    db, log = tmp_path / "r.db", tmp_path / "serve.log"
    proc = _serve(db, log, LIMIT_BYTES, liftable=True)
    try:
        grpc_addr, http = _addresses(log, proc)
        out: queue.Queue[pb.ClientMessage | None] = queue.Queue()
        out.put(pb.ClientMessage(hello=wire.hello_to_pb(hello(job="durable", n=8))))
        acked: list[int] = []
        full_at = None
        with grpc.insecure_channel(grpc_addr) as ch:
            call = pb_grpc.AdvisorStub(ch).Session(iter(out.get, None), timeout=120)
            replies = iter(call)
            assert next(replies).WhichOneof("kind") == "plan"
            for step in range(STEPS):
                out.put(pb.ClientMessage(stats=wire.stats_to_pb(stats(step, 3000 + step % 7))))
                while True:
                    msg = next(replies)
                    if msg.WhichOneof("kind") == "ack":
                        acked.append(msg.ack.step)
                        break
                if step % 50 == 0:
                    time.sleep(0.3)  # let the buffer reach the disk
                    if full_at is None and httpx.get(f"http://{http}/readyz", timeout=10).status_code == 503:
                        full_at = step
            assert full_at is not None and full_at < STEPS - 200, "the disk never filled"
            if room_before_stop:
                _room(proc)
                deadline = time.monotonic() + 20
                while httpx.get(f"http://{http}/readyz", timeout=10).status_code != 200:
                    assert time.monotonic() < deadline, "never ready again"
                    time.sleep(0.2)
            out.put(pb.ClientMessage(goodbye=pb.Goodbye(reason="done")))
            out.put(None)
            for _ in replies:
                pass
        proc.send_signal(signal.SIGTERM)
        if not room_before_stop:
            time.sleep(2)  # the service is stopping, its reports still unwritten; then an operator frees space
            assert proc.poll() is None, "it stopped without waiting for room"
            _room(proc)
        assert proc.wait(30) == 0
        assert len(acked) == STEPS
        written = _written(db)
        assert written == set(acked), f"{len(set(acked) - written)} acknowledged steps lost"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
