"""Plans kept whole: modes and per-length tables from the planner to the store, the REST API, pins and warm starts."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from rematd.planner import MODES_BY_LABEL, Mode, ModeCost, Shape, Size
from rematd.planner.messages import BlockProfile, Hello, StepStats
from rematd.server.core.advisor import AdvisorCore, RankSession, mode_names
from rematd.server.core.sessions import SENT_KEPT
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store
from rematd.server.transport.rest import create_app


def letters(names: list[str]) -> str:
    return "".join(MODES_BY_LABEL[n].letter for n in names)


def mode_block(i: int, *, selective: bool = True, recompute: bool = True, offload: bool = False) -> BlockProfile:
    """A block that may store, keep its matmul outputs (selective) or recompute, as the client profiles one."""
    saved, kept_selective, inputs, seconds = 1000, 400, 100, 0.01
    modes = [ModeCost(mode=Mode.STORE, kept=Size.linear(saved))]
    if selective:
        modes.append(
            ModeCost(
                mode=Mode.SELECTIVE,
                kept=Size.linear(kept_selective),
                transient=Size.linear(saved - kept_selective),
                extra_seconds=seconds / 4,
            )
        )
    if recompute:
        modes.append(
            ModeCost(mode=Mode.RECOMPUTE, kept=Size.linear(inputs), transient=Size.linear(saved), extra_seconds=seconds)
        )
    if offload:
        modes.append(ModeCost(mode=Mode.OFFLOAD, kept=Size(), transient=Size.linear(saved), extra_seconds=seconds))
    return BlockProfile(
        index=i, name=f"h.{i}", saved_bytes=saved, input_bytes=inputs, forward_seconds=seconds, modes=tuple(modes)
    )


def modes_hello(job: str, *, fingerprint: str = "modes-fp") -> Hello:
    # Blocks 0, 1, 4, 5 offer selective and the others recompute: a block offering both would have
    # selective priced as recomputing until a step measured it, and the plans would never show it.
    return Hello(
        job_id=job,
        blocks=tuple(mode_block(i, selective=i % 4 < 2, recompute=i % 4 >= 2) for i in range(8)),
        profile_shape=Shape(batch=1, seq_len=64, tokens=64),
        budget_bytes=10_000,
        model_fingerprint=fingerprint,
        device_name="NVIDIA H100",
    )


def step(core: AdvisorCore, s: RankSession, n: int, seq: int, peak: int) -> None:
    core.on_stats(
        s,
        StepStats(
            step=n,
            saved_peak_bytes=peak,
            budget_bytes=10_000,
            shape=Shape(batch=1, seq_len=seq, tokens=seq),
            plan_version=s.sent.version,
        ),
    )


# Lengths that grow past what the profile's plan covers, then settle at 128.
LENGTHS = [64] * 3 + [128] * 3 + [256] * 3 + [128] * 3


def run(core: AdvisorCore, job: str) -> RankSession:
    s, _ = core.open_session(modes_hello(job))
    for n, seq in enumerate(LENGTHS):
        step(core, s, n, seq, 6000 if seq == 64 else 9000)
    return s


@pytest.fixture
def core(tmp_path: Path) -> Iterator[AdvisorCore]:
    c = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    yield c
    c.store.close()


def test_modes_and_the_table_reach_the_rest_api(core: AdvisorCore) -> None:
    s = run(core, "by-length")
    http = TestClient(create_app(core), base_url="http://127.0.0.1")
    plans = http.get("/api/v1/jobs/by-length/plans").json()["plans"]
    assert len(plans) >= 2
    last = plans[-1]
    assert last["version"] == s.sent.version
    assert last["modes"] == mode_names(s.sent.block_modes(8))
    table = {e["max_seq_len"]: letters(e["modes"]) for e in last["shape_plans"]}
    assert table == {e.max_seq_len: letters(mode_names(e.modes)) for e in s.sent.shape_plans}, (
        "the table reads back as the planner made it"
    )
    assert len(set(table.values())) >= 3, f"the modes change by length: {table}"
    assert any("s" in v for v in table.values()) and any("R" in v for v in table.values()), table
    # Kept one letter a block, as the demo prints them (a large model's table stays small).
    with core.store.engine.connect() as conn:
        raw = conn.execute(text("SELECT modes, shape_plans FROM plans ORDER BY id DESC LIMIT 1")).one()
    assert raw[0] == letters(last["modes"]) and f'"{letters(last["shape_plans"][-1]["modes"])}"' in raw[1]
    # Selective blocks are not lost: "blocks" lists every block that does not store.
    for p in plans:
        assert p["blocks"] == [i for i, m in enumerate(p["modes"]) if m != "store"]

    # The job and its rank show the entry in force for the last step's length (128), not the table's top.
    job = http.get("/api/v1/jobs/by-length").json()
    entry = next(e for e in last["shape_plans"] if e["max_seq_len"] >= 128)
    assert job["in_force"]["seq_len"] == 128 and job["in_force"]["max_seq_len"] == entry["max_seq_len"]
    assert job["in_force"]["modes"] == entry["modes"] != last["shape_plans"][-1]["modes"]
    assert job["ranks"][0]["modes"] == entry["modes"]
    assert job["ranks"][0]["checkpointed_blocks"] == [i for i, m in enumerate(entry["modes"]) if m != "store"]

    # Each step's predicted peak is that of the modes in force at its own length.
    rows = http.get("/api/v1/jobs/by-length/stats").json()["stats"]
    at = {r["seq_len"]: r["predicted_peak_bytes"] for r in rows[-3:]}
    assert at == {128: entry["predicted_peak_bytes"]}, (at, entry)
    longest = max(r["predicted_peak_bytes"] for r in rows if r["seq_len"] == 256)
    assert longest != at[128]


def test_a_pin_by_modes_is_sent_recorded_and_checked(core: AdvisorCore) -> None:
    s = run(core, "pinned")
    http = TestClient(create_app(core), base_url="http://127.0.0.1")
    want = ["selective", "store", "recompute", "store", "selective", "store", "recompute", "store"]
    r = http.post("/api/v1/jobs/pinned/pin", json={"modes": want})
    assert r.status_code == 200, r.text
    assert r.json()["pin_modes"] == want and r.json()["pin_blocks"] is None
    step(core, s, 100, 256, 5000)
    assert mode_names(s.sent.modes) == want and "pinned by an operator: modes s.R.s.R." in s.sent.reason
    assert s.sent.shape_plans == (), "a pin holds at every length"
    assert s.sent.blocks == (0, 2, 4, 6)
    recorded = http.get("/api/v1/jobs/pinned/plans").json()["plans"][-1]
    assert recorded["modes"] == want and recorded["shape_plans"] == []
    # Bad pins name what is wrong, and change nothing.
    for body, field in [
        ({"modes": want[:3]}, "modes"),
        ({"modes": ["store"] * 7 + ["sideways"]}, "modes"),
        ({"modes": ["offload"] * 8}, "modes"),
        ({"modes": want, "blocks": [1]}, "body"),
    ]:
        r = http.post("/api/v1/jobs/pinned/pin", json=body)
        assert r.status_code == 422, (body, r.text)
        assert field in r.text, (body, r.text)
    assert http.get("/api/v1/jobs/pinned").json()["controls"]["pin_modes"] == want
    # Survives a restart of the process: another core over the same record picks it up.
    other = AdvisorCore(core.store, Metrics())
    assert other.job_controls("pinned")["pin_modes"] == want
    assert http.delete("/api/v1/jobs/pinned/pin").json()["pin_modes"] is None


def test_a_warm_start_keeps_the_modes_and_the_table(core: AdvisorCore) -> None:
    first = run(core, "first")
    at_128 = Shape(batch=1, seq_len=128, tokens=128)
    for n in range(len(LENGTHS), len(LENGTHS) + 25):
        # Steps that peak where predicted, give or take 1%: the plan it holds fits by the profile alone, as
        # a warm start needs (peaks that settled on the model would let it use a margin a new job has not earned).
        in_force = next(e for e in first.sent.shape_plans if e.max_tokens >= at_128.tokens)
        step(core, first, n, 128, int(in_force.predicted_peak_bytes * (0.99 if n % 2 else 1.0)))
    held = first.sent
    core.close_session(first, ended=True)
    assert any(m == Mode.SELECTIVE for e in held.shape_plans for m in e.modes)
    warm = core.store.warm_plan(fingerprint="modes-fp", device="NVIDIA H100", bucket=(64).bit_length())
    assert warm is not None and warm["modes"] == mode_names(held.block_modes(8))
    assert [e["modes"] for e in warm["shape_plans"]] == [mode_names(e.modes) for e in held.shape_plans]

    second, plan = core.open_session(modes_hello("second"))
    assert plan.reason.startswith("warm start from job first"), plan.reason
    assert plan.block_modes(8) == held.block_modes(8)
    assert plan.shape_plans == held.shape_plans, "the table of the job that held comes with it"
    recorded = core.job_plans("second")[0]
    assert recorded["modes"] == mode_names(held.block_modes(8))
    assert len(recorded["shape_plans"]) == len(held.shape_plans)
    core.close_session(second, ended=True)


def test_a_warm_start_loosens_where_this_job_measures_room(core: AdvisorCore) -> None:
    first = run(core, "lean")
    # The first job's steps at 128 peaked 30% over the prediction: its plan is lean.
    for n in range(len(LENGTHS), len(LENGTHS) + 25):
        in_force = next(e for e in first.sent.shape_plans if e.max_tokens >= 128)
        step(core, first, n, 128, int(in_force.predicted_peak_bytes * 1.3))
    core.close_session(first, ended=True)
    lean = sum(m != Mode.STORE for m in first.sent.modes_for(Shape(batch=1, seq_len=128, tokens=128), 8))

    second, plan = core.open_session(modes_hello("roomy"))
    assert plan.reason.startswith("warm start from job lean"), plan.reason
    # This job's steps peak where predicted, under the same budget: within a few dwells the plan
    # recomputes less than the one it started from.
    for n in range(40):
        in_force = next(e for e in second.sent.shape_plans if e.max_tokens >= 128)
        step(core, second, n, 128, in_force.predicted_peak_bytes)
    now = sum(m != Mode.STORE for m in second.sent.modes_for(Shape(batch=1, seq_len=128, tokens=128), 8))
    assert now < lean, (lean, now, second.sent.reason)
    core.close_session(second, ended=True)


def test_an_ended_job_has_an_end_time_and_no_live_risk(core: AdvisorCore) -> None:
    s = run(core, "done")
    assert core.get_job("done")["oom_risk"] is not None, "a running job shows its risk"
    # Another rank of the job, still training: its job has not ended when the first says goodbye.
    other, _ = core.open_session(dataclasses.replace(modes_hello("done"), rank=1, world_size=2))
    core.close_session(s, ended=True)
    assert core.get_job("done")["state"] == "running" and core.get_job("done")["ended_at"] is None
    core.close_session(other, ended=True)
    job = core.get_job("done")
    assert job["state"] == "ended" and job["ended_at"] is not None
    assert job["oom_risk"] is None and job["ranks"][0]["oom_risk"] is None
    assert [j["oom_risk"] for j in core.list_jobs("ended")] == [None]


def held_and_ended(core: AdvisorCore, job: str) -> RankSession:
    """A job that held its plan, steps peaking where predicted, and ended: it leaves a warm start."""
    s = run(core, job)
    for n in range(len(LENGTHS), len(LENGTHS) + 25):
        in_force = next(e for e in s.sent.shape_plans if e.max_tokens >= 128)
        step(core, s, n, 128, int(in_force.predicted_peak_bytes * (0.99 if n % 2 else 1.0)))
    core.close_session(s, ended=True)
    return s


def test_a_warm_start_comes_only_from_a_job_of_the_same_budget_within_ten_percent(core: AdvisorCore) -> None:
    held_and_ended(core, "small")  # a budget of 10,000 bytes
    far, plan = core.open_session(dataclasses.replace(modes_hello("far"), budget_bytes=10**9))
    assert "warm start" not in plan.reason, plan.reason
    near, plan = core.open_session(dataclasses.replace(modes_hello("near"), budget_bytes=10_900))
    assert plan.reason.startswith("warm start from job small"), plan.reason
    core.close_session(far, ended=True)
    core.close_session(near, ended=True)


def test_plan_rows_keep_their_length_and_versions_go_on_when_a_job_name_is_used_again(core: AdvisorCore) -> None:
    first = run(core, "again")
    core.close_session(first, ended=True)
    rows = core.job_plans("again")
    assert rows[0]["seq_len"] == 64, "the first plan was made at the profiled step's length"
    assert {r["seq_len"] for r in rows[1:]} <= set(LENGTHS) and len(rows) >= 2
    second, plan = core.open_session(modes_hello("again"))
    assert plan.version == rows[-1]["version"] + 1, "a second run's first plan is not a second v1"
    for n, seq in enumerate(LENGTHS):
        step(core, second, n, seq, 6000 if seq == 64 else 9000)
    core.close_session(second, ended=True)
    versions = [(r["rank"], r["version"]) for r in core.job_plans("again")]
    assert len(versions) == len(set(versions)) and versions == sorted(versions), versions


def test_a_step_on_a_plan_several_sends_old_is_told_its_plan(core: AdvisorCore) -> None:
    """Plans may follow each other inside one of a rank's steps: a step that reports one sent several plans
    ago is still attributed to that plan's modes, and one older than the kept history to none."""
    s, _ = core.open_session(modes_hello("history"))
    first = s.sent
    sent = [dataclasses.replace(first, version=first.version + k, modes=()) for k in range(1, SENT_KEPT + 2)]
    for plan in sent:
        s.send(plan)
    s.send(sent[-1])  # sent again (a pin, a re-sent plan): not a plan of its own
    assert s.plan_of(sent[-1].version) is sent[-1]
    assert s.plan_of(sent[-3].version) is sent[-3], "a plan three sends old"
    assert s.plan_of(sent[0].version) is sent[0], f"the oldest of the {SENT_KEPT} kept"
    assert s.plan_of(first.version) is None, "older than the kept history"
    assert s.plan_of(sent[-1].version + 1) is None, "never sent"
