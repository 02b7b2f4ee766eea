"""A live service for the stream tests: the real ``rematd serve``, or a small in-process one that records."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import torch

from bench.served import launch
from rematd import wire
from rematd.planner.messages import open_planner
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .helpers import train_step


def start_serve(
    db: Path, grpc_port: int = 0, http_port: int = 0, *extra: str
) -> tuple[subprocess.Popen[str], str, str]:
    """``rematd serve`` on loopback (``extra``: more of its options); returns the process and its gRPC
    and HTTP addresses."""
    srv = launch(db, "--log-level", "warning", *extra, grpc_port=grpc_port, http_port=http_port)
    return srv.proc, srv.grpc, srv.http.removeprefix("http://")


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
