"""``rematd serve --workers 2``: processes sharing the gRPC port; operator controls reach every one of them,
and worker 0's /metrics covers the ranks of every one."""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx

from bench.served import stop
from rematd import wire
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_service import hello, stats

TOKEN = "workers-token-0123456789abcdef"


def worker_pids(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _value(metrics: str, series: str) -> float | None:
    return next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(series + " ")), None)


def test_two_workers_share_the_port_the_controls_and_the_metrics(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "REMATD_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0",
           "--db", str(tmp_path / "w.db"), "--workers", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        grpc_addr = http_addr = None
        deadline = time.monotonic() + 60
        while (grpc_addr is None or http_addr is None) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "rematd serve --workers 2 exited at start"
            if m := re.search(r"serving gRPC on (\S+)", line):
                grpc_addr = m.group(1)
            if m := re.search(r"REST on http://([^/\s]+)/", line):
                http_addr = m.group(1)
        assert grpc_addr and http_addr
        time.sleep(1.0)  # the second worker binds a moment later
        assert len(worker_pids(proc.pid)) == 2, "two worker processes"

        # Six ranks, each on its own connection: the kernel spreads them over the workers.
        ranks = []
        for r in range(6):
            ch = grpc.insecure_channel(grpc_addr, options=[("grpc.use_local_subchannel_pool", 1)])
            out: queue.Queue[pb.ClientMessage | None] = queue.Queue()
            h = dataclasses.replace(hello(job="wide", rank=r, n=8), world_size=6)
            out.put(pb.ClientMessage(hello=wire.hello_to_pb(h)))
            replies = pb_grpc.AdvisorStub(ch).Session(
                iter(out.get, None), timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")]
            )
            assert next(replies).plan.version == 1
            ranks.append((ch, out, replies))

        with httpx.Client(base_url=f"http://{http_addr}", timeout=10) as http:
            r = http.post(
                "/api/v1/jobs/wide/pin", json={"blocks": [1, 3]}, headers={"authorization": f"Bearer {TOKEN}"}
            )
            assert r.status_code == 200
        pinned = set()
        for step in range(12):
            for i, (_ch, out, replies) in enumerate(ranks):
                out.put(pb.ClientMessage(stats=wire.stats_to_pb(stats(step, 500))))
                while True:
                    reply = next(replies)
                    if reply.WhichOneof("kind") == "plan" and list(reply.plan.checkpoint_blocks) == [1, 3]:
                        pinned.add(i)
                    if reply.WhichOneof("kind") == "ack":
                        break
            if len(pinned) == len(ranks):
                break
            time.sleep(0.3)
        assert pinned == set(range(6)), "every rank, on whichever worker, got the pinned plan"
        # Worker 0's /metrics covers every worker's ranks: the job is whole, its steps all counted.
        with httpx.Client(base_url=f"http://{http_addr}", timeout=10) as http:
            deadline = time.monotonic() + 10
            while True:
                text = http.get("/metrics").text
                connected = _value(text, 'rematd_job_connected_ranks{job="wide"}')
                steps = _value(text, 'rematd_steps_total{job="wide"}')
                if (connected, steps) == (6, 6 * (step + 1)) or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
        assert connected == 6 and _value(text, 'rematd_job_world_size{job="wide"}') == 6
        assert steps == 6 * (step + 1) and _value(text, "rematd_active_streams") == 6
        for ch, out, _ in ranks:
            out.put(None)
            ch.close()
    finally:
        stop(proc, grace=20)
    assert proc.returncode == 0 or proc.returncode == -signal.SIGTERM
