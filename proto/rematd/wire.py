"""Conversions between rematd's records and the v1 protobuf messages.

The only module besides the gRPC adapters that touches protobuf, so that
protobuf never leaks into the public API.

Each record is paired with its message in ``WIRE_RECORDS``. Fields that share
a name and are plain scalars on the wire are copied by name, read off the
descriptor, so a new scalar field needs no edit here; messages, enums and
repeated fields are converted below, and fields the two sides name
differently are listed in ``RENAMED``. ``tests/test_wire.py`` holds the
pairs against the descriptors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

from google.protobuf.message import Message

from rematd.planner import Mode, ModeCost, ModeSeconds, Plan, Shape, ShapePlan, Size, Term
from rematd.planner.messages import (
    MAX_BLOCKS,
    MEMORY_CUDA,
    MEMORY_SAVED,
    BlockProfile,
    Hello,
    InvalidMessage,
    OomReport,
    StepStats,
)
from rematd.v1 import advisor_pb2 as pb

WIRE_RECORDS: Mapping[type, type[Message]] = {
    Shape: pb.Shape,
    Term: pb.SizeTerm,
    ModeCost: pb.ModeCost,
    ModeSeconds: pb.ModeSeconds,
    BlockProfile: pb.BlockProfile,
    Hello: pb.Hello,
    StepStats: pb.StepStats,
    OomReport: pb.OomEvent,
    Plan: pb.Plan,
    ShapePlan: pb.ShapePlan,
}
"""Each transport-neutral record and the message it travels as (``Size`` travels as repeated ``SizeTerm``)."""

RENAMED: Mapping[tuple[str, str], tuple[str, str]] = {
    ("Plan", "checkpoint_blocks"): (
        "blocks",
        "the wire says what the blocks do; the store holds them as a set, sorted and deduplicated on the way in",
    ),
    ("Plan", "block_modes"): ("modes", "the wire's name says they are per block; the store's tuple is of Mode"),
    ("ShapePlan", "block_modes"): ("modes", "as Plan.block_modes"),
    ("StepStats", "block_modes"): ("modes", "as Plan.block_modes"),
}
"""(message, wire field): (record field, why the names differ). Every other field has one name on both sides."""


def _copied(record: type, message: type[Message]) -> tuple[str, ...]:
    names = {f.name for f in dataclasses.fields(record)}
    return tuple(
        f.name
        for f in message.DESCRIPTOR.fields
        if f.name in names and not f.is_repeated and f.type not in (f.TYPE_MESSAGE, f.TYPE_ENUM, f.TYPE_GROUP)
    )


COPIED: Mapping[type, tuple[str, ...]] = {record: _copied(record, msg) for record, msg in WIRE_RECORDS.items()}
"""The fields copied by name: scalar on the wire, the same name in the store."""


def _copy(record: type, source: object) -> dict[str, Any]:
    return {name: getattr(source, name) for name in COPIED[record]}


_SOURCE_TO_PB = {
    MEMORY_CUDA: pb.MEMORY_SOURCE_CUDA_ALLOCATOR,
    MEMORY_SAVED: pb.MEMORY_SOURCE_SAVED_TENSORS,
}
_SOURCE_FROM_PB = {v: k for k, v in _SOURCE_TO_PB.items()}


def shape_to_pb(shape: Shape) -> pb.Shape:
    return pb.Shape(**_copy(Shape, shape))


def shape_from_pb(msg: pb.Shape) -> Shape:
    return Shape(**_copy(Shape, msg))


def _size_to_pb(size: Size) -> list[pb.SizeTerm]:
    return [pb.SizeTerm(**_copy(Term, t)) for t in size.terms]


def _size_from_pb(field: str, terms: Sequence[pb.SizeTerm]) -> Size:
    try:
        return Size(tuple(Term(**_copy(Term, t)) for t in terms))
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
            released=_size_to_pb(m.released),
            **_copy(ModeCost, m),
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
                    released=_size_from_pb(f"{where}.released", m.released),
                    **_copy(ModeCost, m),
                )
            )
        except ValueError as err:
            if isinstance(err, InvalidMessage):
                raise
            raise InvalidMessage(where, str(err)) from err
    return tuple(out)


def hello_to_pb(hello: Hello) -> pb.Hello:
    return pb.Hello(
        blocks=[pb.BlockProfile(modes=_modes_to_pb(b.modes), **_copy(BlockProfile, b)) for b in hello.blocks],
        profile_shape=shape_to_pb(hello.profile_shape),
        memory_source=_SOURCE_TO_PB[hello.memory_source],
        other_activations=_size_to_pb(hello.other_activations),
        plan=plan_to_pb(hello.plan) if hello.plan is not None else None,
        **_copy(Hello, hello),
    )


def hello_from_pb(msg: pb.Hello) -> Hello:
    return Hello(
        blocks=tuple(
            BlockProfile(modes=_modes_from_pb(f"hello.blocks[{i}].modes", b.modes), **_copy(BlockProfile, b))
            for i, b in enumerate(msg.blocks)
        ),
        profile_shape=shape_from_pb(msg.profile_shape),
        memory_source=_SOURCE_FROM_PB.get(msg.memory_source, "unspecified"),
        other_activations=_size_from_pb("hello.other_activations", msg.other_activations),
        plan=plan_from_pb(msg.plan, "hello.plan") if msg.HasField("plan") else None,
        **_copy(Hello, msg),
    )


def stats_to_pb(stats: StepStats) -> pb.StepStats:
    return pb.StepStats(
        shape=shape_to_pb(stats.shape),
        mode_seconds=[pb.ModeSeconds(mode=cast(Any, int(m.mode)), **_copy(ModeSeconds, m)) for m in stats.mode_seconds],
        block_modes=_block_modes(stats.modes),
        **_copy(StepStats, stats),
    )


def stats_from_pb(msg: pb.StepStats) -> StepStats:
    values = _copy(StepStats, msg)
    values["steps"] = msg.steps or 1  # a client that does not fold leaves it unset
    return StepStats(
        shape=shape_from_pb(msg.shape),
        mode_seconds=tuple(_mode_seconds_from_pb(k, m) for k, m in enumerate(msg.mode_seconds)),
        modes=_stats_modes(msg),
        **values,
    )


def _stats_modes(msg: pb.StepStats) -> tuple[Mode, ...]:
    # Counted before any is converted: a report may not make the service convert more than a model's blocks.
    if len(msg.block_modes) > MAX_BLOCKS:
        raise InvalidMessage("stats.block_modes", f"{len(msg.block_modes)} entries, more than {MAX_BLOCKS} blocks")
    return tuple(_mode_from_pb("stats.block_modes", m) for m in msg.block_modes)


def _mode_seconds_from_pb(k: int, m: pb.ModeSeconds) -> ModeSeconds:
    where = f"stats.mode_seconds[{k}]"
    try:
        return ModeSeconds(mode=_mode_from_pb(f"{where}.mode", m.mode), **_copy(ModeSeconds, m))
    except ValueError as err:
        if isinstance(err, InvalidMessage):
            raise
        field = "forward_seconds" if "forward_seconds" in str(err) else "seconds"
        raise InvalidMessage(f"{where}.{field}", str(err)) from err


def oom_to_pb(oom: OomReport) -> pb.OomEvent:
    return pb.OomEvent(shape=shape_to_pb(oom.shape), **_copy(OomReport, oom))


def oom_from_pb(msg: pb.OomEvent) -> OomReport:
    return OomReport(shape=shape_from_pb(msg.shape), **_copy(OomReport, msg))


def _block_modes(modes: tuple[Mode, ...]) -> Any:
    return [int(m) for m in modes]


def plan_to_pb(plan: Plan) -> pb.Plan:
    return pb.Plan(
        checkpoint_blocks=list(plan.blocks),
        block_modes=_block_modes(plan.modes),
        shape_plans=[pb.ShapePlan(block_modes=_block_modes(e.modes), **_copy(ShapePlan, e)) for e in plan.shape_plans],
        **_copy(Plan, plan),
    )


def plan_from_pb(msg: pb.Plan, where: str = "plan") -> Plan:
    return Plan(
        blocks=tuple(sorted(set(msg.checkpoint_blocks))),
        modes=tuple(_mode_from_pb(f"{where}.block_modes", m) for m in msg.block_modes),
        shape_plans=tuple(
            ShapePlan(
                modes=tuple(_mode_from_pb(f"{where}.shape_plans.block_modes", m) for m in e.block_modes),
                **_copy(ShapePlan, e),
            )
            for e in msg.shape_plans
        ),
        **_copy(Plan, msg),
    )
