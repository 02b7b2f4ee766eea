"""The REST responses' models: /openapi.json documents each endpoint's response, and no response loses a key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from rematd.planner.messages import OomReport, Shape
from rematd.server.core.advisor import AdvisorCore
from rematd.server.core.views import JobView
from rematd.server.metrics.registry import Metrics
from rematd.server.store.rows import ControlsRow
from rematd.server.store.store import Store
from rematd.server.transport.auth import TokenAuth
from rematd.server.transport.rest import create_app
from rematd.server.transport.rest_models import JobList, JobOoms, JobPlans, JobStats

from .test_service import hello, stats

TOKEN = "models-token-0123456789abcdef"

# Each GET endpoint, the schema its 200 response names, and fields that schema must document.
DOCUMENTED = {
    "/healthz": ("Health", {"status", "version"}),
    "/readyz": ("Ready", {"status"}),
    "/api/v1/jobs": ("JobList", {"jobs"}),
    "/api/v1/jobs/{job}": ("JobView", {"job", "state", "ranks", "plan", "in_force", "oom_risk", "controls"}),
    "/api/v1/jobs/{job}/plans": ("JobPlans", {"job", "plans"}),
    "/api/v1/jobs/{job}/stats": ("JobStats", {"job", "stats"}),
    "/api/v1/jobs/{job}/ooms": ("JobOoms", {"job", "ooms"}),
}
NESTED = {
    "StoredPlanRow": {"version", "modes", "shape_plans", "predicted_peak_bytes", "reason"},
    "StoredStepRow": {"rank", "step", "peak_bytes", "seq_len", "step_seconds"},
    "RankView": {"rank", "connected", "last_stats", "modes", "oom_risk"},
    "StoredOomRow": {"rank", "step", "message"},
    "ControlsRow": {"pin_blocks", "pin_modes", "pin_every", "margin_ratio", "budget_bytes", "ended_at"},
}


@pytest.fixture
def core(tmp_path: Path) -> Iterator[AdvisorCore]:
    core = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    s, _ = core.open_session(hello(job="known", n=6))
    for step in range(6):
        core.on_stats(s, stats(step, 4000 + 500 * step, seq=32 * (1 + step % 3)))
    core.on_oom(s, OomReport(step=6, shape=Shape(batch=1, seq_len=96, tokens=96), message="out of memory"))
    ended, _ = core.open_session(hello(job="over", n=4))
    core.on_stats(ended, stats(0, 500))
    core.close_session(ended, ended=True)
    yield core
    core.store.close()


def _ref(content: dict[str, Any]) -> str:
    return str(content["application/json"]["schema"]["$ref"]).rsplit("/", 1)[-1]


def test_openapi_names_a_response_schema_with_its_fields_for_each_get(core: AdvisorCore) -> None:
    spec = TestClient(create_app(core)).get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    gets = {path for path, ops in spec["paths"].items() if "get" in ops}
    assert gets == set(DOCUMENTED)
    for path, (name, fields) in DOCUMENTED.items():
        assert _ref(spec["paths"][path]["get"]["responses"]["200"]["content"]) == name, path
        assert fields <= set(schemas[name]["properties"]), (path, fields - set(schemas[name]["properties"]))
    for name, fields in NESTED.items():
        assert fields <= set(schemas[name]["properties"]), name
    assert _ref(spec["paths"]["/readyz"]["get"]["responses"]["503"]["content"]) == "NotReady"
    for path, method in [("/api/v1/jobs/{job}/pin", "post"), ("/api/v1/jobs/{job}/pin", "delete")]:
        assert _ref(spec["paths"][path][method]["responses"]["200"]["content"]) == "ControlsRow"
    assert _ref(spec["paths"]["/api/v1/jobs/{job}"]["patch"]["responses"]["200"]["content"]) == "ControlsRow"
    assert _ref(spec["paths"]["/api/v1/jobs/{job}/end"]["post"]["responses"]["200"]["content"]) == "JobView"
    # Rows of a table a migration may widen say so; the others are closed.
    assert schemas["StoredStepRow"].get("additionalProperties") is True
    assert schemas["JobView"].get("additionalProperties") is not True


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


def test_every_response_carries_exactly_what_the_view_gives(core: AdvisorCore) -> None:
    http = TestClient(create_app(core, TokenAuth(token=TOKEN)), headers={"authorization": f"Bearer {TOKEN}"})
    jobs = http.get("/api/v1/jobs").json()
    assert jobs == {"jobs": _plain(core.list_jobs()), "next_cursor": None}
    assert {j["job"] for j in jobs["jobs"]} == {"known", "over"}
    view = http.get("/api/v1/jobs/known").json()
    assert view == _plain(core.get_job("known"))
    assert view["ranks"][0]["last_stats"]["recompiles_total"] == 0 and view["plan"]["shape_plans"]
    plans = http.get("/api/v1/jobs/known/plans").json()
    assert plans == {"job": "known", "plans": _plain(core.job_plans("known")), "next_cursor": None}
    got = http.get("/api/v1/jobs/known/stats").json()
    assert got == {"job": "known", "stats": _plain(core.job_stats("known"))} and len(got["stats"]) == 6
    ooms = http.get("/api/v1/jobs/known/ooms").json()
    assert ooms == {"job": "known", "ooms": _plain(core.job_ooms("known")), "next_cursor": None}
    pinned = http.post("/api/v1/jobs/known/pin", json={"modes": ["recompute", "store"] * 3}).json()
    assert pinned == _plain(core.job_controls("known")) and pinned["pin_modes"][0] == "recompute"
    assert http.patch("/api/v1/jobs/known", json={"margin_ratio": 0.25}).json()["margin_ratio"] == 0.25
    assert http.delete("/api/v1/jobs/known/pin").json() == _plain(core.job_controls("known"))
    ended = http.post("/api/v1/jobs/known/end").json()
    assert ended == _plain(core.get_job("known")) and ended["state"] == "ended"
    assert http.get("/healthz").json()["status"] == "ok"
    assert http.get("/readyz").json() == {"status": "ready"}


def test_a_key_a_migration_adds_to_stats_rows_reaches_the_client(core: AdvisorCore) -> None:
    real = core.job_stats

    def wider(job: str, **kw: Any) -> list[dict[str, Any]]:
        return [{**row, "oom_risk": 0.125} for row in real(job, **kw)]

    core.job_stats = wider  # type: ignore[method-assign]
    rows = TestClient(create_app(core)).get("/api/v1/jobs/known/stats").json()["stats"]
    assert rows and all(r["oom_risk"] == 0.125 for r in rows)


def test_every_view_fits_its_model_and_comes_back_whole(core: AdvisorCore) -> None:
    """The endpoints send the views unvalidated (a large read stays cheap); here each is held to its model."""
    core.pin("known", pin_blocks=[1, 3])
    core.tune("known", {"budget_bytes": 123_456})
    views = [
        (JobList, {"jobs": core.list_jobs()}),
        (JobView, core.get_job("known")),
        (JobView, core.get_job("over")),
        (JobPlans, {"job": "known", "plans": core.job_plans("known")}),
        (JobStats, {"job": "known", "stats": core.job_stats("known")}),
        (JobOoms, {"job": "known", "ooms": core.job_ooms("known")}),
        (ControlsRow, core.job_controls("known")),
        (JobView, core.end_job("known")),
    ]
    for model, view in views:
        adapter = TypeAdapter(model)
        back = adapter.dump_python(adapter.validate_python(view), mode="json", exclude_unset=True)
        assert back == _plain(view), str(model)
    with pytest.raises(ValueError, match="state"):
        TypeAdapter(JobView).validate_python({**core.get_job("over"), "state": "sideways"})
