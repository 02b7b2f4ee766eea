"""The stream: fail-open across a killed service, auth metadata, TLS, fallback planning, the queue."""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch

from rematd import client, wire
from rematd.client.stream import StreamBackend, StreamConfig
from rematd.records import StepStats, open_planner
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .helpers import tiny_model, train_step


def start_serve(db: Path, grpc_port: int = 0, http_port: int = 0) -> tuple[subprocess.Popen[str], str, str]:
    """``rematd serve`` on loopback; returns the process and its gRPC and HTTP addresses."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", str(grpc_port)),
            *("--http-port", str(http_port), "--db", str(db), "--log-level", "warning"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    grpc_addr = http_addr = None
    lines = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (grpc_addr is None or http_addr is None):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"serving gRPC on (\S+)", line):
            grpc_addr = m.group(1)
        if m := re.search(r"REST on http://([^/\s]+)/", line):
            http_addr = m.group(1)
    if grpc_addr is None or http_addr is None:
        proc.kill()
        raise RuntimeError("rematd serve did not start:\n" + "".join(lines))
    return proc, grpc_addr, http_addr


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()


def test_training_survives_a_killed_and_restarted_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Time spent in rematd's code on the training thread (its hooks and step()), per step.
    in_rematd = [0.0]
    for name in ("_pre_forward", "_post_forward", "step"):
        original = getattr(client.Handle, name)

        def timed(self: client.Handle, *args: object, _original: Any = original) -> Any:
            start = time.perf_counter()
            try:
                return _original(self, *args)
            finally:
                in_rematd[0] += time.perf_counter() - start

        monkeypatch.setattr(client.Handle, name, timed)
    db = tmp_path / "rematd.db"
    proc, grpc_addr, http_addr = start_serve(db)
    procs = [proc]
    restarted: dict[str, float] = {}

    def restart() -> None:
        grpc_port, http_port = int(grpc_addr.rsplit(":", 1)[1]), int(http_addr.rsplit(":", 1)[1])
        new, _, _ = start_serve(db, grpc_port, http_port)
        procs.append(new)
        restarted["at"] = time.monotonic()

    try:
        model = tiny_model(n_layer=4, d_model=32, seed=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=grpc_addr, job="restart-job", budget_bytes=10**12, optimizer=opt)
        # The same step without rematd, interleaved: it shows when the machine itself was slow.
        control = tiny_model(n_layer=4, d_model=32, seed=4)
        control_opt = torch.optim.SGD(control.parameters(), lr=0.01)
        times: list[float] = []
        control_times: list[float] = []
        rematd_times: list[float] = []
        restarter = threading.Thread(target=restart)
        # A cyclic garbage collection (tens of ms with torch loaded) lands in whichever code allocates at the
        # threshold; it is not a wait on the network, so it is kept out of the timings.
        gc.disable()
        for step in range(200):
            if step == 5:
                assert h.flush(20.0), "the service answered before it was killed"
                before = h.plan.version
                assert before >= 1
            if step == 30:
                proc.kill()  # no goodbye, no graceful shutdown
                proc.wait(5)
            if step == 40:
                restarter.start()
            in_rematd[0] = 0.0
            start = time.perf_counter()
            train_step(model, opt, 32, seed=step)
            times.append(time.perf_counter() - start)
            rematd_times.append(in_rematd[0])
            start = time.perf_counter()
            train_step(control, control_opt, 32, seed=step)
            control_times.append(time.perf_counter() - start)
            time.sleep(0.02)
        gc.enable()
        restarter.join(60)
        assert "at" in restarted, "the service did not restart"
        stream = h.stream
        assert stream is not None
        while not stream.connected and time.monotonic() < restarted["at"] + 10:
            time.sleep(0.05)
        assert stream.connected_at is not None
        back = stream.connected_at - restarted["at"]
        assert stream.connected and back < 5.0, f"the stream came back {back:.1f}s after the service"
        assert h.flush(20.0)
        median, control_median = statistics.median(times), statistics.median(control_times)
        print(
            f"stream back after {back:.2f}s; median step {median * 1e3:.1f} ms, control {control_median * 1e3:.1f} ms"
        )
        # rematd's own work on the training thread never waits on the network: per step it stays well
        # under a step, across the kill, the outage and the reconnect.
        worst_rematd = max(rematd_times[1:])  # step 0 ends the profile and starts the stream thread
        print(
            f"rematd on the training thread: median {statistics.median(rematd_times) * 1e6:.0f} us, "
            f"max {worst_rematd * 1e3:.2f} ms"
        )
        # A loaded machine may preempt the thread inside rematd's code once or twice; a network wait would
        # show on many steps, and for far longer.
        slow = [round(t * 1e3, 1) for t in rematd_times[1:] if t >= median]
        assert len(slow) <= 2 and worst_rematd < 0.25, f"rematd took {slow} ms of steps of {median * 1e3:.1f} ms"
        assert rematd_times[0] < 0.5
        # Whole steps: none is delayed by more than a step beyond what the machine's own slowness at that
        # moment (the control steps around it) explains. Two cores shared with other test runs preempt a
        # step now and then, so a few may still be late, by scheduler pauses, not the seconds a network wait takes.
        late = []
        for i, t in enumerate(times):
            noise = max(control_times[max(0, i - 2) : i + 3]) - control_median
            if t - median > median + max(0.0, noise):
                late.append(f"step {i}: {t * 1e3:.0f} ms (noise {noise * 1e3:.0f} ms)")
        assert len(late) <= 20, f"median {median * 1e3:.1f} ms; late: {late}"
        assert max(times) < 2.0, f"a step took {max(times):.2f}s"
        assert h.plan.version > before
        h.close()
        plans = httpx.get(f"http://{http_addr}/api/v1/jobs/restart-job/plans", timeout=10).json()
        plans = plans["plans"] if isinstance(plans, dict) else plans
        versions = [p["version"] for p in plans]
        assert versions == sorted(set(versions)) and versions[0] == 1, versions
        assert versions[-1] == h.plan.version and len(versions) >= 2, "the restarted service continued the history"
    finally:
        for p in procs:
            stop(p)


# -- a small stand-in service, for what the real one does not do yet ----------------


class Recorder(pb_grpc.AdvisorServicer):
    """Answers like the service, records each stream's metadata and hello, checks a token if given."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.metadata: list[dict[str, str]] = []
        self.hellos: list[pb.Hello] = []

    def Session(
        self, request_iterator: Iterator[pb.ClientMessage], context: grpc.ServicerContext
    ) -> Iterator[pb.ServerMessage]:  # type: ignore[override]
        meta = {k: str(v) for k, v in context.invocation_metadata()}
        self.metadata.append(meta)
        if self.token is not None and meta.get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        session = None
        for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "hello":
                self.hellos.append(msg.hello)
                hello = wire.hello_from_pb(msg.hello)
                session = open_planner(hello, first_version=hello.plan_version + 1)
                yield pb.ServerMessage(plan=wire.plan_to_pb(session.plan))
            elif kind == "stats":
                yield pb.ServerMessage(ack=pb.StepAck(step=msg.stats.step))
            elif kind == "goodbye":
                return


def serve_recorder(
    recorder: Recorder, port: int = 0, creds: grpc.ServerCredentials | None = None
) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_AdvisorServicer_to_server(recorder, server)
    addr = f"127.0.0.1:{port}"
    bound = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
    server.start()
    return server, bound


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seq: int = 16) -> None:
    for i in range(n):
        train_step(model, opt, seq, seed=i)


def test_token_is_sent_as_bearer_metadata_and_env_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(token="s3cret")
    server, port = serve_recorder(rec)
    try:
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="auth", token="s3cret", optimizer=opt)
        run_steps(model, opt, 3)
        assert h.flush(10.0)
        run_steps(model, opt, 1)
        assert rec.metadata[0]["authorization"] == "Bearer s3cret"
        assert h.plan.version == 1
        h.close()

        monkeypatch.setenv("REMATD_TOKEN", "from-env")
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="auth2", optimizer=opt)
        run_steps(model, opt, 3)
        stream = h.stream
        assert stream is not None
        deadline = time.monotonic() + 10
        while stream.last_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rec.metadata[-1]["authorization"] == "Bearer from-env"
        assert stream.last_error is not None and stream.last_error.startswith("UNAUTHENTICATED")
        run_steps(model, opt, 2)  # a refused stream is terminal for rematd, not for training
        assert h.plan.version == 0 and h.step_count == 5 and stream.reconnects == 0
        attempts = len(rec.metadata)
        time.sleep(0.5)
        assert len(rec.metadata) == attempts, "UNAUTHENTICATED is not retried"
        h.close()
    finally:
        server.stop(None)
    with pytest.raises(ValueError, match="token"):
        client.attach(tiny_model(n_layer=2, d_model=16), server="127.0.0.1:1", token="has space")


def make_cert(tmp: Path) -> tuple[Path, Path]:
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)),
            *("-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


def test_tls_with_root_certificates_from_a_path(tmp_path: Path) -> None:
    key, cert = make_cert(tmp_path)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    rec = Recorder()
    server, port = serve_recorder(rec, creds=creds)
    try:
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="tls", root_certificates=cert, optimizer=opt)
        run_steps(model, opt, 3)
        assert h.flush(10.0)
        run_steps(model, opt, 1)  # a plan applies at the first forward after it arrived
        assert h.plan.version == 1 and len(rec.hellos) == 1
        h.close()
        # Without TLS the same server does not answer, and training is unaffected.
        model = tiny_model(n_layer=2, d_model=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = client.attach(model, server=f"127.0.0.1:{port}", job="plain", optimizer=opt, fallback_after_s=None)
        run_steps(model, opt, 3)
        assert not h.flush(0.5) and h.plan.version == 0 and len(rec.hellos) == 1
        h.close()
    finally:
        server.stop(None)
    with pytest.raises(ValueError, match="root_certificates"):
        client.attach(tiny_model(n_layer=2), server="127.0.0.1:1", root_certificates=tmp_path / "missing.pem")


def test_fallback_plans_locally_then_hands_back_to_the_service() -> None:
    port = free_port()
    model = tiny_model(n_layer=4, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, server=f"127.0.0.1:{port}", job="fb", fallback_after_s=0.3, optimizer=opt)
    run_steps(model, opt, 2)
    stream = h.stream
    assert stream is not None
    deadline = time.monotonic() + 10
    while not stream.planning_locally and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stream.planning_locally
    assert h.flush(5.0), "the fallback planner answers the steps"
    assert h.last_stats is not None
    h.budget_bytes = max(1, h.last_stats.saved_peak_bytes // 3)
    run_steps(model, opt, 3)
    assert h.flush(5.0)
    run_steps(model, opt, 1)
    local = h.plan.version
    assert local >= 1 and h.plan.blocks, f"the local planner tightened: {h.plan}"
    rec = Recorder()
    server, _ = serve_recorder(rec, port=port)
    try:
        deadline = time.monotonic() + 10
        while not stream.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stream.connected and not stream.planning_locally
        assert rec.hellos[-1].plan_version == local, "the hello carries the plan in force"
        run_steps(model, opt, 2)
        assert h.flush(5.0)
        assert h.plan.version == local + 1, "the service's plan continues the versions"
        h.close()
    finally:
        server.stop(None)


def test_queue_drops_the_oldest_counts_it_and_close_does_not_wait_on_a_dead_service() -> None:
    backend = StreamBackend(f"127.0.0.1:{free_port()}", lambda plan: None, StreamConfig(queue_size=4))
    start = time.perf_counter()
    for step in range(10):
        backend.send_stats(StepStats(step=step, budget_bytes=1))
    assert time.perf_counter() - start < 0.05, "putting on the queue never waits"
    assert backend.dropped == 6 and backend.sent_step == 9

    model = tiny_model(n_layer=2, d_model=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = client.attach(model, server=f"127.0.0.1:{free_port()}", job="dead", optimizer=opt, fallback_after_s=None)
    run_steps(model, opt, 3)
    start = time.perf_counter()
    h.close()
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ValueError, match="queue_size"):
        StreamConfig(queue_size=0)
    with pytest.raises(ValueError, match="fallback_after_s"):
        StreamConfig(fallback_after_s=-1)
