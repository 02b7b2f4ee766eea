"""Ranks on raw gRPC streams for the fleet tests (several workers, several replicas): each keeps what a client
keeps across reconnects (its session secret, job credential, plan in force, next step), and what it was
acknowledged, so a test can ask the store whether any of it was lost."""

from __future__ import annotations

import dataclasses
import queue
import re
import time
from pathlib import Path

import grpc
import httpx

from rematd import wire
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .test_service import hello, stats


def worker_pids(parent: int) -> list[int]:
    """The worker processes ``rematd serve --workers`` started (children of ``parent`` run by spawn)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def metric(text: str, series: str) -> float | None:
    """The value of one series (name and labels as written) in a scrape, or None."""
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(series + " ")), None)


def histogram_count(text: str, name: str) -> float:
    """A histogram's observations over all its labels."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}_count{{[^}}]*}} (\S+)$", text, flags=re.M))


class RawRank:
    """One rank streaming on its own (or a given shared) channel; ``reconnect`` resumes it as a client would."""

    def __init__(
        self, target: str, job: str, rank: int, world_size: int, *, token: str, channel: grpc.Channel | None = None
    ) -> None:
        self.target = target
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.token = token
        self.shared = channel
        self.channel: grpc.Channel | None = None
        self.secret = ""
        self.plan_version = 0
        self.plan_versions: list[int] = []
        self.next_step = 0
        self.acked: list[tuple[int, float]] = []
        """(step, monotonic time of its ack)."""
        self._out: queue.Queue[pb.ClientMessage | None] = queue.Queue()
        self._replies: grpc.Future | None = None

    def connect(self, timeout: float = 20.0) -> None:
        """A stream and its hello (with the session secret and plan version of the last stream, if any)."""
        self.close()
        self.channel = self.shared or grpc.insecure_channel(
            self.target, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self._out = queue.Queue()
        h = dataclasses.replace(
            hello(job=self.job, rank=self.rank, n=8),
            world_size=self.world_size,
            session_secret=self.secret,
            plan_version=self.plan_version,
            job_secret=f"credential-of-{self.job}",
        )
        self._out.put(pb.ClientMessage(hello=wire.hello_to_pb(h)))
        self._replies = pb_grpc.AdvisorStub(self.channel).Session(
            iter(self._out.get, None), timeout=300, metadata=[("authorization", f"Bearer {self.token}")]
        )
        self._read_plan(next(self._replies))

    def _read_plan(self, msg: pb.ServerMessage) -> None:
        if msg.WhichOneof("kind") == "plan":
            assert msg.plan.version >= self.plan_version, "a plan version went back"
            self.plan_version = msg.plan.version
            self.plan_versions.append(msg.plan.version)

    def step(self, peak: int = 500) -> None:
        """One step's report, read until its ack (plans on the way are kept)."""
        assert self._replies is not None
        # Ran with the newest plan it holds, as a client that applies plans at its step's start.
        ran = dataclasses.replace(stats(self.next_step, peak), plan_version=self.plan_version)
        self._out.put(pb.ClientMessage(stats=wire.stats_to_pb(ran)))
        for msg in self._replies:
            self._read_plan(msg)
            if msg.WhichOneof("kind") == "ack":
                if msg.ack.session_secret:
                    self.secret = msg.ack.session_secret
                self.acked.append((msg.ack.step, time.monotonic()))
                self.next_step += 1
                return
        raise grpc.RpcError("the stream ended before the ack")

    def step_or_reconnect(self, deadline: float) -> None:
        """A step, reconnecting (after a short pause, as a client backs off) until it is acknowledged."""
        while True:
            try:
                self.step()
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                try:
                    self.connect()
                except grpc.RpcError:
                    continue

    def close(self) -> None:
        self._out.put(None)
        if self.channel is not None and self.channel is not self.shared:
            self.channel.close()
        self.channel = None


def job_view(http: httpx.Client, job: str) -> dict[str, object]:
    r = http.get(f"/api/v1/jobs/{job}")
    assert r.status_code == 200, r.text
    view: dict[str, object] = r.json()
    return view
