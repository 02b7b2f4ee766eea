"""Connections that hold a file descriptor and send nothing (or a byte at a time), against a real ``rematd serve``
with a low descriptor limit: they are closed on a deadline, capped below the limit, and gRPC streams, ``/healthz``
and the log are unaffected."""

from __future__ import annotations

import logging
import os
import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from bench.served import addresses, stop
from rematd import wire
from rematd.server.runtime.log_limits import RepeatLimit
from rematd.server.transport.connections import FD_RESERVE, framing_problem
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .stream_helpers import make_cert
from .test_service import hello

FD_LIMIT = 300


@dataclass
class Limited:
    proc: subprocess.Popen[str]
    grpc: str
    http: str
    output: list[str] = field(default_factory=list)

    def log_bytes(self) -> int:
        return sum(len(line) for line in self.output)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


@contextmanager
def limited_server(tmp: Path, *args: str) -> Iterator[Limited]:
    """``rematd serve`` on loopback whose process may open at most ``FD_LIMIT`` descriptors; its output is read
    as it comes (so that the pipe never blocks it) and kept."""

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))

    command = [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0"]
    proc = subprocess.Popen(
        [*command, "--db", str(tmp / "r.db"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lower,
    )
    try:
        grpc_target, http = addresses(proc)
        srv = Limited(proc=proc, grpc=grpc_target, http=f"http://{http}")
        assert proc.stdout is not None
        out = proc.stdout
        reader = threading.Thread(target=lambda: srv.output.extend(iter(out.readline, "")), daemon=True)
        reader.start()
        yield srv
    finally:
        stop(proc)


def _connect(address: str) -> socket.socket:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (what it sent first is read and dropped)."""
    sock.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if not sock.recv(4096):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return False


def _answer(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    sock.settimeout(5)
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def _stream_works(target: str) -> bool:
    with grpc.insecure_channel(target) as ch:
        msgs = iter([pb.ClientMessage(hello=wire.hello_to_pb(hello(job="after-flood")))])
        got = list(pb_grpc.AdvisorStub(ch).Session(msgs, timeout=20))
    return bool(got) and got[0].WhichOneof("kind") == "plan"


def test_idle_http_connections_past_the_descriptor_limit_leave_the_service_serving(tmp_path: Path) -> None:
    with limited_server(tmp_path, "--http-request-seconds", "30") as srv, ExitStack() as held:
        cap = (FD_LIMIT - FD_RESERVE) // 4
        deadline = time.monotonic() + 10
        while not any("connections: at most" in line for line in srv.output) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(f"at most {cap} HTTP" in line for line in srv.output), srv.output[:8]
        idle = []
        for _ in range(FD_LIMIT + 100):  # more than the process may open
            idle.append(held.enter_context(_connect(srv.http)))
        time.sleep(0.5)
        assert srv.fds() < FD_LIMIT - FD_RESERVE // 2
        assert httpx.get(srv.http + "/healthz", timeout=10).status_code == 200
        assert _stream_works(srv.grpc)
        # The oldest idle connections made room for the new ones.
        assert _closed_by_peer(idle[0], 5)
        assert srv.proc.poll() is None
        assert srv.log_bytes() < 20_000, srv.output[-5:]


def test_connections_that_send_nothing_or_trickle_headers_are_closed(tmp_path: Path) -> None:
    with limited_server(tmp_path, "--http-request-seconds", "1", "--handshake-timeout-seconds", "1") as srv:
        silent = _connect(srv.http)
        trickle = _connect(srv.http)
        trickle.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        no_preface = _connect(srv.grpc)
        started = time.monotonic()
        cut = False
        for _ in range(16):  # a header byte now and then, never the end of the head
            time.sleep(0.25)
            try:
                trickle.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
        assert cut or _closed_by_peer(trickle, 3)
        assert _closed_by_peer(silent, 3)
        assert _closed_by_peer(no_preface, 5)
        assert time.monotonic() - started < 10
        for s in (silent, trickle, no_preface):
            s.close()
        # A request sent at an ordinary pace is answered as before.
        assert httpx.get(srv.http + "/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"GET /healthz HTTP/1.1\nHost: 127.0.0.1\n\n", "bare LF"),
        (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: b\r\n c\r\n\r\n", "folded"),
    ],
)
def test_ambiguous_framing_gets_400(tmp_path: Path, raw: bytes, why: str) -> None:
    assert why in framing_problem(raw)
    with limited_server(tmp_path) as srv, _connect(srv.http) as sock:
        sock.sendall(raw)
        answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 400"), answer
        assert why.encode() in answer


def test_a_flood_of_one_log_line_is_limited() -> None:
    now = [0.0]
    limit = RepeatLimit(lines=5, window=60, clock=lambda: now[0])
    line = "socket.accept() out of system resource"
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, line, (), None)
    passed = sum(limit.filter(record) for _ in range(10_000))
    assert passed == 5
    now[0] = 61.0
    later = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, line, (), None)
    assert limit.filter(later)
    assert "9995 more like this held back" in later.getMessage()
    other = logging.LogRecord("rematd", logging.ERROR, __file__, 1, "another line", (), None)
    assert limit.filter(other)


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (b"POST /api/v1/jobs/x/end HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n",
         b"not both"),
        (b"POST /api/v1/jobs/x/end HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://127.0.0.1\r\nOrigin: http://e.x\r\n"
         b"Content-Length: 0\r\n", b"origin header is given more than once"),
    ],
)  # fmt: skip
def test_a_request_framed_or_addressed_two_ways_gets_400(tmp_path: Path, head: bytes, why: bytes) -> None:
    with limited_server(tmp_path) as srv, _connect(srv.http) as sock:
        sock.sendall(head + b"\r\n0\r\n\r\n")
        answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 400"), answer
        assert why in answer


def test_uvicorn_is_pinned_to_the_range_its_protocol_subclass_was_written_against() -> None:
    import importlib.metadata
    import inspect

    import tomllib
    from packaging.requirements import Requirement
    from uvicorn.protocols.http.h11_impl import H11Protocol

    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text(encoding="utf-8"))
    server = pyproject["project"]["optional-dependencies"]["server"]
    [spec] = [Requirement(d) for d in server if d.startswith("uvicorn")]
    assert any(s.operator == "<" for s in spec.specifier), "an upper bound: a new uvicorn may change its internals"
    assert importlib.metadata.version("uvicorn") in spec.specifier, "the uvicorn installed is one the pin allows"
    # What GuardedH11 takes of H11Protocol: its hooks, and the attributes it reads and sets.
    for hook in ("connection_made", "data_received", "connection_lost"):
        assert hook in vars(H11Protocol), hook
    init = inspect.getsource(H11Protocol)
    for attr in ("self.connections", "self.conn", "self.cycle", "self.loop", "self.transport"):
        assert f"{attr} =" in init, attr


def test_tls_handshakes_that_never_end_are_closed_at_the_limit_on_both_ports(tmp_path: Path) -> None:
    key, cert = make_cert(tmp_path)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key), "--handshake-timeout-seconds", "1")
    with limited_server(tmp_path, *tls) as srv, ExitStack() as held:
        https, grpc_port = _connect(srv.http), _connect(srv.grpc)  # connected, no ClientHello
        started = time.monotonic()
        assert _closed_by_peer(https, 5) and _closed_by_peer(grpc_port, 5)
        assert time.monotonic() - started < 4, "cut at the handshake limit, not asyncio's 60 s"
        # More silent handshakes than the process may hold descriptors: each goes at the limit, and the
        # service answers again as they go.
        for _ in range(FD_LIMIT + 100):
            held.enter_context(_connect(srv.http))
        deadline = time.monotonic() + 8
        answered = False
        while not answered and time.monotonic() < deadline:
            try:
                url = srv.http.replace("http://", "https://") + "/healthz"
                trust = ssl.create_default_context(cafile=str(cert))
                answered = httpx.get(url, verify=trust, timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        assert answered, "the probes starved behind stalled handshakes"
        assert srv.proc.poll() is None
