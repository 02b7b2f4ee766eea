"""The store's fifth migration (each step's OOM risk) on a store of version 4, and the stored columns' codecs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import event

from rematd.server.store import columns as rows
from rematd.server.store.schema import _TYPES, MIGRATIONS, SCHEMA_VERSION
from rematd.server.store.store import Store


def _row(step: int, **extra: object) -> dict[str, object]:
    return {"step": step, "time": 100.0 + step, "peak_bytes": 900 + step, "budget_bytes": 10_000,
            "predicted_peak_bytes": 950, "plan_version": 1, "seq_len": 16, "batch": 2, "step_seconds": 0.5,
            **extra}  # fmt: skip


def _version_4_file(db: Path) -> None:
    """A store as rematd wrote it at schema version 4: migrations 1-4 as they shipped, and rows in them."""
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE schema_version (version BIGINT PRIMARY KEY, description TEXT NOT NULL, applied_at REAL)")
    for version, description, statements in MIGRATIONS:
        if version > 4:
            break
        for sql in statements:
            con.execute(sql.format(**_TYPES["sqlite"]))
        con.execute("INSERT INTO schema_version VALUES (?, ?, 0)", (version, description))
    con.executescript(
        """INSERT INTO jobs (job, created_at, updated_at, world_size, num_blocks, budget_bytes, model_fingerprint,
               device, ended_at) VALUES ('old', 1.0, 2.0, 1, 2, 10000, 'fp', 'cpu', NULL);
        INSERT INTO ranks VALUES ('old', 0, 'cpu', 'disconnected', '{"step": 7, "peak_bytes": 907}');
        INSERT INTO plans (job, rank, version, checkpoint_every, blocks, predicted_peak_bytes,
               predicted_overhead_ratio, target_bytes, reason, created_at, modes, shape_plans)
           VALUES ('old', 0, 1, 1, '[1]', 4000, 0.1, 9000, 'initial plan from profile', 1.0, '.R', '[]');
        INSERT INTO stats (job, rank, step, time, peak_bytes, budget_bytes, predicted_peak_bytes, plan_version,
               seq_len, batch, step_seconds) VALUES ('old', 0, 7, 107.0, 907, 10000, 950, 1, 16, 2, 0.5);
        INSERT INTO oom_events (job, rank, step, time, seq_len, batch, plan_version, message)
           VALUES ('old', 0, 3, 103.0, 16, 2, 1, 'CUDA out of memory');
        INSERT INTO learned_state VALUES ('old', 0, '{"slope": 1.5}', 2.0);"""
    )
    con.commit()
    con.close()


def test_a_version_4_record_migrates_to_5_keeping_its_rows(tmp_path: Path) -> None:
    assert SCHEMA_VERSION >= 5
    db = tmp_path / "v4.db"
    _version_4_file(db)
    store = Store(db)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        [old] = store.stats("old", 10)
        assert old["step"] == 7 and old["peak_bytes"] == 907 and old["oom_risk"] is None, old
        assert [p["modes"] for p in store.plans("old")] == [["store", "recompute"]]
        assert [o["message"] for o in store.ooms("old")] == ["CUDA out of memory"]
        assert store.ranks("old")[0]["last_stats"] == {"step": 7, "peak_bytes": 907}
        assert store.learned(job="old", rank=0) == {"slope": 1.5}
        store.add_stats(job="old", rank=0, row=_row(8, oom_risk=0.25))
        assert [r["oom_risk"] for r in store.stats("old", 10)] == [None, 0.25]
    finally:
        store.close()
    con = sqlite3.connect(db)
    versions = [v for (v,) in con.execute("SELECT version FROM schema_version ORDER BY version")]
    con.close()
    assert versions == list(range(1, SCHEMA_VERSION + 1))


def test_a_stats_rows_oom_risk_round_trips_across_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    store = Store(db)
    store.open_rank(job="j", rank=0, now=1.0, world_size=1, num_blocks=2, budget_bytes=10_000, fingerprint="fp")
    store.add_stats(job="j", rank=0, row=_row(1, oom_risk=0.75))
    store.add_stats(job="j", rank=0, row=_row(2))  # a row without it is stored as NULL
    store.add_stats(job="j", rank=0, row=_row(3, oom_risk=0.0))
    store.close()
    again = Store(db)
    try:
        assert [(r["step"], r["oom_risk"]) for r in again.stats("j", 10)] == [(1, 0.75), (2, None), (3, 0.0)]
        assert [r["oom_risk"] for r in again.stats("j", 10, rank=0, since=102.5)] == [0.0]
        assert again.last_rank_stats("j", 0) == _row(3, oom_risk=0.0)
    finally:
        again.close()


def test_a_listener_on_the_engine_sees_every_statement_the_store_sends(tmp_path: Path) -> None:
    """How a test makes a slow database: a listener on ``Store.engine`` runs before each statement."""
    store = Store(tmp_path / "r.db")
    seen: list[str] = []

    def note(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        seen.append(statement.split()[0].upper())

    event.listen(store.engine, "before_cursor_execute", note)
    try:
        store.open_rank(job="j", rank=0, now=1.0, world_size=1, num_blocks=2, budget_bytes=10_000, fingerprint="fp")
        store.add_stats(job="j", rank=0, row=_row(1))
        store.flush()
        assert seen.count("INSERT") >= 3, seen  # the job, the rank, the buffered statistics row
        assert "UPDATE" in seen, "the write-behind buffer's statements go through the same engine"
    finally:
        store.close()


@pytest.mark.parametrize("text", [None, ""])
def test_a_null_json_column_reads_as_none(text: str | None) -> None:
    assert rows.loads(text) is None
    assert rows.decoded({"id": 1, "last_stats": text}, json_columns=("last_stats",), drop=("id",)) == {
        "last_stats": None
    }


def test_json_columns_decode_and_modes_pack_both_ways() -> None:
    assert rows.decoded({"job": "j", "blocks": "[0, 2]"}, json_columns=("blocks",)) == {"job": "j", "blocks": [0, 2]}
    names = ["store", "selective", "recompute", "offload"]
    assert rows.unpack_modes(rows.pack_modes(names)) == names
    assert rows.packed(None) is None and rows.packed(names) == ".sRO"
    plan = rows.warm_plan_out({"blocks": "[1]", "num_blocks": 3, "modes": None, "shape_plans": None})
    assert plan["modes"] == ["store", "recompute", "store"] and plan["shape_plans"] == []
