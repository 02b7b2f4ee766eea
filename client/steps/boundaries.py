"""One training step as rematd sees it: what happens at its start and end, and after an out-of-memory error.

What a step's start does depends on the lifecycle's phase
(:mod:`rematd.client.steps.phases`); the step's end measures it, opens the
planner once the profile is complete, and reports the step's statistics.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rematd.client.blocks.profiled_forward import lean_profiling
from rematd.client.call_shape import shape_of
from rematd.client.memory.sources import CudaMemory, MemorySample, SavedFigures, saved_sample
from rematd.client.parallel.agreement import CODES, MODES
from rematd.client.parallel.base import PLAIN, SetUp, idle
from rematd.client.parallel.pick import Schedule, pick
from rematd.client.plans.sources import Backend
from rematd.client.service.step_record import StepRecord
from rematd.client.steps.cycle_hello import profiled_hello
from rematd.client.steps.hello import (
    Identity,
    Memory,
    complete_profile,
    fresh_grad_bytes,
    memory_source,
    offer_modes,
)
from rematd.client.steps.modes_run import ModesRun
from rematd.client.steps.oom import free_after_oom, oom_message
from rematd.client.steps.phases import Lifecycle, Phase
from rematd.client.steps.router_guard import RouterGuard
from rematd.client.steps.watch import BudgetWatch
from rematd.planner import Mode, Shape
from rematd.planner.messages import Hello, OomReport, StepStats

if TYPE_CHECKING:
    from rematd.client.assembly import BlockParts
    from rematd.client.options import AttachOptions

log = logging.getLogger("rematd.client")


class StepCycle:
    """The training thread's side of a handle, from one step boundary to the next."""

    _setup_idle = True
    """Whether :attr:`setup` does nothing at a step's start (:func:`idle`): its calls there are skipped."""

    def __init__(
        self,
        model: nn.Module,
        options: AttachOptions,
        *,
        optimizer: torch.optim.Optimizer | None,
        parts: BlockParts,
        backend: Backend,
        fingerprint: str,
        group: object | None = None,
    ) -> None:
        self.model, self.optimizer, self.backend = model, optimizer, backend
        self._use(parts)
        self.who = Identity(
            job=options.job or f"job-{uuid.uuid4().hex[:8]}",
            fingerprint=fingerprint,
            margin_ratio=options.margin_ratio,
        )
        self.job_given = options.job is not None
        self.modes = options.modes
        self.budget_bytes = options.budget_bytes
        self.life = Lifecycle()
        self.memory: Memory | None = None
        """Where the figures come from; chosen at the first step, from where its input is."""
        self.step, self.shape = 0, Shape()
        self.static = self.carried = 0
        """Static bytes of the step; ``carried``: on the CPU, those saved for backward by earlier steps and still
        held at its start (in ``static`` from the step's end)."""
        self.fresh_grads = 0
        """Bytes of the gradients the profiling step creates (those of parameters without one at its start)."""
        self.started: float | None = None
        self.ranks: tuple[int, int] | None = None
        """(rank, world size) as sent in the hello."""
        self.unsent_oom: OomReport | None = None
        self.last_record: StepRecord | None = None
        self.errors = 0
        """Failures of rematd's bookkeeping caught on the training thread; training went on after each."""
        self._counting: torch.autograd.graph.saved_tensors_hooks | None = None
        self._agreeing = (options.same_plan, group)
        """Whether the ranks agree on one plan each step (None: as the set-up says), and the process group plain
        ranks agree over with ``same_plan=True`` (DDP's; None: the default group)."""
        self.setup: SetUp = PLAIN
        """The parallel set-up, picked at the first step (a model may be sharded after ``attach``)."""
        self.schedule: Schedule | None = None
        """The schedule of stages whose ``step()`` starts a step, when attached to one."""
        self.engine: nn.Module | None = None
        """The engine whose step ends a step, when known: its optimizer's partitions are static memory."""
        self._shape_seen = False
        """Whether the step's first forward has shown its shape (a schedule's step starts before any forward)."""
        self._hello_static: int | None = None
        """The static memory the hello gave the first plan, until the first step after it has checked it."""
        self.watch = BudgetWatch()
        """What the log says of the steps' memory."""
        self.run = ModesRun()
        """The modes the step runs, and whether they are its plan's."""
        # Whether :attr:`memory` is the CUDA allocator's (else the CPU's saved tensors), once set: read at every
        # step's start and end, without an isinstance each time.
        self._cuda: bool | None = None
        # Whether the CPU's steps count saved tensors (off: they run as on CUDA, for benchmarks).
        self.saved_hooks = True

    def _use(self, parts: BlockParts) -> None:
        """The blocks and what wraps them, as ``attach`` built them."""
        self.blocks = parts.blocks
        self.accounting = parts.accounting
        self.clock = parts.accounting.clock
        self.applier = parts.applier
        self.timer = parts.timer
        self.offloader = parts.offloader
        self.compiled = parts.compiled
        self.router = RouterGuard(self) if any(b.bank is not None for b in self.blocks) else None
        """Where the blocks hold mixtures of experts: what their routers do to the step's memory."""

    # -- a step's start and end ----------------------------------------------

    def begin(self, args: tuple[Any, ...], kwargs: dict[str, Any], shape: Shape | None = None) -> None:
        """A step begins: at its first grad-enabled forward after a step boundary, with that forward's arguments,
        or at a schedule's ``step()``, with the whole batch (``shape``: a microbatch's, when known)."""
        runs_in = self.life.begin_step()
        self.applier.ran_why = ""
        self.applier.group_version = None  # set again by this step's agreement (a retry runs alone)
        if self.memory is None:
            self._first_step(args, kwargs)
        self._shape_seen = shape is None
        self.shape = shape_of(args, kwargs) if shape is None else shape
        if runs_in is Phase.PROFILING:
            lean = lean_profiling()
            for b in self.blocks:
                b.profiling = True
                b.profile_shape = self.shape
                # Profiled as recomputing keeps it: the first step needs no more memory than the leanest plan.
                b.mode = Mode.RECOMPUTE if lean and Mode.RECOMPUTE in b.offer else Mode.STORE
            self.fresh_grads = fresh_grad_bytes(self.model)
            self.applier.profiled_as(tuple(b.mode for b in self.blocks))
        elif runs_in is Phase.PLANNED:
            if self._hello_static is not None:
                self._first_planned_step()
            self.applier.apply_pending(self.shape)
        elif (
            runs_in is Phase.SAFE
            and self.life.has_profile
            and self.applier.has_pending()
            and self.applier.apply_pending(self.shape)
        ):
            # Every block recomputes until the planner answers with a new plan.
            self.life.plan_applied()
        if runs_in in (Phase.RETRY, Phase.SAFE):
            self.applier.ran_why = "after an out-of-memory error every block recomputes until the next plan"
        # The retry (Phase.RETRY) runs with every block recomputed, whatever is pending; it runs on this rank
        # alone, so it agrees with no other.
        if self.setup.agreement is not None and runs_in is not Phase.RETRY:
            self._agree()
        run = self.run
        run.begin(self.blocks, self.applier.plan, self.shape, profiling=runs_in is Phase.PROFILING)
        run.run_bare(self.blocks, step=self.step, counting=self.counting())
        if not self._setup_idle:
            self.setup.step_begins(run.rerun)
        self._step_shape()
        self._follow_router(runs_in)
        self.static = self._static_now()
        if not self._on_cuda():
            # On the CPU, what the accounting still holds from before the step is there throughout it; the
            # weights the set-up gathers are no activations.
            self.carried = self.accounting.live_bytes
            if not self._setup_idle:
                self.accounting.gathered = self.setup.weight_storages()
        self.started = time.perf_counter()

    def _follow_router(self, runs_in: Phase) -> None:
        """A planned step whose modes no pin fixed follows what its experts' routers do."""
        if self.router is not None:
            armed = runs_in is Phase.PLANNED and self.applier.pinned is None
            # The ranks that agreed at the step's start decide together after the first bank (a retry runs alone).
            self.router.step_begins(armed, self.setup.agreement is not None and runs_in is not Phase.RETRY)

    def begin_schedule_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The schedule's ``step()`` starts, with the whole batch on the first stage (nothing on the others,
        which run the last step's shape until their first forward shows this one's)."""
        assert self.schedule is not None
        shape = self.schedule.microbatch_shape(args, kwargs)
        self.begin(args, kwargs, shape if shape is not None else self.shape)

    def _first_planned_step(self) -> None:
        """The hello counted what the profiling step left behind (optimizer state, and gradients, which a loop may
        keep or free) as the first plan's static memory. The first step after it shows what stayed: where less
        did, the planner plans again for it (in-process before this step runs; a service from its report)."""
        assert self._hello_static is not None
        now = self._static_now() + (0 if self._on_cuda() else self.accounting.live_bytes)
        if now < self._hello_static:
            self.backend.update_hello(static_bytes=now)
        self._hello_static = None

    def _step_shape(self) -> None:
        # By identity first: a step like the last one has the same shape object (``shape_of`` keeps it).
        if self.blocks[0].step_shape is not self.shape and self.blocks[0].step_shape != self.shape:
            for b in self.blocks:
                b.step_shape = self.shape

    def _static_now(self) -> int:
        """The memory there whatever the plan: on CUDA, what is allocated; on the CPU, what the set-up holds
        there (shards, gathered parameters), standing in for a device."""
        assert self.memory is not None
        static = self.memory.static_bytes()
        if not self._on_cuda() and not self._setup_idle:
            static += self.setup.static_bytes(self.optimizer, self.engine)
        return static

    def forward_seen(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A forward inside a step that began before any (a schedule's ``step()``): the first shows the
        microbatches' shape, where the step's start could not (a stage that receives activations)."""
        if self._shape_seen:
            return
        self._shape_seen = True
        seen = shape_of(args, kwargs)
        if not seen.batch or seen == self.shape:
            return
        if any(b.profiling for b in self.blocks) or not self.shape.batch:
            self.shape = seen
            for b in self.blocks:
                if b.profiling:
                    b.profile_shape = seen
            self._step_shape()
        else:
            # The modes were set (and agreed) for the shape expected: they stay for this step, the next one
            # starts from this shape.
            log.info("rematd: this step's microbatches are %s, not %s as its plan assumed", seen, self.shape)
            self.shape = seen
            self._step_shape()

    def counting(self) -> bool:
        """Whether the step counts saved tensors (on the CPU, unless :attr:`saved_hooks` is off)."""
        return self.saved_hooks and self._cuda is False

    def _on_cuda(self) -> bool:
        return self._cuda is True

    def _first_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """What can only be seen at the first step (``args`` and ``kwargs``: its first forward's): the parallel
        set-up (a model may be sharded after attach), and where the memory figures come from."""
        found = [(b.name, b.module) for b in self.blocks]
        same_plan, group = self._agreeing
        self.setup = pick(self.model, found, same_plan=same_plan, schedule=self.schedule, group=group)
        self._setup_idle = idle(self.setup)
        self.accounting.is_weight = self.setup.is_weight
        for b in self.blocks:
            b.setup = self.setup
        log.info("rematd: %s", self.setup.describe())
        self.memory = memory_source(self.model, self.accounting, args, kwargs)
        self._cuda = isinstance(self.memory, CudaMemory)
        # A sharded set-up may have gathered the root's parameters already: known by storage, not by address.
        self.accounting.exclude_module_state(self.model, self.setup.weight_storages())
        offer_modes(self.blocks, self.memory, self.modes)

    def _agree(self) -> None:
        """Run the modes the ranks of the set-up's group agree on (per block the leanest any put forward)."""
        assert self.setup.agreement is not None
        own = [CODES[b.mode] for b in self.blocks]
        chosen, self.applier.group_version = self.setup.agreement.agree(own, self.applier.plan.version)
        if chosen == own:
            return
        self.applier.ran_why = "the ranks agreed on the leanest mode any put forward"
        for b, code in zip(self.blocks, chosen, strict=True):
            mode = MODES[code]
            if mode is not b.mode:
                b.profiling = False  # profiled at a later step, when every rank runs it as it profiles
                b.mode = mode
        # The blocks' modes are not the plan's any more: the next step sets them from the plan again.
        self.applier.invalidate()

    def end(self) -> None:
        """``Handle.step()``: measure the step, open the planner once profiled, report the statistics."""
        try:
            self._report()
        finally:
            self.life.end_step()

    def _report(self) -> None:
        memory = self.memory
        assert memory is not None
        figures: MemorySample | SavedFigures
        if isinstance(memory, CudaMemory):
            figures = memory.sample()
            peak = figures.peak_allocated_bytes
        else:
            # The accounting's peak holds what it carried in; the set-up's static memory comes on top.
            figures = memory.take(self.static)
            peak = figures[0]
            self.static += self.carried
        if self.budget_bytes is None:
            total = figures.total_bytes if isinstance(figures, MemorySample) else figures[3]
            self.budget_bytes = max(1, int(total or memory.total_bytes or 2**40))
        elapsed = time.perf_counter() - self.started if self.started else 0.0
        recompiles, compile_seconds = self.compiled.take() if self.compiled is not None else (0, 0.0)
        if self.offloader.used:
            self.offloader.end_step()
        if not self.life.has_profile or recompiles:
            # The forwards that compiled were timed with their compile: seconds, not what the mode costs. The
            # profiling step's are cold (first allocations, caches filled): the profile holds its prices.
            self.timer.forget()
            if not self.life.has_profile and complete_profile(self.blocks):
                self.life.profiled()
                sample = figures if isinstance(figures, MemorySample) else saved_sample(figures)
                self.backend.open(self._hello(sample))
                if self.unsent_oom is not None:
                    self.backend.send_oom(self.unsent_oom)
                    self.unsent_oom = None
        # The raw figures only: the statistics are built off this thread (or by ``h.last_stats``).
        version = self.applier.plan.version
        routed = self._router_ends(peak, figures)
        timed = self.timer.take()
        record = StepRecord(
            self.step,
            self.shape,
            self.budget_bytes,
            self.static,
            figures,
            (elapsed, version, timed, recompiles, compile_seconds, self.run.ran, self.clock.take(), routed),
        )
        self.last_record = record
        self.step += 1
        self.watch.step_ended(record, peak, version, self.applier.in_force)
        self.backend.send_stats(record)

    def _router_ends(self, peak: int, figures: MemorySample | SavedFigures) -> int:
        """The router guard's step ends (what the step's routing added to its peak; 0 without experts). On the
        CPU the memory outside the blocks is counted apart, and backward holds the share the other microbatches
        alive at once keep of it (as the planner models it); on CUDA it is held throughout."""
        if self.router is None:
            return 0
        if isinstance(figures, MemorySample):
            return self.router.step_ends(peak)
        flights = max(1, self.setup.other_in_flight)
        return self.router.step_ends(peak, figures[2], (flights - 1) / flights)

    @property
    def last_memory(self) -> MemorySample | None:
        """The last step's memory sample (built when first read)."""
        record = self.last_record
        return record.memory() if record is not None else None

    @property
    def last_stats(self) -> StepStats | None:
        """The last step's statistics (built when first read)."""
        record = self.last_record
        return record.stats() if record is not None else None

    def _hello(self, sample: MemorySample) -> Hello:
        """The hello the planner opens with (:func:`~rematd.client.steps.cycle_hello.profiled_hello`)."""
        return profiled_hello(self, sample)

    # -- saved-tensor accounting around the model's forward -------------------

    def start_counting(self) -> None:
        self._counting = self.accounting.hooks()
        self._counting.__enter__()
        self.accounting.active = True

    def stop_counting(self) -> None:
        if self.accounting.active:
            self.accounting.active = False
            if self._counting is not None:
                self._counting.__exit__(None, None, None)
                self._counting = None

    # -- out of memory --------------------------------------------------------

    def report_oom(self, message: str = "") -> None:
        """Tell the planner the last step ran out of memory; before the planner opens, with the profile."""
        oom = OomReport(step=self.step, shape=self.shape, plan_version=self.applier.plan.version, message=message)
        if self.life.has_profile:
            self.backend.send_oom(oom)
        else:
            self.unsent_oom = oom

    def recover(self, exc: BaseException) -> None:
        """After an out-of-memory error: free, report, recompute every block, let the step run again."""
        message = oom_message(exc)
        log.warning("rematd: out of memory at step %d (%s); every block recomputes now", self.step, message)
        try:
            free_after_oom(exc, self.model, self.optimizer, cuda=isinstance(self.memory, CudaMemory))
            self.stop_counting()
            # Nothing the failed step saved is needed any more, and its timings are of a step that did not finish.
            self.accounting.forget()
            self.timer.forget()
            self.offloader.forget()
            for b in self.blocks:
                b.profiling = False
                b.checkpointed = True
            self.applier.invalidate()
            self.life.oom()
            if isinstance(self.memory, CudaMemory):
                self.memory.sample()  # the failed step's peaks are not the retry's
            else:
                self.accounting.take_peak()
        except Exception:
            self.errors += 1
            log.exception("rematd: recovering from out of memory failed")
        # Last, on its own: in-process planning runs inside the report, and whatever it raises must not
        # leave the plan that just ran out of memory in force.
        try:
            self.report_oom(message)
        except Exception:
            self.errors += 1
            log.exception("rematd: reporting the out-of-memory error to the planner failed")
