"""``attach(model)``: the handle a training loop holds."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from rematd import __version__
from rematd.client.accounting import SavedTensorAccounting, tensors_in
from rematd.client.applier import PlanApplier
from rematd.client.backends import Backend, EmbeddedBackend
from rematd.client.buffers import protect_running_stats
from rematd.client.discovery import find_blocks
from rematd.client.guard import UnsupportedModel, free_after_oom, is_oom
from rematd.client.memory import CudaMemory, MemorySample, SavedTensorMemory
from rematd.client.profiling import host_bandwidth
from rematd.client.stream import StreamBackend, StreamConfig
from rematd.client.switch import SwitchableBlock
from rematd.planner import Mode, Plan, Shape, Size
from rematd.records import BlockRecord, Hello, OomReport, StepStats

log = logging.getLogger("rematd.client")

T = TypeVar("T")


def shape_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shape:
    """The shape signature of a model call: batch and sequence length of its first tensor."""
    for t in tensors_in([args, kwargs]):
        if t.dim() == 0:
            continue
        batch = int(t.shape[0])
        seq = int(t.shape[1]) if t.dim() >= 2 else 1
        return Shape(batch=batch, seq_len=seq, tokens=batch * seq)
    return Shape()


def model_fingerprint(blocks: Sequence[tuple[str, nn.Module]]) -> str:
    h = hashlib.sha256()
    for name, module in blocks:
        h.update(f"{name}:{type(module).__qualname__}".encode())
        for pname, p in module.named_parameters():
            h.update(f"{pname}{tuple(p.shape)}{p.dtype}".encode())
    return h.hexdigest()[:16]


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
        rank: int,
        world_size: int,
        margin_ratio: float,
        modes: Sequence[str] | None = None,
        stream: StreamConfig | None = None,
        hard_limit_bytes: int | None = None,
    ) -> None:
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or int(budget_bytes) <= 0):
            raise ValueError(f"budget_bytes must be a positive number of bytes, got {budget_bytes!r}")
        if not 0.0 <= margin_ratio < 1.0:
            raise ValueError(f"margin_ratio must be in [0, 1), got {margin_ratio!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self._modes = parse_modes(modes)
        if hard_limit_bytes is not None and (isinstance(hard_limit_bytes, bool) or int(hard_limit_bytes) <= 0):
            raise ValueError(f"hard_limit_bytes must be a positive number of bytes, got {hard_limit_bytes!r}")
        model = _unwrap(model)
        self.model = model
        self._optimizer = optimizer
        self.job = job or f"job-{uuid.uuid4().hex[:8]}"
        self.rank = rank
        self.world_size = world_size
        self.margin_ratio = margin_ratio
        self._budget_bytes = int(budget_bytes) if budget_bytes is not None else None
        found = find_blocks(model, blocks)
        self._fingerprint = model_fingerprint(found)
        self._accounting = SavedTensorAccounting()
        self._accounting.hard_limit_bytes = int(hard_limit_bytes) if hard_limit_bytes is not None else None
        self._blocks = [SwitchableBlock(i, name, m, self._accounting) for i, (name, m) in enumerate(found)]
        self._norm_hooks = protect_running_stats([m for _, m in found])
        self._applier = PlanApplier(self._blocks)
        self.last_stats: StepStats | None = None
        self._step = 0
        self._boundary = True
        self._forward_seen = False
        self._profiled = False
        self._step_started: float | None = None
        self._shape = Shape()
        self._static = 0
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
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            model.register_forward_hook(self._post_forward, always_call=True),
        ]
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.step()))

    # -- public -----------------------------------------------------------

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
        if isinstance(value, bool) or int(value) <= 0:
            raise ValueError(f"budget_bytes must be a positive number of bytes, got {value!r}")
        self._budget_bytes = int(value)

    def pin_modes(self, modes: Sequence[Mode] | None) -> None:
        """Fix every block's mode from the next step on, whatever the planner says (None: follow it again)."""
        if modes is not None and len(modes) != len(self._blocks):
            raise ValueError(f"pin_modes needs {len(self._blocks)} modes, one per block, got {len(modes)}")
        self._applier.pinned = tuple(Mode(m) for m in modes) if modes is not None else None

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
        """Wait until the planner has answered every step so far (for tests and shutdown)."""
        return self._backend.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """End the session, remove hooks and restore the blocks' own forward."""
        if self._closed:
            return
        self._closed = True
        for h in (*self._hooks, *self._norm_hooks):
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
        elif (not self._safe or self._applier.has_pending()) and self._applier.apply_pending(self._shape):
            # In safe mode every block recomputes until the planner answers with a new plan.
            self._safe = False
        for b in self._blocks:
            b.step_shape = self._shape
        self._static = self._memory.static_bytes()
        self._step_started = time.perf_counter()

    def _offer_modes(self) -> None:
        """Offload needs a host link worth using: offered on CUDA only, with its measured bandwidth."""
        offer = set(self._modes)
        bandwidth = None
        if isinstance(self._memory, CudaMemory) and Mode.OFFLOAD in offer:
            bandwidth = host_bandwidth(self._memory.device)
        else:
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
        )
        self.last_stats = stats
        self._step += 1
        self._backend.send_stats(stats)

    def _hello(self, sample: MemorySample) -> Hello:
        assert self._memory is not None and self._budget_bytes is not None
        records = []
        for b in self._blocks:
            m = b.measure
            records.append(
                BlockRecord(
                    index=b.index,
                    name=b.name,
                    saved_bytes=m.saved_bytes if m else 0,
                    input_bytes=m.input_bytes if m else 0,
                    forward_seconds=m.forward_seconds if m else 0.0,
                    modes=m.modes if m else (),
                )
            )
            b.profiling = False
        return Hello(
            job_id=self.job,
            rank=self.rank,
            world_size=self.world_size,
            device_name=self._memory.name,
            device_total_bytes=self._memory.total_bytes,
            model_fingerprint=self._fingerprint,
            blocks=tuple(records),
            profile_shape=self._shape,
            budget_bytes=self._budget_bytes,
            static_bytes=self._static,
            memory_source=self._memory.kind,
            margin_ratio=self.margin_ratio,
            client_version=__version__,
            # On the CPU the profiling step's peak less the blocks' own share is what the rest of
            # the model saves; on CUDA the allocator's peak covers it and the correction learns it.
            other_activations=Size.linear(max(0, sample.saved_peak_bytes - sum(r.saved_bytes for r in records))),
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
            # Nothing the failed step saved is needed any more.
            self._accounting.forget()
            self.report_oom(message)
            for b in self._blocks:
                b.profiling = False
                b.checkpointed = True
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


class Guard:
    """The context manager :meth:`Handle.guard` returns."""

    def __init__(self, handle: Handle) -> None:
        self._handle = handle
        self.oom = False
        """True when the guarded block ran out of memory and rematd recovered."""

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        h = self._handle
        if exc is None:
            h._oom_streak = 0
            return False
        if not isinstance(exc, Exception) or not is_oom(exc):
            return False
        h._recover(exc)
        if h._oom_streak >= 2:
            return False
        self.oom = True
        return True


def _unwrap(model: nn.Module) -> nn.Module:
    """The module to attach to: DDP's inner module; FSDP and compiled models are refused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach expects an nn.Module, got {type(model).__name__}")
    for name, m in model.named_modules():
        where = f" (at {name!r})" if name else ""
        kind = type(m).__name__
        if kind == "OptimizedModule" or hasattr(m, "_orig_mod"):
            raise UnsupportedModel(
                f"{kind}{where} is a torch.compile'd module; rematd switches checkpointing between steps, which "
                "a compiled graph does not see. Attach to the model without torch.compile."
            )
        if kind in ("FullyShardedDataParallel", "FSDPModule") or any(
            c.__name__ == "FSDPModule" for c in type(m).__mro__
        ):
            raise UnsupportedModel(
                f"{kind}{where} is sharded with FSDP, which rematd does not support yet; use "
                "DistributedDataParallel, or FSDP's own activation checkpointing"
            )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        inner: nn.Module = model.module
        return inner
    return model


MODE_NAMES = {m.name.lower(): m for m in Mode}


def parse_modes(names: Sequence[str] | None) -> frozenset[Mode]:
    """The modes a plan may use; STORE is always allowed."""
    if names is None:
        return frozenset(Mode)
    if isinstance(names, str):
        raise ValueError(f"modes must be a sequence of mode names, got the string {names!r}")
    bad = [n for n in names if n not in MODE_NAMES]
    if bad:
        raise ValueError(f"unknown modes {bad}; choose from {sorted(MODE_NAMES)}")
    return frozenset({Mode.STORE, *(MODE_NAMES[n] for n in names)})


def _dist_rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def attach(
    model: nn.Module,
    *,
    server: str | None = None,
    job: str | None = None,
    budget_bytes: int | None = None,
    blocks: Sequence[nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    margin_ratio: float = 0.1,
    modes: Sequence[str] | None = None,
    token: str | None = None,
    tls: bool = False,
    root_certificates: str | os.PathLike[str] | bytes | None = None,
    fallback_after_s: float | None = 60.0,
    hard_limit_bytes: int | None = None,
) -> Handle:
    """Attach rematd to ``model`` and return the handle that applies its plans.

    Args:
        model: the model being trained.
        server: ``"host:port"`` of a rematd service; ``None`` plans in-process.
        job: the job's name on the service (default: a random one).
        budget_bytes: the memory budget. On CUDA, the device memory the job
            may use (default: the device's capacity); on the CPU, the cap on
            bytes saved for backward during a step (default: host memory).
        blocks: the modules to checkpoint (default: the longest
            ``nn.ModuleList`` of same-class modules).
        optimizer: when given, the handle's :meth:`Handle.step` runs after
            each ``optimizer.step()`` by itself.
        margin_ratio: the fraction of the budget the planner keeps free.
        modes: the ways a block may keep activations, from ``"store"``,
            ``"selective"`` (keep matmul and attention outputs, recompute
            pointwise ops), ``"recompute"`` (keep only the block's input) and
            ``"offload"`` (saved activations to host memory; CUDA only).
            Default: all of them.
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
    """
    stream = (
        StreamConfig.build(token=token, tls=tls, root_certificates=root_certificates, fallback_after_s=fallback_after_s)
        if server
        else None
    )
    rank, world = _dist_rank()
    return Handle(
        model,
        server=server,
        job=job,
        budget_bytes=budget_bytes,
        blocks=blocks,
        optimizer=optimizer,
        rank=rank,
        world_size=world,
        margin_ratio=margin_ratio,
        modes=modes,
        stream=stream,
        hard_limit_bytes=hard_limit_bytes,
    )
