"""Messages whose repeated fields (or names) are out of bounds: refused on their counts, before a field is converted,
against a real service on loopback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from bench.rejected_streams import packed_hello
from rematd import wire
from rematd.client.arguments import check_job
from rematd.planner import Mode, Plan, Shape, ShapePlan
from rematd.planner.messages import OomReport
from rematd.server import ServiceThread
from rematd.server.core.rate import OOM_BURST as RATE_BURST
from rematd.v1 import advisor_pb2 as pb

from .test_service import hello, session, stats


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of ``wire.<name>`` (the real one still runs): what the service converted."""
    calls: list[int] = []
    real: Callable[..., Any] = getattr(wire, name)

    def spy(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(wire, name, spy)
    return calls


def test_a_step_report_with_200k_mode_seconds_is_refused_before_conversion(
    service_thread: ServiceThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    converted = _counted(monkeypatch, "stats_from_pb")
    big = wire.stats_to_pb(stats(1, 100))
    big.mode_seconds.extend(pb.ModeSeconds(mode=pb.MODE_RECOMPUTE) for _ in range(200_000))
    assert big.ByteSize() < 1 << 20
    bound = service_thread.service.bound
    assert bound is not None
    _, err = session(
        bound.grpc,
        [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="big-stats"))), pb.ClientMessage(stats=big)],
    )
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stats.mode_seconds" in (err.details() or "")
    assert converted == []  # refused on its count: none of its entries was turned into a store


def test_a_step_report_naming_more_block_modes_than_a_model_has_is_refused_before_conversion(
    service_thread: ServiceThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    converted = _counted(monkeypatch, "stats_from_pb")
    big = wire.stats_to_pb(stats(1, 100))
    big.block_modes.extend([pb.MODE_RECOMPUTE] * 300_000)
    bound = service_thread.service.bound
    assert bound is not None
    _, err = session(
        bound.grpc,
        [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="big-modes"))), pb.ClientMessage(stats=big)],
    )
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stats.block_modes" in (err.details() or "")
    assert converted == []


def test_a_resumed_hello_with_a_huge_plan_table_is_refused(service_thread: ServiceThread) -> None:
    h = hello(job="big-table")
    modes = (Mode.STORE,) * len(h.blocks)
    table = tuple(
        ShapePlan(max_seq_len=i + 1, max_tokens=i + 1, modes=modes, predicted_peak_bytes=1, predicted_overhead_ratio=0)
        for i in range(5_000)
    )
    plan = Plan(
        version=3, blocks=(), checkpoint_every=0, predicted_peak_bytes=1, predicted_overhead_ratio=0.0,
        target_bytes=1, reason="", modes=modes, shape_plans=table,
    )  # fmt: skip
    msg = wire.hello_to_pb(h)
    msg.plan_version = 3
    msg.plan.CopyFrom(wire.plan_to_pb(plan))
    bound = service_thread.service.bound
    assert bound is not None
    _, err = session(bound.grpc, [pb.ClientMessage(hello=msg)])
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.plan.shape_plans" in (err.details() or "")


@pytest.mark.parametrize("name", ["victim\n", "victim\r\n", "\nvictim"])
def test_a_job_name_with_a_line_end_is_refused_everywhere(service_thread: ServiceThread, name: str) -> None:
    bound = service_thread.service.bound
    assert bound is not None
    msg = wire.hello_to_pb(hello(job="victim"))
    msg.job_id = name
    _, err = session(bound.grpc, [pb.ClientMessage(hello=msg)])
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.job_id" in (err.details() or "")
    with pytest.raises(ValueError, match="job must be"):
        check_job(name)


def test_a_flood_of_oom_events_is_rate_limited_and_counted(service_thread: ServiceThread) -> None:
    bound = service_thread.service.bound
    assert bound is not None
    oom = wire.oom_to_pb(OomReport(step=1, shape=Shape(batch=1, seq_len=64, tokens=64), plan_version=1))
    msgs = [pb.ClientMessage(hello=wire.hello_to_pb(hello(job="oom-flood")))]
    msgs += [pb.ClientMessage(oom=oom) for _ in range(300)]
    msgs.append(pb.ClientMessage(goodbye=pb.Goodbye()))
    _, err = session(bound.grpc, msgs)
    assert err is None  # the stream lives on
    core = service_thread.service.core
    core.drain_writes(10)
    recorded = len(core.store.ooms("oom-flood"))
    assert RATE_BURST <= recorded < 300 // 2
    assert core.metrics.oom_dropped._value.get() == 300 - recorded


def test_a_hello_packed_with_size_terms_is_refused_before_conversion(
    service_thread: ServiceThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    converted = _counted(monkeypatch, "hello_from_pb")
    msg = packed_hello()
    assert msg.ByteSize() < 1 << 20
    bound = service_thread.service.bound
    assert bound is not None
    _, err = session(bound.grpc, [msg])
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "size terms" in (err.details() or "")
    assert converted == []
