"""The rows and views are defined once (``rematd.server.store.rows``, ``rematd.server.core.views``); the
database's tables, the REST API's schemas, the dashboard's reads and the metrics' labels are held to them
here, so that a field added in one place and forgotten in another fails a test."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy import inspect

from rematd.planner import MODE_LETTERS, MODES_BY_LABEL, Mode
from rematd.planner.messages import StepStats
from rematd.server.core.advisor import AdvisorCore
from rematd.server.core.training import REPORTED
from rematd.server.core.views import BucketPrice, InForce, JobView, ModePrice, RankView
from rematd.server.metrics.live import JOB_GAUGES
from rematd.server.metrics.registry import Metrics
from rematd.server.store import rows
from rematd.server.store.rows import keys
from rematd.server.store.store import Store
from rematd.server.store.tables import JOB_CONTROLS, JOBS, STATS, TABLES, Table
from rematd.server.transport.rest import create_app
from rematd.server.transport.rest_ops import MODE_COLOURS, dashboard_page


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "rows.db")
    yield s
    s.close()


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_each_table_holds_exactly_its_row_type(store: Store, table: Table) -> None:
    columns = {c["name"] for c in inspect(store.engine).get_columns(table.name)}
    # Row ids are the database's own; the owner columns (a row's job, a rank's holder) are written, not read.
    assert columns - {"id"} == set(table.columns), (
        f"{table.name}: add a migration, or the field to {table.row.__name__}"
    )
    assert set(table.columns) - set(table.owner) == set(keys(table.row))


def test_the_statements_name_each_column_once_and_bind_it_by_its_own_name() -> None:
    assert STATS.columns == ("job", *keys(rows.StoredStepRow))
    assert {"oom_risk"} == STATS.optional, "only what a client may leave unmeasured is nullable"
    for table in TABLES:
        sql = table.insert()
        for column in table.columns:
            assert f":{column}" in sql
        assert sql.count(":") == len(table.columns), sql
    upsert = JOB_CONTROLS.insert()
    assert "pin_every=excluded.pin_every" in upsert and "job=excluded" not in upsert
    assert "created_at=excluded" not in JOBS.insert(), "a job's creation time stays as first written"


def test_a_write_lacking_a_required_field_is_refused_by_name() -> None:
    row = {"job": "j", "rank": 0, "step": 1}
    with pytest.raises(KeyError, match="time"):
        STATS.values(row)
    full = {**row, "time": 1.0, "peak_bytes": 1, "budget_bytes": 2, "predicted_peak_bytes": 1, "plan_version": 1,
            "seq_len": 8, "batch": 1, "step_seconds": 0.1}  # fmt: skip
    assert STATS.values(full)["oom_risk"] is None


def test_fields_a_step_report_and_its_row_share_mean_the_same() -> None:
    shared = set(keys(StepStats)) & set(keys(rows.StepRow))
    assert shared == {"step", "budget_bytes", "plan_version", "step_seconds"} == set(REPORTED)
    row_types, stats_types = get_type_hints(rows.StepRow), get_type_hints(StepStats)
    for name in shared:
        assert row_types[name] == stats_types[name], name


def test_the_rest_api_documents_the_row_types_themselves(store: Store) -> None:
    schemas = TestClient(create_app(AdvisorCore(store, Metrics()))).get("/openapi.json").json()["components"]["schemas"]
    for row in (rows.StoredStepRow, rows.StoredPlanRow, rows.StoredOomRow, rows.ControlsRow, rows.LastStepRow):
        assert set(schemas[row.__name__]["properties"]) == set(keys(row)), row.__name__
    for view in (JobView, RankView, InForce, ModePrice, BucketPrice):
        assert set(schemas[view.__name__]["properties"]) == set(keys(view)), view.__name__


def test_every_field_the_dashboard_reads_is_a_field_of_a_row_or_a_view() -> None:
    page = dashboard_page()
    # The page's own code is camelCase; snake_case names after a dot are the service's fields.
    read = set(re.findall(r"\.([a-z]+(?:_[a-z]+)+)\b", page))
    views = (JobView, RankView, InForce, ModePrice, BucketPrice)
    known = {k for t in (*{t.row for t in TABLES}, *views) for k in keys(t)}
    assert read, "the dashboard reads fields"
    assert read <= known, f"the dashboard reads fields no row or view has: {sorted(read - known)}"


def test_the_mode_vocabulary_is_one_table() -> None:
    labels = tuple(m.label for m in Mode)
    assert get_args(rows.ModeName) == labels, "ModeName must list every Mode, in order"
    assert set(MODE_LETTERS) == set(Mode) == set(MODE_COLOURS)
    assert len(set(MODE_LETTERS.values())) == len(Mode), "one letter a mode"
    page = dashboard_page()
    assert "/*MODES*/" not in page
    for m in Mode:
        assert f'"name": "{m.label}", "letter": "{m.letter}", "colour": "{MODE_COLOURS[m]}"' in page
        assert MODES_BY_LABEL[m.label] is m
    assert len(MODES_BY_LABEL) == len(Mode), "one label a mode"


def test_metric_labels_are_bounded_and_name_row_fields() -> None:
    metrics = Metrics(CollectorRegistry())
    series = [m for m in vars(metrics).values() if isinstance(m, Counter | Gauge | Histogram)]
    assert len(series) >= 10, "every counter, gauge and histogram is an attribute"
    labels = {label for metric in series for label in metric._labelnames}
    assert labels <= {"job", "kind", "outcome", "transport"}
    assert {"job", "rank"} <= set(keys(rows.RankRow)), "per-job and per-rank series are labelled by row fields"
    assert set(JOB_GAUGES) >= {"rematd_headroom_ratio", "rematd_oom_risk_ratio", "rematd_peak_bytes"}
