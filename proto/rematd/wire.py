"""Conversions between rematd's records and the v1 protobuf messages.

The only module besides the gRPC adapters that touches protobuf, so that
protobuf never leaks into the public API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from rematd.planner import Mode, ModeCost, ModeSeconds, Plan, Shape, ShapePlan, Size, Term
from rematd.records import MEMORY_CUDA, MEMORY_SAVED, BlockRecord, Hello, InvalidMessage, OomReport, StepStats
from rematd.v1 import advisor_pb2 as pb

_SOURCE_TO_PB = {
    MEMORY_CUDA: pb.MEMORY_SOURCE_CUDA_ALLOCATOR,
    MEMORY_SAVED: pb.MEMORY_SOURCE_SAVED_TENSORS,
}
_SOURCE_FROM_PB = {v: k for k, v in _SOURCE_TO_PB.items()}

_STATS_FIELDS = (
    "step",
    "recompiles",
    "compile_seconds",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "alloc_retries",
    "oom_count",
    "free_bytes",
    "total_bytes",
    "step_seconds",
    "plan_version",
    "saved_peak_bytes",
    "budget_bytes",
    "static_bytes",
    "inactive_split_bytes",
    "steps",
)


def shape_to_pb(shape: Shape) -> pb.Shape:
    return pb.Shape(batch=shape.batch, seq_len=shape.seq_len, tokens=shape.tokens)


def shape_from_pb(msg: pb.Shape) -> Shape:
    return Shape(batch=msg.batch, seq_len=msg.seq_len, tokens=msg.tokens)


def _size_to_pb(size: Size) -> list[pb.SizeTerm]:
    return [pb.SizeTerm(bytes=t.bytes, batch_exp=t.batch_exp, seq_exp=t.seq_exp) for t in size.terms]


def _size_from_pb(field: str, terms: Sequence[pb.SizeTerm]) -> Size:
    try:
        return Size(tuple(Term(t.bytes, t.batch_exp, t.seq_exp) for t in terms))
    except ValueError as err:
        raise InvalidMessage(field, str(err)) from err


def _mode_from_pb(field: str, value: int) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        raise InvalidMessage(field, f"unknown mode {value}") from None


def _modes_to_pb(modes: tuple[ModeCost, ...]) -> list[pb.ModeCost]:
    return [
        pb.ModeCost(
            mode=cast(Any, int(m.mode)),
            kept=_size_to_pb(m.kept),
            transient=_size_to_pb(m.transient),
            extra_seconds=m.extra_seconds,
        )
        for m in modes
    ]


def _modes_from_pb(field: str, modes: Sequence[pb.ModeCost]) -> tuple[ModeCost, ...]:
    out = []
    for j, m in enumerate(modes):
        where = f"{field}[{j}]"
        try:
            out.append(
                ModeCost(
                    mode=_mode_from_pb(f"{where}.mode", m.mode),
                    kept=_size_from_pb(f"{where}.kept", m.kept),
                    transient=_size_from_pb(f"{where}.transient", m.transient),
                    extra_seconds=m.extra_seconds,
                )
            )
        except ValueError as err:
            if isinstance(err, InvalidMessage):
                raise
            raise InvalidMessage(where, str(err)) from err
    return tuple(out)


def hello_to_pb(hello: Hello) -> pb.Hello:
    return pb.Hello(
        job_id=hello.job_id,
        rank=hello.rank,
        world_size=hello.world_size,
        device_name=hello.device_name,
        device_total_bytes=hello.device_total_bytes,
        model_fingerprint=hello.model_fingerprint,
        blocks=[
            pb.BlockProfile(
                index=b.index,
                name=b.name,
                saved_bytes=b.saved_bytes,
                input_bytes=b.input_bytes,
                forward_seconds=b.forward_seconds,
                modes=_modes_to_pb(b.modes),
            )
            for b in hello.blocks
        ],
        profile_shape=shape_to_pb(hello.profile_shape),
        budget_bytes=hello.budget_bytes,
        static_bytes=hello.static_bytes,
        memory_source=_SOURCE_TO_PB[hello.memory_source],
        margin_ratio=hello.margin_ratio,
        client_version=hello.client_version,
        plan_version=hello.plan_version,
        other_activations=_size_to_pb(hello.other_activations),
        plan=plan_to_pb(hello.plan) if hello.plan is not None else None,
        session_secret=hello.session_secret,
    )


def hello_from_pb(msg: pb.Hello) -> Hello:
    return Hello(
        job_id=msg.job_id,
        rank=msg.rank,
        world_size=msg.world_size,
        device_name=msg.device_name,
        device_total_bytes=msg.device_total_bytes,
        model_fingerprint=msg.model_fingerprint,
        blocks=tuple(
            BlockRecord(
                index=b.index,
                name=b.name,
                saved_bytes=b.saved_bytes,
                input_bytes=b.input_bytes,
                forward_seconds=b.forward_seconds,
                modes=_modes_from_pb(f"hello.blocks[{i}].modes", b.modes),
            )
            for i, b in enumerate(msg.blocks)
        ),
        profile_shape=shape_from_pb(msg.profile_shape),
        budget_bytes=msg.budget_bytes,
        static_bytes=msg.static_bytes,
        memory_source=_SOURCE_FROM_PB.get(msg.memory_source, "unspecified"),
        margin_ratio=msg.margin_ratio,
        client_version=msg.client_version,
        plan_version=msg.plan_version,
        other_activations=_size_from_pb("hello.other_activations", msg.other_activations),
        plan=plan_from_pb(msg.plan, "hello.plan") if msg.HasField("plan") else None,
        session_secret=msg.session_secret,
    )


def stats_to_pb(stats: StepStats) -> pb.StepStats:
    msg = pb.StepStats(shape=shape_to_pb(stats.shape))
    for name in _STATS_FIELDS:
        setattr(msg, name, getattr(stats, name))
    for m in stats.mode_seconds:
        msg.mode_seconds.add(
            mode=cast(Any, int(m.mode)), blocks=m.blocks, seconds=m.seconds, forward_seconds=m.forward_seconds
        )
    return msg


def stats_from_pb(msg: pb.StepStats) -> StepStats:
    values: dict[str, Any] = {name: getattr(msg, name) for name in _STATS_FIELDS}
    values["steps"] = msg.steps or 1  # a client that does not fold leaves it unset
    values["mode_seconds"] = tuple(_mode_seconds_from_pb(k, m) for k, m in enumerate(msg.mode_seconds))
    return StepStats(shape=shape_from_pb(msg.shape), **values)


def _mode_seconds_from_pb(k: int, m: pb.ModeSeconds) -> ModeSeconds:
    where = f"stats.mode_seconds[{k}]"
    try:
        return ModeSeconds(_mode_from_pb(f"{where}.mode", m.mode), m.blocks, m.seconds, m.forward_seconds)
    except ValueError as err:
        if isinstance(err, InvalidMessage):
            raise
        field = "forward_seconds" if "forward_seconds" in str(err) else "seconds"
        raise InvalidMessage(f"{where}.{field}", str(err)) from err


def oom_to_pb(oom: OomReport) -> pb.OomEvent:
    return pb.OomEvent(step=oom.step, shape=shape_to_pb(oom.shape), plan_version=oom.plan_version, message=oom.message)


def oom_from_pb(msg: pb.OomEvent) -> OomReport:
    return OomReport(step=msg.step, shape=shape_from_pb(msg.shape), plan_version=msg.plan_version, message=msg.message)


def plan_to_pb(plan: Plan) -> pb.Plan:
    return pb.Plan(
        version=plan.version,
        checkpoint_every=plan.checkpoint_every,
        checkpoint_blocks=list(plan.blocks),
        predicted_peak_bytes=plan.predicted_peak_bytes,
        predicted_overhead_ratio=plan.predicted_overhead_ratio,
        reason=plan.reason,
        target_bytes=plan.target_bytes,
        block_modes=cast(Any, [int(m) for m in plan.modes]),
        shape_plans=[
            pb.ShapePlan(
                max_seq_len=e.max_seq_len,
                max_tokens=e.max_tokens,
                block_modes=cast(Any, [int(m) for m in e.modes]),
                predicted_peak_bytes=e.predicted_peak_bytes,
                predicted_overhead_ratio=e.predicted_overhead_ratio,
            )
            for e in plan.shape_plans
        ],
    )


def plan_from_pb(msg: pb.Plan, where: str = "plan") -> Plan:
    return Plan(
        version=msg.version,
        blocks=tuple(sorted(set(msg.checkpoint_blocks))),
        checkpoint_every=msg.checkpoint_every,
        predicted_peak_bytes=msg.predicted_peak_bytes,
        predicted_overhead_ratio=msg.predicted_overhead_ratio,
        target_bytes=msg.target_bytes,
        reason=msg.reason,
        modes=tuple(_mode_from_pb(f"{where}.block_modes", m) for m in msg.block_modes),
        shape_plans=tuple(
            ShapePlan(
                max_seq_len=e.max_seq_len,
                max_tokens=e.max_tokens,
                modes=tuple(_mode_from_pb(f"{where}.shape_plans.block_modes", m) for m in e.block_modes),
                predicted_peak_bytes=e.predicted_peak_bytes,
                predicted_overhead_ratio=e.predicted_overhead_ratio,
            )
            for e in msg.shape_plans
        ),
    )
