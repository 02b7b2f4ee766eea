"""``/openapi.json`` documents every answer a real ``rematd serve`` gives: each status a request below gets is
listed for its path and method, its body is valid against the schema listed, and a 405's ``Allow`` names every
method the schema serves at that path."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import jsonschema
import pytest

from rematd import wire
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc

from .helpers import LiveServer, live_server
from .test_service import hello

TOKEN = "openapi-truth-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
JOB = "documented"
JSON = {"content-type": "application/json"}

REQUESTS: list[tuple[str, str, dict[str, Any], int]] = [
    ("GET", "/healthz", {}, 200),
    ("GET", "/readyz", {}, 200),
    ("GET", "/api/v1/jobs", {"headers": AUTH}, 200),
    ("GET", "/api/v1/jobs?limit=0", {"headers": AUTH}, 422),
    ("GET", f"/api/v1/jobs/{JOB}", {"headers": AUTH}, 200),
    ("GET", "/api/v1/jobs/nobody", {"headers": AUTH}, 404),
    ("GET", f"/api/v1/jobs/{JOB}/plans", {"headers": AUTH}, 200),
    ("GET", f"/api/v1/jobs/{JOB}/plans?cursor=not-a-cursor", {"headers": AUTH}, 422),
    ("GET", "/api/v1/jobs/nobody/plans", {"headers": AUTH}, 404),
    ("GET", f"/api/v1/jobs/{JOB}/stats?since=-1", {"headers": AUTH}, 422),
    ("GET", f"/api/v1/jobs/{JOB}/stats", {"headers": AUTH}, 200),
    ("GET", f"/api/v1/jobs/{JOB}/ooms", {"headers": AUTH}, 200),
    ("POST", f"/api/v1/jobs/{JOB}/pin", {"headers": AUTH, "json": {"pin_every": 2}}, 200),
    ("POST", f"/api/v1/jobs/{JOB}/pin", {"headers": AUTH, "json": {"pin_every": 99}}, 422),
    ("POST", f"/api/v1/jobs/{JOB}/pin", {"headers": AUTH, "json": {"pin_every": 2, "pin_blocks": [1]}}, 422),
    ("POST", f"/api/v1/jobs/{JOB}/pin", {"json": {"pin_every": 2}}, 401),
    ("POST", f"/api/v1/jobs/{JOB}/pin", {"headers": {**AUTH, "sec-fetch-site": "cross-site"}, "json": {}}, 403),
    ("POST", f"/api/v1/jobs/{JOB}/pin", {"headers": {**AUTH, **JSON}, "content": b" " * 70_000}, 413),
    ("POST", "/api/v1/jobs/nobody/pin", {"headers": AUTH, "json": {"pin_every": 2}}, 404),
    ("DELETE", f"/api/v1/jobs/{JOB}/pin", {"headers": AUTH}, 200),
    ("PATCH", f"/api/v1/jobs/{JOB}", {"headers": AUTH, "json": {"margin_ratio": 0.2}}, 200),
    ("PATCH", f"/api/v1/jobs/{JOB}", {"headers": AUTH, "json": {}}, 422),
    ("PUT", f"/api/v1/jobs/{JOB}/pin", {"headers": AUTH}, 405),
    ("DELETE", "/healthz", {"headers": AUTH}, 405),
    ("POST", f"/api/v1/jobs/{JOB}/end", {"headers": AUTH}, 200),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path_factory.mktemp("openapi"), env={"REMATD_TOKEN": TOKEN}) as srv:
        with grpc.insecure_channel(srv.grpc) as ch:
            msgs = iter([pb.ClientMessage(hello=wire.hello_to_pb(hello(job=JOB)))])
            got = list(pb_grpc.AdvisorStub(ch).Session(msgs, metadata=(("authorization", f"Bearer {TOKEN}"),)))
        assert got[0].WhichOneof("kind") == "plan"
        yield srv


class Spec:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.paths = [
            (re.compile(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)) + "$"), operations)
            for template, operations in spec["paths"].items()
        ]

    def operations(self, path: str) -> dict[str, Any]:
        found = [ops for pattern, ops in self.paths if pattern.match(path.split("?")[0])]
        assert len(found) == 1, (path, found)
        return found[0]

    def check(self, method: str, path: str, status: int, body: bytes) -> None:
        responses = self.operations(path)[method.lower()]["responses"]
        assert str(status) in responses, f"{method} {path} answered {status}; documented: {sorted(responses)}"
        schema = responses[str(status)]["content"]["application/json"]["schema"]
        jsonschema.validate(json.loads(body), {**schema, "components": self.spec["components"]})


def test_every_answer_is_documented_with_its_body(server: LiveServer) -> None:
    spec = Spec(httpx.get(f"{server.url}/openapi.json", timeout=10).json())
    seen = set()
    for method, path, kwargs, status in REQUESTS:
        r = httpx.request(method, server.url + path, timeout=10, **kwargs)
        assert r.status_code == status, (method, path, r.status_code, r.text)
        assert r.headers["content-type"] == "application/json", (method, path, r.headers)
        if status == 405:
            served = {m.upper() for m in spec.operations(path)}
            assert set(r.headers["allow"].split(", ")) == served, (method, path, r.headers["allow"])
            continue
        spec.check(method, path, status, r.content)
        seen.add(status)
    assert seen == {200, 401, 403, 404, 413, 422}


def test_a_request_h11_cannot_take_is_refused_in_json_as_documented(server: LiveServer) -> None:
    spec = Spec(httpx.get(f"{server.url}/openapi.json", timeout=10).json())
    host, port = server.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: elsewhere.example\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), answer
    assert json.loads(body) == {"detail": "the host header is given more than once"}
    spec.check("GET", "/healthz", 400, body)
