"""The REST API: writes behind a token, filters, errors, and schemathesis over the served OpenAPI spec."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from rematd.server.core.advisor import AdvisorCore
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store
from rematd.server.transport.auth import TokenAuth
from rematd.server.transport.rest import create_app

from .test_service import hello, stats

TOKEN = "test-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def make_core(tmp: Path) -> AdvisorCore:
    core = AdvisorCore(Store(tmp / "r.db"), Metrics())
    s, _ = core.open_session(hello(job="known", n=8))
    for step in range(3):
        # Each step ran the plan the rank holds, as a client reports it.
        core.on_stats(s, dataclasses.replace(stats(step, 500 + step), plan_version=s.sent.version))
    return core


@pytest.fixture
def core(tmp_path: Path) -> Iterator[AdvisorCore]:
    c = make_core(tmp_path)
    yield c
    c.store.close()


def test_writes_need_the_token(core: AdvisorCore) -> None:
    http = TestClient(create_app(core, TokenAuth(token=TOKEN)))
    for method, url, body in [
        ("POST", "/api/v1/jobs/known/pin", {"checkpoint_every": 2}),
        ("DELETE", "/api/v1/jobs/known/pin", None),
        ("PATCH", "/api/v1/jobs/known", {"margin_ratio": 0.2}),
        ("POST", "/api/v1/jobs/known/end", None),
    ]:
        for headers in ({}, {"authorization": "Bearer wrong-token-wrong-token"}, {"authorization": TOKEN}):
            r = http.request(method, url, json=body, headers=headers)
            assert r.status_code == 401, (method, url, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and r.json()["detail"]
    # Reads stay open on loopback.
    assert http.get("/api/v1/jobs").status_code == 200


WRITES = [
    ("POST", "/api/v1/jobs/known/pin", {"checkpoint_every": 2}),
    ("DELETE", "/api/v1/jobs/known/pin", None),
    ("PATCH", "/api/v1/jobs/known", {"margin_ratio": 0.2}),
    ("POST", "/api/v1/jobs/known/end", None),
]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b'{"checkpoint_every": "two"}',
        b'{"modes": ["sideways"], "blocks": [-1], "extra": 1}',
        b"[" * 5000,
        b'{"checkpoint_every": 2}',
    ],
    ids=["empty", "not-json", "wrong-type", "invalid-fields", "deep", "valid"],
)
def test_with_a_token_every_write_without_it_is_401_whatever_its_body(core: AdvisorCore, content: bytes) -> None:
    http = TestClient(create_app(core, TokenAuth(token=TOKEN)))
    for method, url, _ in WRITES:
        r = http.request(method, url, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 401, (method, url, content[:40], r.text)
    assert core.job_controls("known")["pin_every"] is None and core.get_job("known")["state"] == "running"


def test_with_no_token_writes_are_open_on_loopback_only(core: AdvisorCore) -> None:
    # As a script or curl on the machine calls it: open.
    local = TestClient(create_app(core, TokenAuth()), base_url="http://127.0.0.1:8080")
    r = local.post("/api/v1/jobs/known/pin", json={"checkpoint_every": 2})
    assert r.status_code == 200 and r.json()["pin_every"] == 2
    assert (
        TestClient(create_app(core, TokenAuth()), base_url="http://localhost:8080")
        .delete("/api/v1/jobs/known/pin")
        .status_code
        == 200
    )
    # A page whose own name resolves to 127.0.0.1 (DNS rebinding) sends its name as Host: refused.
    rebound = TestClient(create_app(core, TokenAuth()), base_url="http://attacker.example:8080")
    r = rebound.post("/api/v1/jobs/known/pin", json={"checkpoint_every": 1})
    assert r.status_code == 403 and "loopback" in r.json()["detail"]
    # A service that binds beyond loopback with no token takes no writes at all.
    exposed = TestClient(create_app(core, TokenAuth(open_writes=False)), base_url="http://127.0.0.1:8080")
    for method, url, body in WRITES:
        r = exposed.request(method, url, json=body)
        assert r.status_code == 401 and "token" in r.json()["detail"], (method, url, r.text)
    assert core.job_controls("known")["pin_every"] is None


@pytest.mark.parametrize("token", [None, TOKEN])
def test_writes_from_another_site_are_refused(core: AdvisorCore, token: str | None) -> None:
    http = TestClient(create_app(core, TokenAuth(token=token)), base_url="http://127.0.0.1:8080")
    auth = AUTH if token else {}
    cross = [
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
        {"origin": "http://attacker.example"},
        {"origin": "http://127.0.0.1:9999"},
        {"origin": "null"},
    ]
    for headers in cross:
        for method, url, body in WRITES:
            r = http.request(method, url, json=body, headers={**auth, **headers})
            assert r.status_code == 403, (headers, method, url, r.text)
            assert "another" in r.json()["detail"]
    assert core.job_controls("known")["pin_every"] is None and core.get_job("known")["state"] == "running"
    # The dashboard's own origin, and a browser's address bar, may write.
    for headers in ({"origin": "http://127.0.0.1:8080", "sec-fetch-site": "same-origin"}, {"sec-fetch-site": "none"}):
        r = http.post("/api/v1/jobs/known/pin", json={"checkpoint_every": 2}, headers={**auth, **headers})
        assert r.status_code == 200, (headers, r.text)
    # Reads are not writes: a cross-site read is answered (the browser keeps it from the page).
    assert http.get("/api/v1/jobs", headers={**auth, "sec-fetch-site": "cross-site"}).status_code == 200


def test_the_api_docs_are_served_without_the_internet(core: AdvisorCore) -> None:
    http = TestClient(create_app(core))
    page = http.get("/docs")
    assert page.status_code == 200
    refs = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", page.text)
    assert refs and not [u for u in refs if "//" in u], f"every asset is the service's own: {refs}"
    for url in refs:
        r = http.get(url)
        assert r.status_code == 200 and r.content, url
    assert http.get("/redoc").status_code == 404, "no page that loads its script from elsewhere"


def test_reads_need_the_token_off_loopback(core: AdvisorCore) -> None:
    http = TestClient(create_app(core, TokenAuth(token=TOKEN, open_reads=False)))
    assert http.get("/api/v1/jobs").status_code == 401
    assert http.get("/api/v1/jobs", headers=AUTH).status_code == 200
    assert http.get("/healthz").status_code == 200


def test_the_pin_body_names_its_fields_as_the_controls_keep_them_and_takes_the_old_names(core: AdvisorCore) -> None:
    http = TestClient(create_app(core, TokenAuth(token=TOKEN)))
    for field, value, old in (("pin_every", 2, "checkpoint_every"), ("pin_blocks", [1, 3], "blocks")):
        answers = []
        for name in (field, old):
            r = http.post("/api/v1/jobs/known/pin", json={name: value}, headers=AUTH)
            assert r.status_code == 200, r.text
            answers.append({k: v for k, v in r.json().items() if k not in ("revision", "updated_at")})
            assert http.get("/api/v1/jobs/known").json()["controls"][field] == value
        assert answers[0] == answers[1] and answers[0][field] == value
    assert http.delete("/api/v1/jobs/known/pin", headers=AUTH).json()["pin_every"] is None


def test_pin_unpin_tune_and_end(core: AdvisorCore) -> None:
    http = TestClient(create_app(core, TokenAuth(token=TOKEN)))
    s = core.sessions.by_job["known"][0]
    r = http.post("/api/v1/jobs/known/pin", json={"checkpoint_every": 2}, headers=AUTH)
    assert r.status_code == 200 and r.json()["pin_every"] == 2
    plan = core.on_stats(s, stats(10, 500))
    assert plan is not None and plan.blocks == (0, 2, 4, 6) and "pinned" in plan.reason
    assert plan.version == s.sent.version
    # The planner's own wishes do not move a pinned plan, even under pressure.
    assert core.on_stats(s, stats(11, 9900, seq=128)) is None
    r = http.post("/api/v1/jobs/known/pin", json={"blocks": [7, 1, 1]}, headers=AUTH)
    assert r.status_code == 200 and r.json()["pin_blocks"] == [1, 7]
    plan = core.on_stats(s, stats(12, 500))
    assert plan is not None and plan.blocks == (1, 7)
    assert http.delete("/api/v1/jobs/known/pin", headers=AUTH).json()["pin_blocks"] is None
    after = core.on_stats(s, stats(13, 500))
    assert after is not None and after.blocks != (1, 7) and after.version == plan.version + 1

    r = http.patch("/api/v1/jobs/known", json={"margin_ratio": 0.5, "budget_bytes": 4000}, headers=AUTH)
    assert r.status_code == 200 and r.json()["margin_ratio"] == 0.5 and r.json()["budget_bytes"] == 4000
    assert s.planner.controller.config.margin_ratio == 0.5
    core.on_stats(s, stats(14, 500))
    assert s.planner.budget_bytes == 4000, "the budget override replaces what the rank reports"
    assert http.patch("/api/v1/jobs/known", json={"budget_bytes": None}, headers=AUTH).json()["budget_bytes"] is None

    plans = http.get("/api/v1/jobs/known/plans").json()["plans"]
    assert [p["version"] for p in plans] == sorted(p["version"] for p in plans)
    assert any("pinned" in p["reason"] for p in plans)

    r = http.post("/api/v1/jobs/known/end", headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] == "ended"
    assert http.get("/api/v1/jobs", params={"state": "ended"}).json()["jobs"][0]["job"] == "known"
    assert http.get("/api/v1/jobs", params={"state": "running"}).json()["jobs"] == []


@pytest.mark.parametrize(
    ("method", "url", "body", "status", "field"),
    [
        ("POST", "/api/v1/jobs/known/pin", {}, 422, None),
        ("POST", "/api/v1/jobs/known/pin", {"checkpoint_every": 2, "blocks": [1]}, 422, None),
        ("POST", "/api/v1/jobs/known/pin", {"checkpoint_every": -1}, 422, None),
        ("POST", "/api/v1/jobs/known/pin", {"checkpoint_every": 9}, 422, "pin_every"),
        ("POST", "/api/v1/jobs/known/pin", {"pin_every": 9}, 422, "pin_every"),
        ("POST", "/api/v1/jobs/known/pin", {"blocks": [8]}, 422, "pin_blocks"),
        ("POST", "/api/v1/jobs/known/pin", {"pin_blocks": [8]}, 422, "pin_blocks"),
        ("POST", "/api/v1/jobs/known/pin", {"pin_every": 2, "checkpoint_every": 2}, 422, None),
        ("POST", "/api/v1/jobs/known/pin", {"every": 2}, 422, None),
        ("PATCH", "/api/v1/jobs/known", {"margin_ratio": 1.0}, 422, None),
        ("PATCH", "/api/v1/jobs/known", {"budget_bytes": 0}, 422, None),
        ("PATCH", "/api/v1/jobs/known", {}, 422, None),
        ("POST", "/api/v1/jobs/nope/pin", {"checkpoint_every": 1}, 404, None),
    ],
)
def test_bad_bodies(core: AdvisorCore, method: str, url: str, body: object, status: int, field: str | None) -> None:
    http = TestClient(create_app(core, TokenAuth(token=TOKEN)))
    r = http.request(method, url, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert r.json()["detail"]
    if field:
        assert r.json()["field"] == field


def test_stats_over_a_time_range_and_per_rank(core: AdvisorCore) -> None:
    http = TestClient(create_app(core))
    rows = http.get("/api/v1/jobs/known/stats").json()["stats"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    mid = rows[1]["time"]
    assert [r["step"] for r in http.get("/api/v1/jobs/known/stats", params={"since": mid}).json()["stats"]] == [1, 2]
    assert [r["step"] for r in http.get("/api/v1/jobs/known/stats", params={"until": mid}).json()["stats"]] == [0, 1]
    assert http.get("/api/v1/jobs/known/stats", params={"rank": 1}).json()["stats"] == []
    r = http.get("/api/v1/jobs/known/stats", params={"since": mid + 10, "until": mid})
    assert r.status_code == 422 and r.json()["field"] == "since"
    assert http.get("/api/v1/jobs", params={"state": "bogus"}).status_code == 422
    job = http.get("/api/v1/jobs/known").json()
    assert job["ranks"][0]["plan_version"] == 1 and job["oom_events"] == 0 and job["headroom_ratio"] > 0


# -- schemathesis over the served spec ---------------------------------------------------------------

_fuzz_core = make_core(Path(__import__("tempfile").mkdtemp(prefix="rematd-rest-fuzz-")))
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(_fuzz_core, TokenAuth(token=TOKEN)))


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_a_server_error(case: schemathesis.Case) -> None:
    # Half the cases aim at a job that exists, so the handlers past the 404 are fuzzed too.
    if case.path_parameters and len(str(case.path_parameters.get("job", ""))) % 2 == 0:
        case.path_parameters["job"] = "known"
    headers = AUTH if (case.body is None or hash(str(case.body)) % 4) else {}
    case.call_and_validate(headers=headers, checks=[not_a_server_error])


def test_a_write_gets_one_answer_whatever_its_host(core: AdvisorCore) -> None:
    # A service beyond loopback with no token: no write is taken, and each is told why the same way.
    for host in ("127.0.0.1:8080", "attacker.example:8080", "10.1.2.3:8080"):
        exposed = TestClient(create_app(core, TokenAuth(open_writes=False)), base_url=f"http://{host}")
        for method, url, body in WRITES:
            r = exposed.request(method, url, json=body)
            assert r.status_code == 401 and "writes need a token" in r.json()["detail"], (host, method, r.text)
    # With a token, a write without it is 401 at any Host; a cross-site one is 403 at any Host, token or not.
    for host in ("127.0.0.1:8080", "attacker.example:8080"):
        http = TestClient(create_app(core, TokenAuth(token=TOKEN)), base_url=f"http://{host}")
        for method, url, body in WRITES:
            assert http.request(method, url, json=body).status_code == 401, (host, method)
            cross = http.request(method, url, json=body, headers={**AUTH, "sec-fetch-site": "cross-site"})
            assert cross.status_code == 403, (host, method)
    assert core.job_controls("known")["pin_every"] is None and core.get_job("known")["state"] == "running"
    # Writes are refused before their body is read, and a body over the cap is refused once authorized.
    http = TestClient(create_app(core, TokenAuth(token=TOKEN)))
    big = b'{"blocks": [' + b"1, " * 40_000 + b"1]}"
    assert http.post("/api/v1/jobs/known/pin", content=big).status_code == 401
    assert http.post("/api/v1/jobs/known/pin", content=big, headers=AUTH).status_code == 413
