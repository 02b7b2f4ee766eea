"""The service's adapters over a real gRPC channel and a real SQLite file."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from rematd import wire
from rematd.planner import Shape
from rematd.planner.messages import BlockProfile, Hello, InvalidMessage, StepStats
from rematd.server import ServiceThread
from rematd.server.core.advisor import AdvisorCore
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store
from rematd.server.transport.rest import create_app
from rematd.v1 import advisor_pb2 as pb
from rematd.v1 import advisor_pb2_grpc as pb_grpc


def hello(job: str = "job-a", rank: int = 0, budget: int = 10_000, n: int = 4) -> Hello:
    return Hello(
        job_id=job,
        rank=rank,
        world_size=2,
        blocks=tuple(
            BlockProfile(index=i, name=f"h.{i}", saved_bytes=1000, input_bytes=100, forward_seconds=0.01)
            for i in range(n)
        ),
        profile_shape=Shape(batch=1, seq_len=64, tokens=64),
        budget_bytes=budget,
        model_fingerprint="abc",
    )


def stats(step: int, peak: int, budget: int = 10_000, seq: int = 64) -> StepStats:
    return StepStats(
        step=step, saved_peak_bytes=peak, budget_bytes=budget, shape=Shape(batch=1, seq_len=seq, tokens=seq)
    )


@pytest.fixture
def service(service_thread: ServiceThread) -> ServiceThread:
    return service_thread


def session(target: str, messages: list[pb.ClientMessage]) -> tuple[list[pb.ServerMessage], grpc.RpcError | None]:
    with grpc.insecure_channel(target) as channel:
        call = pb_grpc.AdvisorStub(channel).Session(iter(messages), timeout=10)
        got: list[pb.ServerMessage] = []
        try:
            for msg in call:
                got.append(msg)
        except grpc.RpcError as err:
            return got, err
        return got, None


def test_hello_stats_goodbye_over_grpc(service: ServiceThread) -> None:
    target = service.service.bound.grpc  # type: ignore[union-attr]
    msgs = [
        pb.ClientMessage(hello=wire.hello_to_pb(hello())),
        pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 3900))),
        pb.ClientMessage(stats=wire.stats_to_pb(stats(1, 9500, seq=128))),
        pb.ClientMessage(goodbye=pb.Goodbye(reason="done")),
    ]
    got, err = session(target, msgs)
    assert err is None
    kinds = [m.WhichOneof("kind") for m in got]
    assert kinds[0] == "plan" and got[0].plan.version == 1
    assert kinds.count("ack") == 2
    plans = [m.plan for m in got if m.WhichOneof("kind") == "plan"]
    assert len(plans) == 2 and len(plans[1].checkpoint_blocks) > len(plans[0].checkpoint_blocks)
    assert "tighten" in plans[1].reason


@pytest.mark.parametrize(
    ("message", "code", "text"),
    [
        (pb.ClientMessage(stats=wire.stats_to_pb(stats(0, 1))), grpc.StatusCode.FAILED_PRECONDITION, "hello"),
        (pb.ClientMessage(hello=wire.hello_to_pb(hello(job="../etc"))), grpc.StatusCode.INVALID_ARGUMENT, "job_id"),
        (pb.ClientMessage(hello=wire.hello_to_pb(hello(budget=0))), grpc.StatusCode.INVALID_ARGUMENT, "budget_bytes"),
        (pb.ClientMessage(hello=wire.hello_to_pb(hello(rank=5))), grpc.StatusCode.INVALID_ARGUMENT, "rank"),
        (pb.ClientMessage(), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ],
)
def test_bad_messages_are_refused_by_name(
    service: ServiceThread, message: pb.ClientMessage, code: grpc.StatusCode, text: str
) -> None:
    target = service.service.bound.grpc  # type: ignore[union-attr]
    _, err = session(target, [message])
    assert err is not None and err.code() == code and text in (err.details() or "")
    # The server lives on.
    got, err = session(target, [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="after")))])
    assert err is None and got[0].plan.version == 1


def test_bad_stats_are_refused(service: ServiceThread) -> None:
    target = service.service.bound.grpc  # type: ignore[union-attr]
    bad_time = wire.stats_to_pb(stats(0, 10))
    bad_time.step_seconds = math.nan
    for bad, field in [(bad_time, "step_seconds"), (wire.stats_to_pb(stats(0, 10, budget=0)), "budget_bytes")]:
        msgs = [pb.ClientMessage(hello=wire.hello_to_pb(hello())), pb.ClientMessage(stats=bad)]
        _, err = session(target, msgs)
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (err.details() or "")
    backwards = [
        pb.ClientMessage(hello=wire.hello_to_pb(hello())),
        pb.ClientMessage(stats=wire.stats_to_pb(stats(5, 10))),
        pb.ClientMessage(stats=wire.stats_to_pb(stats(4, 10))),
    ]
    _, err = session(target, backwards)
    assert err is not None and "stats.step" in (err.details() or "")


def test_core_persists_history_across_restart(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    core = AdvisorCore(Store(db), Metrics())
    s, _plan = core.open_session(hello())
    new = core.on_stats(s, stats(0, 9500, seq=128))
    assert new is not None and new.version == 2
    core.close_session(s, ended=False)
    core.store.close()

    again = AdvisorCore(Store(db), Metrics())
    plans = again.job_plans("job-a")
    assert [p["version"] for p in plans] == [1, 2]
    assert again.get_job("job-a")["state"] == "disconnected"
    assert again.job_stats("job-a")[0]["peak_bytes"] == 9500


def test_resumed_rank_keeps_its_plan(tmp_path: Path) -> None:
    core = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    s, _ = core.open_session(hello())
    core.on_stats(s, stats(0, 9500, seq=128))
    version = s.planner.plan.version
    core.close_session(s, ended=False)
    resumed, plan = core.open_session(
        Hello(**{**_fields(hello()), "plan_version": version, "session_secret": s.secret})
    )
    assert resumed is s and plan.version == version
    assert [p["version"] for p in core.job_plans("job-a")] == [1, 2], "a resume records no new plan"
    with pytest.raises(InvalidMessage, match=r"stats\.step"):
        core.on_stats(resumed, stats(0, 10))


def _fields(h: Hello) -> dict[str, object]:
    return {f: getattr(h, f) for f in h.__dataclass_fields__}


def test_rest_reads_and_errors(tmp_path: Path) -> None:
    core = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    s, _ = core.open_session(hello(job="rest-job"))
    core.on_stats(s, stats(0, 500))
    http = TestClient(create_app(core))
    job = http.get("/api/v1/jobs/rest-job").json()
    assert job["ranks"][0]["last_stats"]["peak_bytes"] == 500 and job["state"] == "running"
    assert http.get("/api/v1/jobs/missing").status_code == 404
    assert http.get("/api/v1/jobs/rest-job/stats", params={"limit": 0}).status_code == 422
    assert http.get("/api/v1/jobs/rest-job/ooms").json()["ooms"] == []
    assert http.get("/openapi.json").json()["info"]["title"] == "rematd"


def test_rank_outliving_a_restart_continues_its_history(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    core = AdvisorCore(Store(db), Metrics())
    s, _ = core.open_session(hello())
    core.on_stats(s, stats(0, 9500, seq=128))
    core.close_session(s, ended=False)
    core.store.close()
    restarted = AdvisorCore(Store(db), Metrics())
    s2, plan = restarted.open_session(Hello(**{**_fields(hello()), "plan_version": 2}))
    assert plan.version == 3
    assert [p["version"] for p in restarted.job_plans("job-a")] == [1, 2, 3]
    restarted.on_stats(s2, stats(1, 100))


def test_rank_that_planned_on_its_own_gets_versions_above_its_own(tmp_path: Path) -> None:
    core = AdvisorCore(Store(tmp_path / "r.db"), Metrics())
    s, first = core.open_session(hello())
    core.close_session(s, ended=False)
    # Cut off, the client's fallback planner went on to version 7; the service must not send less.
    again, plan = core.open_session(Hello(**{**_fields(hello()), "plan_version": 7, "session_secret": s.secret}))
    assert again is s and plan.version == 8 and plan.blocks == first.blocks
    assert [p["version"] for p in core.job_plans("job-a")] == [1, 8]
