"""Counts and lengths a message may carry, checked on the message as it arrived, before it is converted.

Converting a message costs time in proportion to its repeated fields, on the event loop for a step
report: a 1 MiB ``StepStats`` holds some 200,000 ``mode_seconds`` entries, and converting them
held every other stream (and ``/healthz``) for most of a second. Each check here reads a length
off the parsed message, so refusing a message costs the same whatever it carries.
"""

from __future__ import annotations

from collections.abc import Sequence

from rematd.planner.messages import JOB_ID_RE, MAX_BLOCKS, MAX_TERMS, InvalidMessage
from rematd.server.transport.http_guard import bounded
from rematd.v1 import advisor_pb2 as pb

MAX_NAME_CHARS = 256
"""Longest name (device, model fingerprint, client version, secret, block name) a hello may carry."""
MAX_MODES = len(pb.Mode.values())
"""Most entries of a list with one entry per mode."""
TERMS_PER_BLOCK = 12 * (MAX_MODES - 1)
"""Size terms a block's modes carry together, at most: each mode a kept, a transient and a released size, each
a term per way its tensors scale (constant, with the batch, the sequence, both, the sequence squared: a block
with masks, attention scores, activations and constants of its own has four or five in one size). Each term is
an object once converted, so a hello packed with them cost 16 times its bytes before it was refused."""
MAX_SHAPE_PLANS = 64
"""Most entries of a plan's per-length table (the planner makes at most 16 by default)."""
MAX_TEXT_CHARS = 4096
"""Longest reason a plan a hello carries may give."""


def _terms(where: str, terms: object) -> None:
    n = len(terms)  # type: ignore[arg-type]
    if n > MAX_TERMS:
        raise InvalidMessage(where, f"{n} terms; a size has at most {MAX_TERMS}")


def precheck_hello(msg: pb.Hello) -> None:
    """What costs nothing to check, before a block is converted or a planner built.

    A hello is converted block by block, then validated, then planned: all work in proportion to
    its size. Counts and lengths are read off the message as it arrived, so one with too many
    blocks (or a name too long to be one) is refused at once, whatever else it carries.
    """
    if len(msg.job_id) > 128 or not JOB_ID_RE.fullmatch(msg.job_id):
        raise InvalidMessage(
            "hello.job_id",
            f"{bounded(repr(msg.job_id), 80)} is not a safe name "
            "(1-128 of letters, digits, '.', '_', '-', starting alphanumeric)",
        )
    n = len(msg.blocks)
    if not 0 < n <= MAX_BLOCKS:
        raise InvalidMessage("hello.blocks", f"{n} blocks; a profile has 1-{MAX_BLOCKS}")
    for name in ("device_name", "model_fingerprint", "client_version", "session_secret", "job_secret", "host"):
        if len(getattr(msg, name)) > MAX_NAME_CHARS:
            raise InvalidMessage(f"hello.{name}", f"longer than {MAX_NAME_CHARS} characters")
    _terms("hello.other_activations", msg.other_activations)
    _precheck_blocks(msg.blocks)
    if msg.HasField("plan"):
        _precheck_plan(msg.plan, n)


def _precheck_blocks(blocks: Sequence[pb.BlockProfile]) -> None:
    terms = 0
    for i, b in enumerate(blocks):
        if len(b.modes) > MAX_MODES:
            raise InvalidMessage(f"hello.blocks[{i}].modes", f"{len(b.modes)} entries for {MAX_MODES} modes")
        if len(b.name) > MAX_NAME_CHARS:
            raise InvalidMessage(f"hello.blocks[{i}].name", f"longer than {MAX_NAME_CHARS} characters")
        for j, m in enumerate(b.modes):
            _terms(f"hello.blocks[{i}].modes[{j}].kept", m.kept)
            _terms(f"hello.blocks[{i}].modes[{j}].transient", m.transient)
            _terms(f"hello.blocks[{i}].modes[{j}].released", m.released)
            terms += len(m.kept) + len(m.transient) + len(m.released)
    if terms > TERMS_PER_BLOCK * len(blocks):
        raise InvalidMessage(
            "hello.blocks",
            f"{terms} size terms for {len(blocks)} blocks; a profile has at most {TERMS_PER_BLOCK} per block",
        )


def _precheck_plan(plan: pb.Plan, n: int) -> None:
    """The plan a reconnecting rank has in force: no more blocks than its profile, bounded text and table."""
    if len(plan.checkpoint_blocks) > n or len(plan.block_modes) > n:
        raise InvalidMessage("hello.plan", f"names more blocks than the profile's {n}")
    if len(plan.shape_plans) > MAX_SHAPE_PLANS:
        raise InvalidMessage("hello.plan.shape_plans", f"{len(plan.shape_plans)} entries; at most {MAX_SHAPE_PLANS}")
    if len(plan.reason) > MAX_TEXT_CHARS:
        raise InvalidMessage("hello.plan.reason", f"longer than {MAX_TEXT_CHARS} characters")
    for k, entry in enumerate(plan.shape_plans):
        if len(entry.block_modes) > n:
            raise InvalidMessage(f"hello.plan.shape_plans[{k}].block_modes", f"names more blocks than {n}")


def precheck_stats(msg: pb.StepStats) -> None:
    """A step report's repeated fields: at most one entry per mode, and one mode per block."""
    if len(msg.mode_seconds) > MAX_MODES:
        raise InvalidMessage("stats.mode_seconds", f"{len(msg.mode_seconds)} entries for {MAX_MODES} modes")
    if len(msg.block_modes) > MAX_BLOCKS:
        raise InvalidMessage("stats.block_modes", f"{len(msg.block_modes)} entries; a profile has 1-{MAX_BLOCKS}")
