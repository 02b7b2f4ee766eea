"""Transport-neutral messages: what a training rank tells the service.

The client builds them, the gRPC layer converts them to and from the wire,
and both the embedded planner and the service turn them into planner input
through the same functions, so the two modes plan alike.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import get_type_hints

from rematd.planner import (
    AllocatorFigures,
    BlockCost,
    ControllerConfig,
    Mode,
    ModeCost,
    ModeSeconds,
    Plan,
    PlannerSession,
    Profile,
    Shape,
    Size,
    StepObservation,
)
from rematd.planner.reasons import human_bytes
from rematd.planner.records import quick

# \Z, not $: "$" also matches before a final newline, which would let "victim\n" pass for a name.
JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
MAX_BLOCKS = 4096
MAX_WORLD_SIZE = 1 << 20
"""The most ranks a job may say it trains with: past any job run today, and a bound on what a hello can
make the service count (a world size of 2^32 kept the "fewer ranks connected than the world size" alert on)."""
MAX_IN_FLIGHT = 4096
"""Microbatches alive at once on a pipeline stage, at most."""
MAX_TERMS = 16
MAX_INT = 2**63 - 1
"""The largest integer any field may carry: the store keeps them in signed 64-bit columns."""

MEMORY_CUDA = "cuda_allocator"
MEMORY_SAVED = "saved_tensors"
MEMORY_SOURCES = (MEMORY_CUDA, MEMORY_SAVED)


class InvalidMessage(ValueError):
    """A message from a client that cannot be accepted; names the bad field."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


def _quoted(value: str, limit: int = 64) -> str:
    """``value`` as it is named in an error: cut short, since an error must not carry unbounded input back."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"


def _uint(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
        raise InvalidMessage(name, f"must be an integer in 0-{MAX_INT}, got {value!r}")


def _in_flight(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_IN_FLIGHT:
        raise InvalidMessage(name, f"must be 0-{MAX_IN_FLIGHT} microbatches alive at once, got {value!r}")


def _shape(name: str, shape: Shape) -> None:
    for part in ("batch", "seq_len", "tokens"):
        _uint(f"{name}.{part}", getattr(shape, part))


def _size(name: str, size: Size) -> None:
    if len(size.terms) > MAX_TERMS:
        raise InvalidMessage(name, f"more than {MAX_TERMS} terms")
    for k, term in enumerate(size.terms):
        _uint(f"{name}[{k}].bytes", term.bytes)


def _seconds(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidMessage(name, f"must be a finite, non-negative number, got {value!r}")


def _check_modes(name: str, modes: tuple[ModeCost, ...]) -> None:
    seen = set()
    for j, m in enumerate(modes):
        where = f"{name}[{j}]"
        if not isinstance(m.mode, Mode):
            raise InvalidMessage(f"{where}.mode", f"unknown mode {m.mode!r}")
        if m.mode in seen:
            raise InvalidMessage(f"{where}.mode", f"{m.mode.name} listed twice")
        seen.add(m.mode)
        _seconds(f"{where}.extra_seconds", m.extra_seconds)
        _seconds(f"{where}.fixed_seconds", m.fixed_seconds)
        if m.fixed_seconds > m.extra_seconds:
            raise InvalidMessage(f"{where}.fixed_seconds", f"must not exceed extra_seconds ({m.extra_seconds!r})")
        _size(f"{where}.kept", m.kept)
        _size(f"{where}.transient", m.transient)
        _size(f"{where}.released", m.released)
    if modes and Mode.STORE not in seen:
        raise InvalidMessage(name, "must include MODE_STORE")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockProfile:
    """One block's profile as the client measured it."""

    index: int
    name: str
    saved_bytes: int
    input_bytes: int
    forward_seconds: float
    modes: tuple[ModeCost, ...] = ()
    in_flight: int = 1
    """Microbatches whose activations of this block are alive at once at the peak (a pipeline stage's under
    its schedule); 0 is read as 1."""
    stage: int = 0
    """On a rank that runs several pipeline stages, which of them the block runs in (0: the first)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """The first message of a rank's session."""

    job_id: str
    rank: int = 0
    world_size: int = 1
    device_name: str = "cpu"
    device_total_bytes: int = 0
    model_fingerprint: str = ""
    blocks: tuple[BlockProfile, ...] = ()
    profile_shape: Shape = field(default_factory=Shape)
    budget_bytes: int = 0
    static_bytes: int = 0
    memory_source: str = MEMORY_SAVED
    margin_ratio: float = 0.0
    client_version: str = ""
    plan_version: int = 0
    other_activations: Size = field(default_factory=Size)
    plan: Plan | None = None
    """The plan in force, for reconnects (its version is ``plan_version``)."""
    session_secret: str = field(default="", repr=False)
    """The secret the service issued to this rank's earlier stream, for reconnects ("" on the first)."""
    job_secret: str = field(default="", repr=False)
    """The job's credential: the first hello of a rank binds it, and only it may resume the rank."""
    host: str = ""
    """The host the rank runs on, named to a process refused because another holds the rank."""
    pid: int = 0
    """The rank's process id, likewise."""
    other_in_flight: int = 1
    """Microbatches whose memory outside the blocks (``other_activations``, per microbatch) is alive at once at
    the peak; 0 is read as 1."""

    def validate(self) -> None:
        if not JOB_ID_RE.fullmatch(self.job_id):
            raise InvalidMessage(
                "hello.job_id",
                f"{_quoted(self.job_id)} is not a safe name "
                "(1-128 of letters, digits, '.', '_', '-', starting alphanumeric)",
            )
        _uint("hello.rank", self.rank)
        _uint("hello.world_size", self.world_size)
        _uint("hello.device_total_bytes", self.device_total_bytes)
        _uint("hello.plan_version", self.plan_version)
        _shape("hello.profile_shape", self.profile_shape)
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise InvalidMessage("hello.world_size", f"must be in 1-{MAX_WORLD_SIZE}, got {self.world_size}")
        if self.rank >= self.world_size:
            raise InvalidMessage("hello.rank", f"rank {self.rank} is outside world_size {self.world_size}")
        if not self.blocks:
            raise InvalidMessage("hello.blocks", "the profile has no blocks")
        if len(self.blocks) > MAX_BLOCKS:
            raise InvalidMessage("hello.blocks", f"{len(self.blocks)} blocks is more than {MAX_BLOCKS}")
        for i, b in enumerate(self.blocks):
            if b.index != i:
                raise InvalidMessage(f"hello.blocks[{i}].index", f"expected {i}, got {b.index}")
            _uint(f"hello.blocks[{i}].saved_bytes", b.saved_bytes)
            _uint(f"hello.blocks[{i}].input_bytes", b.input_bytes)
            _seconds(f"hello.blocks[{i}].forward_seconds", b.forward_seconds)
            _in_flight(f"hello.blocks[{i}].in_flight", b.in_flight)
            _in_flight(f"hello.blocks[{i}].stage", b.stage)
            _check_modes(f"hello.blocks[{i}].modes", b.modes)
        _uint("hello.budget_bytes", self.budget_bytes)
        if self.budget_bytes == 0:
            raise InvalidMessage("hello.budget_bytes", "must be positive")
        _uint("hello.static_bytes", self.static_bytes)
        if self.memory_source not in MEMORY_SOURCES:
            raise InvalidMessage(
                "hello.memory_source", f"must be one of {MEMORY_SOURCES}, got {_quoted(self.memory_source)}"
            )
        _size("hello.other_activations", self.other_activations)
        _in_flight("hello.other_in_flight", self.other_in_flight)
        if not (isinstance(self.margin_ratio, (int, float)) and 0.0 <= self.margin_ratio < 1.0):
            raise InvalidMessage("hello.margin_ratio", f"must be in [0, 1), got {self.margin_ratio!r}")
        if self.plan is not None:
            self._check_plan(self.plan)

    def _check_plan(self, plan: Plan) -> None:
        """The plan in force must be one this profile can price: a mode per block, each one the block offers."""
        if plan.version != self.plan_version:
            raise InvalidMessage(
                "hello.plan.version", f"is {plan.version}, but hello.plan_version is {self.plan_version}"
            )
        n = len(self.blocks)
        offered = [{m.mode for m in b.modes} or {Mode.STORE, Mode.RECOMPUTE} for b in self.blocks]

        def check_modes(where: str, modes: tuple[Mode, ...]) -> None:
            if len(modes) != n:
                raise InvalidMessage(where, f"has {len(modes)} modes for {n} blocks")
            for i, mode in enumerate(modes):
                if mode not in offered[i]:
                    raise InvalidMessage(f"{where}[{i}]", f"block {i} does not offer {mode.name}")

        if plan.modes:
            check_modes("hello.plan.block_modes", plan.modes)
        bad = [b for b in plan.blocks if not 0 <= b < n]
        if bad:
            raise InvalidMessage("hello.plan.checkpoint_blocks", f"{bad[0]} is not a block index below {n}")
        for name in ("predicted_peak_bytes", "target_bytes"):
            _uint(f"hello.plan.{name}", getattr(plan, name))
        for k, entry in enumerate(plan.shape_plans):
            where = f"hello.plan.shape_plans[{k}]"
            check_modes(f"{where}.block_modes", entry.modes)
            _uint(f"{where}.max_tokens", entry.max_tokens)
            _uint(f"{where}.predicted_peak_bytes", entry.predicted_peak_bytes)

    def profile(self) -> Profile:
        in_flight = max(1, self.other_in_flight)
        return Profile(
            blocks=tuple(
                BlockCost(
                    saved_bytes=b.saved_bytes,
                    input_bytes=b.input_bytes,
                    forward_seconds=b.forward_seconds,
                    modes=b.modes,
                    in_flight=max(1, b.in_flight),
                    stage=b.stage,
                )
                for b in self.blocks
            ),
            shape=self.profile_shape,
            other=self.other_activations,
            other_in_flight=in_flight,
            # On the CPU the other microbatches' memory outside the blocks is what backward still holds of it.
            other_in_backward=1.0 if self.memory_source == MEMORY_CUDA else (in_flight - 1) / in_flight,
        )


@quick
@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats(AllocatorFigures):
    """What a rank measured over one training step (the allocator's figures are inherited)."""

    step: int
    peak_allocated_bytes: int = 0
    step_seconds: float = 0.0
    plan_version: int = 0
    shape: Shape = field(default_factory=Shape)
    saved_peak_bytes: int = 0
    budget_bytes: int = 0
    static_bytes: int = 0
    steps: int = 1
    """Steps the report covers, ending with ``step``: steady steps folded into one report."""
    mode_seconds: tuple[ModeSeconds, ...] = ()
    """Measured rematerialisation seconds per mode (summed over blocks and steps)."""
    recompiles: int = 0
    """Graphs compiled for the blocks' variants during the steps covered (``attach(..., compile=True)``)."""
    compile_seconds: float = 0.0
    """Seconds those compiles took."""
    modes: tuple[Mode, ...] = ()
    """The mode each block ran in, when not the plan's (a pin, or the plan a sharded job's ranks agreed on)."""
    thread_seconds: float = 0.0
    """Seconds rematd's own code ran on the training thread over the steps covered (its hooks and wrappers; the
    model's and torch's work excluded): what rematd cost the step."""
    routed_bytes: int = 0
    """Bytes a mixture of experts' routing added to the step's peak beyond a balanced router's, by the profile's
    measure (the largest of the steps covered): the planner leaves them out of what the peak teaches it."""

    def validate(self) -> None:
        if len(self.modes) > MAX_BLOCKS:
            raise InvalidMessage("stats.block_modes", f"{len(self.modes)} entries, more than {MAX_BLOCKS} blocks")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 1 <= self.steps <= MAX_INT:
            raise InvalidMessage("stats.steps", f"must be an integer in 1-{MAX_INT}, got {self.steps!r}")
        if len(self.mode_seconds) > len(Mode):
            raise InvalidMessage("stats.mode_seconds", f"{len(self.mode_seconds)} entries for {len(Mode)} modes")
        for k, m in enumerate(self.mode_seconds):
            where = f"stats.mode_seconds[{k}]"
            if not isinstance(m.mode, Mode):
                raise InvalidMessage(f"{where}.mode", f"unknown mode {m.mode!r}")
            _uint(f"{where}.blocks", m.blocks)
            _seconds(f"{where}.seconds", m.seconds)
            _seconds(f"{where}.forward_seconds", m.forward_seconds)
        for name in _STATS_COUNTS:
            _uint(f"stats.{name}", getattr(self, name))
        _shape("stats.shape", self.shape)
        for name in _STATS_SECONDS:
            _seconds(f"stats.{name}", getattr(self, name))
        if self.budget_bytes == 0:
            raise InvalidMessage("stats.budget_bytes", "must be positive")

    def peak_bytes(self, memory_source: str) -> int:
        """The peak of the quantity the budget caps."""
        return self.peak_allocated_bytes if memory_source == MEMORY_CUDA else self.saved_peak_bytes


_STATS_TYPES = get_type_hints(StepStats)
_STATS_COUNTS = tuple(name for name, kind in _STATS_TYPES.items() if kind is int and name != "steps")
"""StepStats' integer fields, each 0 to ``MAX_INT`` (``steps`` is at least 1)."""
_STATS_SECONDS = tuple(name for name, kind in _STATS_TYPES.items() if kind is float)


@quick
@dataclass(frozen=True, slots=True, kw_only=True)
class OomReport:
    """A step that ran out of memory."""

    step: int
    shape: Shape = field(default_factory=Shape)
    plan_version: int = 0
    message: str = ""

    def validate(self) -> None:
        _uint("oom.step", self.step)
        _uint("oom.plan_version", self.plan_version)
        _shape("oom.shape", self.shape)


def open_planner(
    hello: Hello,
    config: ControllerConfig | None = None,
    *,
    first_version: int = 1,
    profile: Profile | None = None,
) -> PlannerSession:
    """The planner for a rank, from its hello (validated first); plan versions start at
    ``first_version``. ``profile``, when given, is ``hello.profile()`` already built (and shared)."""
    hello.validate()
    if hello.margin_ratio and config is None:
        config = ControllerConfig(margin_ratio=hello.margin_ratio)
    return PlannerSession(
        profile or hello.profile(),
        budget_bytes=hello.budget_bytes,
        static_bytes=hello.static_bytes,
        config=config,
        first_version=first_version,
        budget_note=budget_note(hello),
    )


def budget_note(hello: Hello) -> str:
    """Where a rank's budget came from, when nobody gave one: the device's whole memory."""
    if not hello.device_total_bytes or hello.budget_bytes != hello.device_total_bytes:
        return ""
    device = "the GPU's" if hello.memory_source == MEMORY_CUDA else "the host's"
    total = human_bytes(hello.budget_bytes)
    return f"no budget given: the budget is {device} memory, {total}; attach(budget_bytes=) sets one"


def observation(hello: Hello, stats: StepStats) -> StepObservation:
    """Planner input for one step (stats validated first, and held to the rank's profile)."""
    stats.validate()
    if stats.modes and len(stats.modes) != len(hello.blocks):
        raise InvalidMessage(
            "stats.block_modes",
            f"{len(stats.modes)} entries for a profile of {len(hello.blocks)} blocks (give one per block, or none)",
        )
    return StepObservation(
        step=stats.step,
        peak_bytes=stats.peak_bytes(hello.memory_source),
        budget_bytes=stats.budget_bytes,
        static_bytes=stats.static_bytes,
        plan_version=stats.plan_version,
        shape=stats.shape,
        mode_seconds=stats.mode_seconds,
        modes=stats.modes,
        routed_bytes=stats.routed_bytes,
        # A step that compiled a block's variant timed the compile, not the plan.
        step_seconds=0.0 if stats.recompiles else stats.step_seconds,
        **stats.allocator_figures(),
    )
