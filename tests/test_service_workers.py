"""``rematd serve --workers 2``: processes sharing the gRPC port; operator controls reach every one of them,
and worker 0's /metrics covers the ranks of every one."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx

from bench.load_server import listeners
from bench.served import addresses, stop
from rematd import wire
from rematd.server.metrics.peers import MULTIPROC_ENV, PUBLISH_SECONDS
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .fleet_helpers import RawRank, histogram_count, job_view, metric, worker_pids
from .test_service import hello, stats

TOKEN = "workers-token-0123456789abcdef"


def test_two_workers_share_the_port_the_controls_and_the_metrics(tmp_path: Path) -> None:
    proc, grpc_addr, http_addr = _start(tmp_path)  # returns once both workers listen
    try:
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
                connected = metric(text, 'rematd_job_connected_ranks{job="wide"}')
                steps = metric(text, 'rematd_steps_total{job="wide"}')
                if (connected, steps) == (6, 6 * (step + 1)) or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
        seen = f"/metrics after 10 s: {connected} ranks connected, {steps} steps (6 and {6 * (step + 1)} expected)"
        assert connected == 6 and metric(text, 'rematd_job_world_size{job="wide"}') == 6, seen
        assert steps == 6 * (step + 1) and metric(text, "rematd_active_streams") == 6, seen
        for ch, out, _ in ranks:
            out.put(None)
            ch.close()
    finally:
        stop(proc, grace=20)
    assert proc.returncode == 0 or proc.returncode == -signal.SIGTERM


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "REMATD_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0",
           "--db", str(tmp_path / "w.db"), "--workers", "2", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        grpc_addr, http_addr = addresses(proc)
        deadline = time.monotonic() + 60
        while len(worker_pids(proc.pid)) < 2 or listeners(int(grpc_addr.rsplit(":", 1)[1])) < 2:
            assert time.monotonic() < deadline, "two workers listen"
            time.sleep(0.1)
    except BaseException:
        stop(proc)
        raise
    return proc, grpc_addr, http_addr


def _spread(grpc_addr: str, http: httpx.Client, job: str, each: int) -> tuple[list[RawRank], list[RawRank]]:
    """Ranks on connections of their own until each worker holds ``each``: those of worker 0, of worker 1."""
    here: list[RawRank] = []
    there: list[RawRank] = []
    rank = None
    for _ in range(40):
        if rank is None:
            rank = RawRank(grpc_addr, job, len(here) + len(there), world_size=2 * each, token=TOKEN)
        rank.connect()  # a connection of its own: the kernel picks the worker
        rank.step()
        views = {v["rank"]: v for v in job_view(http, job)["ranks"]}  # type: ignore[attr-defined]
        side = here if views[rank.rank]["served_here"] else there
        if len(side) < each:
            side.append(rank)
            rank = None
        if len(here) == len(there) == each:
            return here, there
    raise AssertionError("the kernel gave 40 connections to one worker")


def _scrape(http: httpx.Client) -> str:
    return http.get("/metrics").text


def test_a_killed_worker_is_started_again_the_others_streams_go_on_and_counts_survive(tmp_path: Path) -> None:
    proc, grpc_addr, http_addr = _start(tmp_path, "--metrics-cache-seconds", "0")
    ranks: list[RawRank] = []
    try:
        with httpx.Client(base_url=f"http://{http_addr}", timeout=10) as http:
            here, there = _spread(grpc_addr, http, "split", each=2)
            ranks = here + there
            for rank in ranks:
                rank.step()
            # The REST view of worker 0 shows every rank's live fields, wherever its stream is: worker 1's
            # from the store's rows, once its writer has flushed them (a quarter of a second).
            deadline = time.monotonic() + 10
            while True:
                view = job_view(http, "split")
                shown = {v["rank"]: v for v in view["ranks"] if v["state"] == "connected"}  # type: ignore[attr-defined]
                if all(v["figures_at"] is not None for v in shown.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert set(shown) == {r.rank for r in ranks}
            for r in ranks:
                v = shown[r.rank]
                assert v["plan_version"] == r.plan_version and v["modes"] and v["oom_risk"] is not None
                assert v["served_here"] == (r in here) and 0 <= time.time() - v["figures_at"] < 30
            # Counters and histograms cover both workers.
            text = _scrape(http)
            steps = sum(len(r.acked) for r in ranks)
            assert metric(text, 'rematd_steps_total{job="split"}') == steps
            stats_seen = metric(text, 'rematd_message_duration_seconds_count{kind="stats"}')
            assert stats_seen is not None and stats_seen >= steps

            # Each worker publishes its live ranks every second: those of its last publication are the ones
            # marked disconnected when it dies. Wait until both have published theirs.
            pids = set(worker_pids(proc.pid))
            _wait_published(pids, {r.rank for r in ranks})
            worker1 = next(p for p in pids if p != _http_worker(http_addr))
            os.kill(worker1, signal.SIGKILL)
            # Worker 0's streams are untouched: they step on, on the same stream.
            for _ in range(3):
                for r in here:
                    r.step()
            # The parent starts another worker 1; the dead one's ranks read disconnected meanwhile.
            deadline = time.monotonic() + 30
            while len(set(worker_pids(proc.pid)) - {worker1}) != 2:
                assert time.monotonic() < deadline and proc.poll() is None, "a new worker 1 starts"
                time.sleep(0.1)
            states = {v["rank"]: v["state"] for v in job_view(http, "split")["ranks"]}  # type: ignore[attr-defined]
            assert all(states[r.rank] == "disconnected" for r in there), (states, _output(proc))
            assert all(states[r.rank] == "connected" for r in here), states
            # Counts taken by the dead worker stay counted.
            text = _scrape(http)
            assert metric(text, 'rematd_steps_total{job="split"}') == sum(len(r.acked) for r in ranks)
            assert histogram_count(text, "rematd_message_duration_seconds") >= stats_seen
            # Its ranks come back (to either worker) and continue their plan history.
            deadline = time.monotonic() + 20
            for r in there:
                r.step_or_reconnect(deadline)
            states = {v["rank"]: v["state"] for v in job_view(http, "split")["ranks"]}  # type: ignore[attr-defined]
            assert all(states[r.rank] == "connected" for r in ranks)
            assert metric(_scrape(http), 'rematd_job_connected_ranks{job="split"}') == len(ranks)
        for r in ranks:
            r.close()
    finally:
        stop(proc, grace=20)
    assert proc.returncode == 0, "stopped by SIGTERM after a restart: a clean exit"


def _wait_published(workers: set[int], ranks: set[int], seconds: float = 20.0) -> None:
    """Until the workers' publications (in the run's folder, found from a worker's environment) list ``ranks``."""
    environ = Path(f"/proc/{min(workers)}/environ").read_bytes().split(b"\0")
    metrics = next(e.split(b"=", 1)[1].decode() for e in environ if e.startswith(MULTIPROC_ENV.encode() + b"="))
    deadline = time.monotonic() + seconds
    while True:
        listed = set()
        for path in Path(metrics).parent.glob("worker-*.json"):
            with contextlib.suppress(OSError, ValueError):
                listed |= {s["rank"] for s in json.loads(path.read_text())["samples"] if s["connected"]}
        if ranks <= listed:
            return
        assert time.monotonic() < deadline, f"the workers published {listed}, not {ranks}"
        time.sleep(PUBLISH_SECONDS / 4)


def _output(proc: subprocess.Popen[str]) -> str:
    """What the service printed so far (its output is a pipe nobody else reads)."""
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    return "\n".join(line for line in (proc.stdout.read() or "").splitlines() if "rematd.server" in line)


def _http_worker(http_addr: str) -> int:
    """The pid of the process listening on the HTTP port (worker 0)."""
    port = int(http_addr.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes:
                return int(fd.parts[2])
        except OSError:
            continue
    raise AssertionError("nothing listens on the HTTP port")


def _exits(status: int) -> None:
    sys.exit(status)


def test_a_worker_that_keeps_dying_stops_the_service_with_a_reason_and_a_failing_status(tmp_path: Path) -> None:
    from rematd.server.config import ServeConfig
    from rematd.server.workers import MAX_RESTARTS, Supervisor

    config = ServeConfig(db=str(tmp_path / "s.db"), grpc_port=0, http_port=0)
    (tmp_path / "shared" / "metrics").mkdir(parents=True)
    crashing = Supervisor(config, 1, tmp_path / "shared", target=_exits, args=(1,))
    crashing.start(0)
    crashing.watch()
    assert crashing.failure is not None and crashing.status() == 1
    assert f"its {MAX_RESTARTS + 1}th exit within" in crashing.failure[0]
    assert sum(len(r) for r in crashing.restarts) == MAX_RESTARTS
    # A worker whose store or settings are unusable (status 2) is not started again.
    unusable = Supervisor(config, 1, tmp_path / "shared", target=_exits, args=(2,))
    unusable.start(0)
    unusable.watch()
    assert unusable.status() == 2 and not unusable.restarts[0]
    assert unusable.failure is not None and "unusable" in unusable.failure[0]
