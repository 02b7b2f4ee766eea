"""Hostile input against a real ``rematd serve``: NaN in JSON, bodies over the cap or without a token, names
too long to echo, hellos too large to convert; each refused cheaply and answered in the documented form."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from rematd import wire
from rematd.server import ServeConfig
from rematd.server.transport.http_guard import MAX_BODY_BYTES
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .helpers import LiveServer, live_server
from .test_service import hello, stats

TOKEN = "hostile-input-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("hostile"), env={"REMATD_TOKEN": TOKEN}) as srv:
        with grpc.insecure_channel(srv.grpc) as ch:
            msgs = iter([pb.ClientMessage(hello=wire.hello_to_pb(hello(job="victim")))])
            got = list(pb_grpc.AdvisorStub(ch).Session(msgs, metadata=(("authorization", f"Bearer {TOKEN}"),)))
        assert got[0].WhichOneof("kind") == "plan"
        yield srv


def _session(srv: LiveServer, *msgs: pb.ClientMessage) -> grpc.RpcError:
    with grpc.insecure_channel(srv.grpc) as ch:
        call = pb_grpc.AdvisorStub(ch).Session(iter(msgs), metadata=(("authorization", f"Bearer {TOKEN}"),))
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    return err.value


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("PATCH", "/api/v1/jobs/victim", '{"margin_ratio": NaN}', "margin_ratio"),
        ("PATCH", "/api/v1/jobs/victim", '{"budget_bytes": Infinity}', "budget_bytes"),
        ("PATCH", "/api/v1/jobs/victim", '{"margin_ratio": -Infinity}', "margin_ratio"),
        ("POST", "/api/v1/jobs/victim/pin", '{"blocks": [1, NaN]}', "blocks"),
        ("POST", "/api/v1/jobs/victim/pin", '{"checkpoint_every": Infinity}', "checkpoint_every"),
    ],
)
def test_nan_and_infinity_in_a_json_body_get_422_json(
    server: LiveServer, method: str, path: str, body: str, field: str
) -> None:
    r = httpx.request(
        method, server.url + path, content=body, headers={**AUTH, "content-type": "application/json"}, timeout=10
    )
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/json"
    detail = r.json()["detail"]
    assert any(field in e["loc"] for e in detail), detail
    assert "nan" not in r.text.lower() and "infinity" not in r.text.lower()


def test_malformed_json_gets_422_json(server: LiveServer) -> None:
    r = httpx.patch(
        server.url + "/api/v1/jobs/victim", content="{", headers={**AUTH, "content-type": "application/json"}
    )
    assert r.status_code == 422 and isinstance(r.json()["detail"], list)


def test_an_unauthenticated_body_is_not_read(server: LiveServer) -> None:
    """A 300 MB write without a token is answered 401 from its headers; the server grows by less than the cap."""
    host, port = server.http.rsplit(":", 1)
    before = rss_bytes(server.proc.pid)
    announced = 300 * 1024 * 1024
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f"POST /api/v1/jobs/victim/pin HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {announced}\r\n\r\n".encode()
        )
        s.settimeout(0.05)
        chunk = b"[" + b"1," * 32768
        reply = b""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and b"\r\n\r\n" not in reply:
            try:
                s.sendall(chunk)
                sent += len(chunk)
            except OSError:
                pass
            try:
                data = s.recv(65536)
                if not data:
                    break
                reply += data
            except TimeoutError:
                continue
        s.settimeout(5)
        try:
            while b"}" not in reply and (data := s.recv(65536)):
                reply += data
        except OSError:
            pass
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), reply[:300]
    assert json.loads(body[body.index(b"{") :])["detail"]
    assert sent < announced
    assert rss_bytes(server.proc.pid) - before < 2 * MAX_BODY_BYTES + 4 * 1024 * 1024


def test_a_body_over_the_cap_gets_413_json(server: LiveServer) -> None:
    big = json.dumps({"blocks": list(range(4096)) * 8})
    assert len(big) > MAX_BODY_BYTES
    r = httpx.post(server.url + "/api/v1/jobs/victim/pin", content=big, headers=AUTH, timeout=10)
    assert r.status_code == 413 and "at most" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096].encode()

    r = httpx.post(server.url + "/api/v1/jobs/victim/pin", content=chunks(), headers=AUTH, timeout=10)
    assert r.status_code == 413 and "at most" in r.json()["detail"]
    # A pin of every block of the largest profile is under the cap.
    r = httpx.post(server.url + "/api/v1/jobs/victim/pin", json={"blocks": list(range(4))}, headers=AUTH)
    assert r.status_code == 200, r.text


def test_a_long_job_name_is_invalid_argument_with_a_short_error(server: LiveServer) -> None:
    err = _session(server, pb.ClientMessage(hello=wire.hello_to_pb(hello(job="x" * 100_000))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.job_id" in (err.details() or "") and len(err.details() or "") < 400
    r = httpx.get(server.url + "/api/v1/jobs/" + "y" * 20_000)
    assert r.status_code == 404 and len(r.text) < 1000


def test_a_hello_with_too_many_blocks_is_refused_before_conversion(server: LiveServer) -> None:
    """400k blocks (within the message size) are refused by count, while /healthz keeps answering."""
    msg = pb.ClientMessage(hello=wire.hello_to_pb(hello(job="many")))
    del msg.hello.blocks[:]
    msg.hello.blocks.extend(pb.BlockProfile() for _ in range(400_000))
    assert msg.ByteSize() < 1 << 20
    lags: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        # At least one probe, even when the refusal comes before the first answer.
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while True:
                t = time.perf_counter()
                http.get("/healthz")
                lags.append(time.perf_counter() - t)
                if stop.is_set():
                    break

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        err = _session(server, msg)
    finally:
        stop.set()
        prober.join()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "400000 blocks" in (err.details() or "")
    # Generous: what this guards against held the loop for seconds.
    assert max(lags) < 1.0, max(lags)


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("PATCH", "/api/v1/jobs/victim", {"budget_bytes": True}, "budget_bytes"),
        ("PATCH", "/api/v1/jobs/victim", {"budget_bytes": "1000"}, "budget_bytes"),
        ("PATCH", "/api/v1/jobs/victim", {"budget_bytes": 1000.5}, "budget_bytes"),
        ("PATCH", "/api/v1/jobs/victim", {"margin_ratio": "0.5"}, "margin_ratio"),
        ("PATCH", "/api/v1/jobs/victim", {"margin_ratio": False}, "margin_ratio"),
        ("POST", "/api/v1/jobs/victim/pin", {"checkpoint_every": True}, "checkpoint_every"),
        ("POST", "/api/v1/jobs/victim/pin", {"pin_every": True}, "pin_every"),
        ("POST", "/api/v1/jobs/victim/pin", {"pin_blocks": ["1"]}, "pin_blocks"),
        ("POST", "/api/v1/jobs/victim/pin", {"blocks": ["1"]}, "blocks"),
    ],
)
def test_a_boolean_or_a_string_is_not_a_number(
    server: LiveServer, method: str, path: str, body: dict[str, object], field: str
) -> None:
    r = httpx.request(method, server.url + path, json=body, headers=AUTH, timeout=10)
    assert r.status_code == 422, r.text
    assert any(field in e["loc"] for e in r.json()["detail"]), r.text
    controls = httpx.get(server.url + "/api/v1/jobs/victim", timeout=10).json()["controls"]
    assert controls["budget_bytes"] is None and controls["margin_ratio"] is None and controls["pin_every"] is None
    # The same fields as numbers are taken.
    good = {"budget_bytes": 1000, "margin_ratio": 0, "checkpoint_every": 2, "blocks": [1], "pin_every": 2,
            "pin_blocks": [1]}[field]  # fmt: skip
    r = httpx.request(method, server.url + path, json={field: good}, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    httpx.patch(server.url + path, json={"budget_bytes": None, "margin_ratio": None}, headers=AUTH, timeout=10)
    httpx.delete(server.url + "/api/v1/jobs/victim/pin", headers=AUTH, timeout=10)


def test_a_world_size_or_block_modes_out_of_bounds_are_refused_by_name(server: LiveServer) -> None:
    huge = dataclasses.replace(hello(job="wide"), world_size=2**32 - 1)
    err = _session(server, pb.ClientMessage(hello=wire.hello_to_pb(huge)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "hello.world_size" in (err.details() or "")
    # 4,096 modes for a job of 4 blocks: one per block, or none.
    report = wire.stats_to_pb(stats(0, 500))
    report.block_modes.extend([pb.MODE_STORE] * 4096)
    err = _session(server, pb.ClientMessage(hello=wire.hello_to_pb(hello(job="four"))), pb.ClientMessage(stats=report))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stats.block_modes" in (err.details() or "") and "4 blocks" in (err.details() or "")
    assert httpx.get(server.url + "/api/v1/jobs/wide", timeout=10).status_code == 404


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ("llama tok-llama-0123456789\nllama tok-other-0123456789\n", "line 2: job 'llama' is given a token on line 1"),
        ("team-[ab tok-team-0123456789\n", "line 1: 'team-[ab' leaves a '[' open"),
        ("team/a tok-team-0123456789\n", "line 1: 'team/a' has '/'"),
    ],
)
def test_a_job_tokens_file_with_a_duplicate_or_a_bad_pattern_stops_the_start(
    tmp_path: Path, lines: str, said: str
) -> None:
    tokens = tmp_path / "job-tokens"
    tokens.write_text(lines)
    with pytest.raises(ValueError, match=re.escape(said)):
        ServeConfig(grpc_port=0, http_port=0, db=str(tmp_path / "r.db"), job_tokens_file=str(tokens))


def test_rematd_serve_names_the_bad_line_of_a_job_tokens_file(tmp_path: Path) -> None:
    tokens = tmp_path / "job-tokens"
    tokens.write_text("# two teams\nteam-a-* tok-team-a-0123456789\nteam-a-* tok-team-b-0123456789\n")
    done = subprocess.run(
        [sys.executable, "-m", "rematd.server.cli", "serve", "--grpc-port", "0", "--http-port", "0",
         "--db", str(tmp_path / "r.db"), "--job-tokens-file", str(tokens)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert "line 3: job 'team-a-*' is given a token on line 2" in done.stderr
