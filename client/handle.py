"""``attach(model)``: the handle a training loop holds."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from rematd import __version__
from rematd.client.accounting import SavedTensorAccounting, tensors_in
from rematd.client.applier import PlanApplier
from rematd.client.arguments import (
    check_bytes,
    check_compile,
    check_flag,
    check_job,
    check_margin,
    check_optimizer,
    check_server,
    mode_sequence,
    parse_modes,
)
from rematd.client.backends import Backend, EmbeddedBackend
from rematd.client.buffers import protect_running_stats
from rematd.client.caches import train_without_cache
from rematd.client.compiled import CompiledBlocks, CompileStats
from rematd.client.connection import StreamConfig
from rematd.client.describe import block_records, dist_rank, model_fingerprint, shape_of
from rematd.client.discovery import find_blocks
from rematd.client.guard import Guard, free_after_oom, is_oom
from rematd.client.hooks import AttachedHook
from rematd.client.memory import CudaMemory, MemorySample, SavedTensorMemory, outside_blocks
from rematd.client.offload import Offloader
from rematd.client.profiling import host_bandwidth
from rematd.client.recompute_timing import RecomputeTimer
from rematd.client.stream import StreamBackend
from rematd.client.switch import SwitchableBlock
from rematd.client.unwrap import unwrap
from rematd.planner import Mode, Plan, Shape, Size
from rematd.records import Hello, OomReport, StepStats

log = logging.getLogger("rematd.client")

T = TypeVar("T")


class Handle:
    """rematd attached to one model. Create it with :func:`attach`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        server: str | None,
        job: str | None,
        budget_bytes: int | None,
        blocks: Sequence[nn.Module] | None,
        optimizer: torch.optim.Optimizer | None,
        margin_ratio: float,
        modes: Sequence[str | Mode] | None = None,
        stream: StreamConfig | None = None,
        hard_limit_bytes: int | None = None,
        compile: bool | str = False,
    ) -> None:
        # Every argument is checked before anything is hooked: a bad one leaves the model untouched.
        server = check_server(server)
        self._job_given = check_job(job) is not None
        self._budget_bytes = check_bytes("budget_bytes", budget_bytes)
        self.margin_ratio = check_margin(margin_ratio)
        self._modes = parse_modes(modes)
        hard_limit = check_bytes("hard_limit_bytes", hard_limit_bytes)
        optimizer = check_optimizer(optimizer)
        backend = check_compile(compile)
        model = unwrap(model)
        self.model = model
        self._optimizer = optimizer
        self.job = job or f"job-{uuid.uuid4().hex[:8]}"
        self._ranks: tuple[int, int] | None = None
        found = find_blocks(model, blocks)
        self._fingerprint = model_fingerprint(found)
        self._accounting = SavedTensorAccounting()
        self._accounting.hard_limit_bytes = hard_limit
        self._blocks = [SwitchableBlock(i, name, m, self._accounting) for i, (name, m) in enumerate(found)]
        self._recompute_timer = RecomputeTimer()
        self._offloader = Offloader(self._recompute_timer)
        for b in self._blocks:
            b.timer = self._recompute_timer
            b.offloader = self._offloader
        self._compiled = CompiledBlocks(backend) if backend is not None else None
        self._attach_compiled()
        self._norm_hooks = protect_running_stats([m for _, m in found])
        self._cache_hooks = train_without_cache(model)
        self._applier = PlanApplier(self._blocks)
        self.last_stats: StepStats | None = None
        self._step = 0
        self._boundary = True
        self._forward_seen = False
        self._profiled = False
        self._step_started: float | None = None
        self._shape = Shape()
        self._static = 0
        self._fresh_grad_bytes = 0
        """Bytes of the gradients the profiling step creates (those of parameters without one at its start)."""
        self._memory: CudaMemory | SavedTensorMemory | None = None
        self._closed = False
        self._errors = 0
        self._safe = False
        self._safe_retry = False
        self._oom_streak = 0
        self._unsent_oom: OomReport | None = None
        self.oom_count = 0
        """Out-of-memory errors the handle recovered from (or re-raised)."""
        self.last_memory: MemorySample | None = None
        """The memory figures of the last step, including those the wire does not carry."""
        self._backend: Backend = (
            StreamBackend(server, self._applier.receive, stream) if server else EmbeddedBackend(self._applier.receive)
        )
        self.server = server
        self._hooks = [
            model.register_forward_pre_hook(AttachedHook(self._pre_forward), with_kwargs=True),
            model.register_forward_hook(AttachedHook(self._post_forward), always_call=True),
        ]
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_post_hook(AttachedHook(self._optimizer_stepped)))

    def _attach_compiled(self) -> None:
        if self._compiled is None:
            return
        for b in self._blocks:
            if CompiledBlocks.supports(b):
                b.compiled = self._compiled
            else:
                log.warning("rematd: block %r has a forward set on the instance; it runs eagerly", b.name)

    # -- public -----------------------------------------------------------

    @property
    def compile_stats(self) -> CompileStats | None:
        """Graphs compiled for the blocks' variants and their seconds (None without ``compile=``)."""
        return self._compiled.stats() if self._compiled is not None else None

    @property
    def plan(self) -> Plan:
        """The plan in force: version, checkpointed block indices, frequency."""
        return self._applier.plan

    @property
    def history(self) -> list[Plan]:
        """Every plan applied, in order."""
        return self._applier.history

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The mode of each block in force for the current (or last) step."""
        return tuple(b.mode for b in self._blocks)

    @property
    def last_shape(self) -> Shape:
        """The shape signature of the current (or last) step's input."""
        return self._shape

    @property
    def blocks(self) -> list[str]:
        """Qualified names of the checkpointable blocks, in order."""
        return [b.name for b in self._blocks]

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def budget_bytes(self) -> int | None:
        return self._budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        budget = check_bytes("budget_bytes", value, optional=False)
        assert budget is not None
        self._budget_bytes = budget
        # A reconnect re-sends the hello: it must carry this budget, not the first one.
        self._backend.update_hello(budget_bytes=budget)

    @property
    def rank(self) -> int:
        """This process's rank in the default process group, as sent to the planner (read at the first step's end)."""
        return (self._ranks or dist_rank())[0]

    @property
    def world_size(self) -> int:
        """The default process group's size, as sent to the planner (read at the first step's end)."""
        return (self._ranks or dist_rank())[1]

    def pin_modes(self, modes: Sequence[str | Mode] | None) -> None:
        """Fix every block's mode from the next step on, whatever the planner says (None: follow it again).

        ``modes`` has one entry per block: a mode name (``"store"``, ``"selective"``,
        ``"recompute"``, ``"offload"``) or a :class:`rematd.planner.Mode`.
        """
        if modes is None:
            self._applier.pinned = None
            self._applier.invalidate()
            return
        pinned = mode_sequence("pin_modes", modes)
        if len(pinned) != len(self._blocks):
            raise ValueError(f"pin_modes needs {len(self._blocks)} modes, one per block, got {len(pinned)}")
        self._applier.pinned = tuple(pinned)
        self._applier.invalidate()

    @property
    def hard_limit_bytes(self) -> int | None:
        """On the CPU, the bytes saved for backward a step may not cross (``None``: no limit)."""
        return self._accounting.hard_limit_bytes

    @hard_limit_bytes.setter
    def hard_limit_bytes(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or int(value) <= 0):
            raise ValueError(f"hard_limit_bytes must be a positive number of bytes or None, got {value!r}")
        self._accounting.hard_limit_bytes = None if value is None else int(value)

    def step(self) -> None:
        """Mark the end of a training step (after ``optimizer.step()``). Never raises."""
        if self._closed or not self._forward_seen:
            return
        try:
            self._end_step()
        except Exception:
            self._errors += 1
            log.exception("rematd: step bookkeeping failed; training goes on with the plan in force")
        finally:
            self._forward_seen = False
            self._boundary = True

    @property
    def safe_mode(self) -> bool:
        """True while every block recomputes after an out-of-memory error, until the planner's next plan."""
        return self._safe

    @property
    def stream(self) -> StreamBackend | None:
        """The stream to the service (its counters: ``connected``, ``dropped``, ``reconnects``), if any."""
        return self._backend if isinstance(self._backend, StreamBackend) else None

    def run_step(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one training step, ``fn(*args, **kwargs)``, recovering from an out-of-memory error once.

        On an out-of-memory error the step's graph and gradients are freed,
        the error is reported to the planner (with the step's shape), every
        block recomputes from then on until the planner's next plan, and
        ``fn`` runs again. A second error in a row is raised.
        """
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            if not is_oom(exc):
                raise
            self._recover(exc)
        else:
            self._oom_streak = 0
            return result
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            if is_oom(exc):
                self._recover(exc)
            raise
        self._oom_streak = 0
        return result

    def guard(self) -> Guard:
        """``with h.guard() as g:`` around a step: an out-of-memory error inside is recovered from.

        The first error is suppressed (``g.oom`` is then True: retry or skip
        the batch); another one in the next guarded block is raised. Locals of
        the caller's frame (a ``loss``) keep their graph alive: put the step in
        a function, or use :meth:`run_step`, to free it all.
        """
        return Guard(self)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the planner has answered every step so far (for tests and shutdown).

        False when some step is still unanswered after ``timeout``, or will never be: the
        service refused the stream, or the handle was closed first.
        """
        return self._backend.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """End the session, remove hooks and restore the blocks' own forward."""
        if self._closed:
            return
        self._closed = True
        for h in (*self._hooks, *self._norm_hooks, *self._cache_hooks):
            h.remove()
        for b in self._blocks:
            b.restore()
        try:
            self._backend.close(timeout)
        except Exception:
            log.exception("rematd: closing the session failed")

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hooks --------------------------------------------------------------

    def _optimizer_stepped(self, *_: object) -> None:
        self.step()

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._closed or not torch.is_grad_enabled():
            return
        try:
            if self._boundary:
                self._begin_step(args, kwargs)
            if self._accounting_on():
                self._hooks_cm = self._accounting.hooks()
                self._hooks_cm.__enter__()
                self._accounting.active = True
        except Exception:
            self._errors += 1
            log.exception("rematd: pre-forward bookkeeping failed")

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._accounting.active:
            self._accounting.active = False
            self._hooks_cm.__exit__(None, None, None)

    def _accounting_on(self) -> bool:
        return isinstance(self._memory, SavedTensorMemory)

    def _begin_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._boundary = False
        self._forward_seen = True
        if self._memory is None:
            self._memory = self._memory_source(args, kwargs)
            self._accounting.exclude_module_state(self.model)
            self._offer_modes()
        self._shape = shape_of(args, kwargs)
        if self._safe_retry:
            self._safe_retry = False  # the retry runs with every block recomputed, whatever is pending
        elif not self._profiled:
            if not self._safe:
                for b in self._blocks:
                    b.profiling = True
                    b.profile_shape = self._shape
                self._fresh_grad_bytes = sum(
                    p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad and p.grad is None
                )
        elif (not self._safe or self._applier.has_pending()) and self._applier.apply_pending(self._shape):
            # In safe mode every block recomputes until the planner answers with a new plan.
            self._safe = False
        if self._blocks[0].step_shape != self._shape:
            for b in self._blocks:
                b.step_shape = self._shape
        self._static = self._memory.static_bytes()
        self._step_started = time.perf_counter()

    def _offer_modes(self) -> None:
        """Offload needs a host link worth using: offered on CUDA only, with its measured bandwidth."""
        offer = set(self._modes)
        bandwidth = None
        if isinstance(self._memory, CudaMemory) and Mode.OFFLOAD in offer:
            try:
                bandwidth = host_bandwidth(self._memory.device)
            except Exception as err:
                # Without a measured link offload cannot be priced; the other modes still can.
                log.warning("rematd: measuring the host link failed (%s); offload is not offered", err)
        if not bandwidth:
            offer.discard(Mode.OFFLOAD)
        for b in self._blocks:
            b.offer = frozenset(offer)
            b.host_bandwidth = bandwidth

    def _memory_source(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CudaMemory | SavedTensorMemory:
        for t in tensors_in([args, kwargs]):
            if t.is_cuda:
                return CudaMemory(t.device)
        for p in self.model.parameters():
            if p.is_cuda:
                return CudaMemory(p.device)
            break
        return SavedTensorMemory(self._accounting)

    def _default_budget(self, sample: MemorySample) -> int:
        assert self._memory is not None
        return max(1, int(sample.total_bytes or self._memory.total_bytes or 2**40))

    def _end_step(self) -> None:
        assert self._memory is not None
        sample = self._memory.sample()
        self.last_memory = sample
        if self._budget_bytes is None:
            self._budget_bytes = self._default_budget(sample)
        elapsed = time.perf_counter() - self._step_started if self._step_started else 0.0
        recompiles, compile_seconds = self._compiled.take() if self._compiled is not None else (0, 0.0)
        self._offloader.end_step()
        if recompiles:
            # The forwards that compiled were timed with their compile: seconds, not what the mode costs.
            self._recompute_timer.forget()
        if not self._profiled and self._profile_complete():
            self._profiled = True
            self._backend.open(self._hello(sample))
            if self._unsent_oom is not None:
                self._backend.send_oom(self._unsent_oom)
                self._unsent_oom = None
        stats = StepStats(
            step=self._step,
            peak_allocated_bytes=sample.peak_allocated_bytes,
            peak_reserved_bytes=sample.peak_reserved_bytes,
            allocated_bytes=sample.allocated_bytes,
            reserved_bytes=sample.reserved_bytes,
            alloc_retries=sample.alloc_retries,
            oom_count=sample.oom_count,
            free_bytes=sample.free_bytes,
            total_bytes=sample.total_bytes,
            step_seconds=elapsed,
            plan_version=self._applier.plan.version,
            shape=self._shape,
            saved_peak_bytes=sample.saved_peak_bytes,
            budget_bytes=self._budget_bytes,
            static_bytes=self._static,
            inactive_split_bytes=sample.inactive_split_bytes,
            mode_seconds=self._recompute_timer.take(),
            recompiles=recompiles,
            compile_seconds=compile_seconds,
        )
        self.last_stats = stats
        self._step += 1
        self._backend.send_stats(stats)

    def _hello(self, sample: MemorySample) -> Hello:
        assert self._memory is not None and self._budget_bytes is not None
        # Read now, not at attach: the process group is often set up after the model is attached.
        rank, world_size = self._ranks = dist_rank()
        if world_size > 1 and not self._job_given:
            log.warning(
                "rematd: rank %d of %d was attached without job=, so it streams as job %r and every rank "
                "appears as a separate job; pass the same job= on every rank",
                rank,
                world_size,
                self.job,
            )
        records = block_records(self._blocks)
        for b in self._blocks:
            b.profiling = False
        return Hello(
            job_id=self.job,
            rank=rank,
            world_size=world_size,
            device_name=self._memory.name,
            device_total_bytes=self._memory.total_bytes,
            model_fingerprint=self._fingerprint,
            blocks=records,
            profile_shape=self._shape,
            budget_bytes=self._budget_bytes,
            static_bytes=self._static,
            memory_source=self._memory.kind,
            margin_ratio=self.margin_ratio,
            client_version=__version__,
            other_activations=self._other_activations(sample, sum(r.saved_bytes for r in records)),
        )

    def _other_activations(self, sample: MemorySample, blocks_bytes: int) -> Size:
        """Memory at the peak outside static memory and the blocks, from the profiling step (every block
        stored). On the CPU, bytes the rest of the model saves. On CUDA, what the allocator's peak holds
        beyond that: logits, the loss's upcast, gradients as they accumulate, optimizer temporaries,
        allocator rounding. Gradients of parameters that had none at the step's start do not grow with
        the input; what the step created and kept (optimizer state) is later steps' static memory; the
        rest is taken to grow with tokens (:func:`rematd.client.memory.outside_blocks`)."""
        if not isinstance(self._memory, CudaMemory):
            return Size.linear(max(0, sample.saved_peak_bytes - blocks_bytes))
        return outside_blocks(
            peak=sample.peak_allocated_bytes,
            static=self._static,
            blocks=blocks_bytes,
            allocated_after=sample.allocated_bytes,
            fresh_grads=self._fresh_grad_bytes,
        )

    def report_oom(self, message: str = "") -> None:
        """Tell the planner the last step ran out of memory; a tighter plan follows."""
        oom = OomReport(step=self._step, shape=self._shape, plan_version=self._applier.plan.version, message=message)
        if self._profiled:
            self._backend.send_oom(oom)
        else:
            self._unsent_oom = oom  # no planner yet: it hears of it with the profile

    def _profile_complete(self) -> bool:
        """Whether every block has a profile; after an error in the profiling step, borrow the largest."""
        measured = [b.measure for b in self._blocks if b.measure is not None]
        if len(measured) == len(self._blocks):
            return True
        if not measured:
            return False  # nothing to plan from: every block keeps recomputing
        largest = max(measured, key=lambda m: m.saved_bytes)
        for b in self._blocks:
            if b.measure is None:
                b.measure = dataclasses.replace(largest)
        return True

    def _recover(self, exc: BaseException) -> None:
        """After an out-of-memory error: free, report, recompute every block, let the step run again."""
        self.oom_count += 1
        self._oom_streak += 1
        message = f"{type(exc).__name__}: {str(exc)[:500]}"
        log.warning("rematd: out of memory at step %d (%s); every block recomputes now", self._step, message)
        try:
            free_after_oom(exc, self.model, self._optimizer, cuda=isinstance(self._memory, CudaMemory))
            if self._accounting.active:
                self._accounting.active = False
                self._hooks_cm.__exit__(None, None, None)
            # Nothing the failed step saved is needed any more, and its timings are of a step that did not finish.
            self._accounting.forget()
            self._recompute_timer.forget()
            self._offloader.forget()
            self.report_oom(message)
            for b in self._blocks:
                b.profiling = False
                b.checkpointed = True
            self._applier.invalidate()
            self._safe = True
            self._safe_retry = True
            self._forward_seen = False
            self._boundary = True
            if isinstance(self._memory, CudaMemory):
                self._memory.sample()  # the failed step's peaks are not the retry's
            else:
                self._accounting.take_peak()
        except Exception:
            self._errors += 1
            log.exception("rematd: recovering from out of memory failed")


def attach(
    model: nn.Module,
    *,
    server: str | None = None,
    job: str | None = None,
    budget_bytes: int | None = None,
    blocks: Sequence[nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    margin_ratio: float = 0.1,
    modes: Sequence[str | Mode] | None = None,
    token: str | None = None,
    tls: bool = False,
    root_certificates: str | os.PathLike[str] | bytes | None = None,
    fallback_after_s: float | None = 60.0,
    hard_limit_bytes: int | None = None,
    compile: bool | str = False,
) -> Handle:
    """Attach rematd to ``model`` and return the handle that applies its plans.

    Every argument is checked here: a bad one raises ``TypeError`` or
    ``ValueError`` naming it, before the model is touched.

    Args:
        model: the model being trained.
        server: ``"host:port"`` (or ``"[v6addr]:port"``, or a gRPC target
            such as ``"dns:///host:port"``) of a rematd service; ``None``
            plans in-process.
        job: the job's name on the service: 1-128 letters, digits, ``.``,
            ``_`` or ``-``, starting with a letter or digit (default: a
            random one; under ``torch.distributed`` pass the same on every rank).
        budget_bytes: the memory budget. On CUDA, the device memory the job
            may use (default: the device's capacity); on the CPU, the cap on
            bytes saved for backward during a step (default: host memory).
        blocks: the modules to checkpoint (default: the longest
            ``nn.ModuleList`` of same-class modules).
        optimizer: when given, the handle's :meth:`Handle.step` runs after
            each ``optimizer.step()`` by itself.
        margin_ratio: the fraction of the budget the planner keeps free, in [0, 1).
        modes: the ways a block may keep activations (names, or
            :class:`rematd.planner.Mode` values), from ``"store"``,
            ``"selective"`` (keep matmul and attention outputs, recompute
            pointwise ops), ``"recompute"`` (keep only the block's input) and
            ``"offload"`` (saved activations to host memory; CUDA only).
            Default: store, selective and recompute; offload only when named
            (on a GPU it has measured slower than recomputing the same blocks).
        token: bearer token for the service (default: ``$REMATD_TOKEN``),
            sent as ``authorization: Bearer <token>`` metadata.
        tls: connect with TLS (implied by ``root_certificates``).
        root_certificates: PEM roots (a path or the bytes) that sign the
            service's certificate; default: the system's.
        fallback_after_s: seconds without the service after which plans are
            made in-process until it returns; ``None`` keeps the plan in force.
        hard_limit_bytes: on the CPU, a step whose bytes saved for backward
            would cross this raises :class:`rematd.client.OutOfMemory`
            (recovered from by :meth:`Handle.run_step` / :meth:`Handle.guard`).
        compile: ``True`` compiles each block with Inductor, one compiled
            function per mode with the checkpoint inside it, shared by blocks
            of the same class; a string names another ``torch.compile``
            backend (``"aot_eager"``). Every offered mode is compiled at the
            step after profiling; graphs compiled are in
            :attr:`Handle.compile_stats` and each step's ``recompiles``.
            Do not compile the model itself (``torch.compile(model)`` is
            refused, and so is a compiled submodule); compile the rest as
            functions (``torch.compile(loss_fn)``).
    """
    server = check_server(server)
    stream = (
        StreamConfig.build(
            token=token,
            tls=check_flag("tls", tls),
            root_certificates=root_certificates,
            fallback_after_s=fallback_after_s,
        )
        if server is not None
        else None
    )
    return Handle(
        model,
        server=server,
        job=job,
        budget_bytes=budget_bytes,
        blocks=blocks,
        optimizer=optimizer,
        margin_ratio=margin_ratio,
        modes=modes,
        stream=stream,
        hard_limit_bytes=hard_limit_bytes,
        compile=compile,
    )
