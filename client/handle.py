"""``attach(model)``: the handle a training loop holds."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from rematd.client.arguments import check_bytes, check_hard_limit, check_margin, check_optimizer, pin_sequence
from rematd.client.blocks.compiled import CompileStats
from rematd.client.errors import UnsupportedModel
from rematd.client.handle_setup import set_up
from rematd.client.memory.sources import MemorySample
from rematd.client.options import AttachOptions
from rematd.client.parallel.pick import check_engine, read_schedule
from rematd.client.parallel.ranks import dist_rank
from rematd.client.plans.sources import Backend
from rematd.client.service.budget_hold import BudgetHold
from rematd.client.service.stream import StreamBackend
from rematd.client.step_triggers import StepTriggers, check_stages, find_running_schedule
from rematd.client.steps.oom import Guard, OomPolicy
from rematd.planner import Mode, Plan, Shape
from rematd.planner.messages import StepStats

log = logging.getLogger("rematd.client")

T = TypeVar("T")


class Handle:
    """rematd attached to one model. Create it with :func:`attach`."""

    def __init__(
        self,
        model: nn.Module,
        options: AttachOptions,
        *,
        blocks: Sequence[nn.Module] | nn.ModuleDict | None,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        """``options`` as :func:`attach` checked them; ``blocks`` and ``optimizer`` as it was given them."""
        made = set_up(model, options, blocks=blocks, optimizer=optimizer)
        target, parts, self._cycle = made.target, made.parts, made.cycle
        engine, self.model, self._roots = target.engine, target.model, target.roots
        self._offered = options.modes
        self._parts = parts
        self._accounting, self._blocks, self._applier = parts.accounting, parts.blocks, parts.applier
        self._clock = parts.accounting.clock
        self._offloader, self._compiled = parts.offloader, parts.compiled
        self._backend: Backend = made.backend
        self.server = options.server
        self._life = self._cycle.life
        self._oom = OomPolicy(self._cycle.recover, closed=lambda: self._life.closed)
        # Before a sharded engine's own pre-hooks (after them otherwise): a plan switch must restart its
        # parameter-fetch trace before the step's first fetch.
        self._triggers = StepTriggers(target.roots, self._pre_forward, self._post_forward, prepend=engine is not None)
        if target.schedule is not None:
            self._follow_schedule(target.schedule)
        self.optimizer = optimizer
        self.engine = engine

    # -- public -----------------------------------------------------------

    @property
    def job(self) -> str:
        """The job's name on the service (a random one when ``attach`` was given none)."""
        return self._cycle.who.job

    @property
    def margin_ratio(self) -> float:
        """The fraction of the budget the planner keeps free (sent with the profile)."""
        return self._cycle.who.margin_ratio

    @margin_ratio.setter
    def margin_ratio(self, value: float) -> None:
        self._cycle.who.margin_ratio = check_margin(value)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer after whose ``step()`` the handle's :meth:`step` runs by itself.

        Set it when the optimizer is made after ``attach`` (sharded parameters: attach, shard, then make the
        optimizer over the shards); ``None`` stops following it (then call :meth:`step` yourself).
        """
        return self._cycle.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        optimizer = check_optimizer(optimizer)
        self._cycle.optimizer = optimizer
        self._triggers.follow_optimizer(optimizer, self._optimizer_stepped)

    @property
    def engine(self) -> nn.Module | None:
        """The sharded backend's engine after whose ``step()`` (at each accumulation boundary) the handle's
        :meth:`step` runs by itself: the one ``attach`` was given, or set here once the engine is made when rematd
        was attached to the model before it; ``None`` stops following it (``docs/sharded.md``)."""
        return self._cycle.engine

    @engine.setter
    def engine(self, engine: nn.Module | None) -> None:
        check_engine(engine)
        self._triggers.unfollow_engine()
        self._cycle.engine = engine
        if engine is not None:
            self._triggers.follow_engine(engine, self.step)

    @property
    def pipeline(self) -> object | None:
        """The schedule of stages whose ``step()`` starts each of the handle's steps: the one ``attach`` was given,
        or set here before the first step when rematd was attached to the stage's module (``docs/sharded.md``)."""
        return self._cycle.schedule.schedule if self._cycle.schedule is not None else None

    @pipeline.setter
    def pipeline(self, schedule: object) -> None:
        read = read_schedule(schedule)
        if self._cycle.schedule is not None:
            raise ValueError("pipeline: this handle follows a schedule already; attach a new handle for another")
        if self._cycle.memory is not None:
            raise ValueError("pipeline: set h.pipeline before the first step (the plan is made for its microbatches)")
        check_stages(read, self._roots)
        self._follow_schedule(read)

    def _find_schedule(self) -> None:
        """Follow the pipeline schedule that runs the attached module, if one does (:func:`find_running_schedule`)."""
        read = find_running_schedule(self._roots)
        if read is not None:
            self._follow_schedule(read)

    def _follow_schedule(self, schedule: Any) -> None:
        self._cycle.schedule = schedule
        self._triggers.follow_schedule(schedule.schedule, self._schedule_step)

    @property
    def last_stats(self) -> StepStats | None:
        """The statistics of the last step, as sent to the planner."""
        return self._cycle.last_stats

    @property
    def last_memory(self) -> MemorySample | None:
        """The memory figures of the last step, including those the wire does not carry."""
        return self._cycle.last_memory

    @property
    def oom_count(self) -> int:
        """Out-of-memory errors the handle recovered from (or re-raised)."""
        return self._oom.count

    @property
    def oom_policy(self) -> OomPolicy:
        """What an out-of-memory error does (:meth:`run_step` and :meth:`guard` share it)."""
        return self._oom

    @property
    def compile_stats(self) -> CompileStats | None:
        """Graphs compiled for the blocks' variants and their seconds (None without ``compile=``)."""
        return self._compiled.stats() if self._compiled is not None else None

    @property
    def plan(self) -> Plan:
        """The plan in force: version, checkpointed block indices, frequency, modes, reason, ``lossy``.

        Under :meth:`pin_modes`, the pinned modes as a plan (priced by the profile, with the version of the
        planner's plan it sets aside, and its reason saying so); :attr:`history` keeps the planner's plans."""
        return self._applier.in_force()

    @property
    def history(self) -> list[Plan]:
        """Every plan the planner made for this rank, in order: each applied, and each a newer one replaced
        before a step ran it (the first plan and a correction made at the same step)."""
        return self._applier.history

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The mode of each block in force for the current (or last) step."""
        return tuple(b.mode for b in self._blocks)

    @property
    def last_shape(self) -> Shape:
        """The shape signature of the current (or last) step's input."""
        return self._cycle.shape

    @property
    def blocks(self) -> list[str]:
        """Qualified names of the checkpointable blocks, in order."""
        return [b.name for b in self._blocks]

    @property
    def step_count(self) -> int:
        return self._cycle.step

    @property
    def budget_bytes(self) -> int | None:
        """The memory budget. Set between steps, it applies to the next step's plan: planning in this process
        re-plans for it on the planner's thread (before the next step with ``planner_thread=False``); a service
        plans for it from the next step's statistics. Until the new plan arrives, a cut the plan in force is not
        predicted to fit runs every block at its leanest (its statistics say so)."""
        return self._cycle.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        budget = check_bytes("budget_bytes", value, optional=False)
        assert budget is not None
        self._cycle.budget_bytes = budget
        # Before the planner hears of it: its answer may come at once, and must end the hold.
        target = int(budget * (1 - self.margin_ratio))
        hold = self._backend.budget_hold
        if hold is BudgetHold.UNTIL_TAKEN:
            self._applier.hold_until_answered(self._cycle.shape, target)
        elif hold is BudgetHold.UNTIL_NEWER_PLAN:
            self._applier.hold_lean(self._cycle.shape, target)
        # A reconnect re-sends the hello: it must carry this budget, not the first one.
        self._backend.update_hello(budget_bytes=budget)

    @property
    def rank(self) -> int:
        """This process's rank in the default process group, as sent to the planner (read at the first step's end)."""
        return (self._cycle.ranks or dist_rank())[0]

    @property
    def world_size(self) -> int:
        """The default process group's size, as sent to the planner (read at the first step's end)."""
        return (self._cycle.ranks or dist_rank())[1]

    def pin_modes(self, modes: str | Mode | Sequence[str | Mode] | None) -> None:
        """Fix every block's mode from the next step on, whatever the planner says (None: follow it again).

        ``modes`` is one mode for every block (``h.pin_modes("recompute")``), a list with one
        entry per block, or a plan as ``h.plan`` and the reasons print it, one letter a block
        (``h.pin_modes("RRR.aa")``: ``.`` store, ``s`` selective, ``t`` titan, ``a`` attention, ``m`` mlp,
        ``R`` recompute, ``O`` offload, ``C`` compress); a mode is its name (``"store"``, ``"selective"``,
        ``"titan"``, ``"attention"``, ``"mlp"``, ``"recompute"``, ``"offload"``, ``"compress"``) or a
        :class:`rematd.planner.Mode`. Given before the first step, the
        pin applies from the first step after profiling. Compress, being lossy, may be pinned only when
        ``attach(modes=...)`` enabled it (ValueError otherwise).
        """
        pins = None if modes is None else pin_sequence(modes, len(self._blocks))
        if pins is not None and Mode.COMPRESS in pins and Mode.COMPRESS not in self._offered:
            raise ValueError("pin_modes: 'compress' is lossy and opt-in; enable it in attach(modes=[..., 'compress'])")
        self._applier.pin(pins)

    @property
    def hard_limit_bytes(self) -> int | None:
        """On the CPU, the bytes saved for backward a step may not cross (``None``: no limit)."""
        return self._accounting.hard_limit_bytes

    @hard_limit_bytes.setter
    def hard_limit_bytes(self, value: int | None) -> None:
        self._accounting.hard_limit_bytes = check_hard_limit(value)

    def step(self) -> None:
        """Mark the end of a training step (after ``optimizer.step()``). Never raises."""
        if not self._life.in_step:
            return
        self._clock.enter()
        try:
            self._cycle.end()
        except Exception:
            self._cycle.errors += 1
            log.exception("rematd: step bookkeeping failed; training goes on with the plan in force")
        finally:
            self._clock.leave()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run (itself, or an integration's at the end of training): the blocks run
        their own forward and no step is followed any more."""
        return self._life.closed

    @property
    def safe_mode(self) -> bool:
        """True while every block recomputes after an out-of-memory error, until the planner's next plan."""
        return self._life.safe

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
        return self._oom.run(fn, *args, **kwargs)

    def guard(self) -> Guard:
        """``with h.guard() as g:`` around a step: an out-of-memory error inside is recovered from.

        The first error is suppressed (``g.oom`` is then True: retry or skip
        the batch); another one in the next guarded block is raised. Locals of
        the caller's frame (a ``loss``) keep their graph alive: put the step in
        a function, or use :meth:`run_step`, to free it all.
        """
        return Guard(self)

    def report_oom(self, message: str = "") -> None:
        """Tell the planner the last step ran out of memory; a tighter plan follows."""
        self._cycle.report_oom(message)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the planner has answered every step so far (for tests and shutdown).

        False when some step is still unanswered after ``timeout``, or will never be: the
        service refused the stream, or the handle was closed first.
        """
        return self._backend.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """End the session, remove hooks and restore the blocks' own forward.

        Every step counted so far reaches the service first, steady steps folded into fewer reports
        included: ``close`` waits for the service's answer to the last one at most ``timeout`` seconds, as
        :meth:`flush` does. Only a service already lost (or one that refused the stream) is not waited for.
        """
        if not self._life.close():
            return
        self._triggers.remove()
        for h in self._parts.hooks:
            h.remove()
        if self._cycle.router is not None:
            self._cycle.router.remove()
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
        if self._life.closed or not torch.is_grad_enabled():
            return
        self._clock.enter()
        try:
            if not self._life.in_step:
                if self._cycle.memory is None and self._cycle.schedule is None:
                    self._find_schedule()
                self._cycle.begin(args, kwargs)
            else:
                self._cycle.forward_seen(args, kwargs)
            if self._accounting_on():
                self._cycle.start_counting()
        except UnsupportedModel:
            raise  # a model sharded after attach in a way rematd cannot checkpoint: the user must change it
        except Exception:
            self._cycle.errors += 1
            log.exception("rematd: pre-forward bookkeeping failed")
        finally:
            self._clock.leave()

    def _schedule_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The schedule's ``step()`` starts: so does a step, before any microbatch's forward."""
        if self._life.closed or self._life.in_step or not torch.is_grad_enabled():
            return
        self._clock.enter()
        try:
            self._cycle.begin_schedule_step(args, kwargs)
        except Exception:
            self._cycle.errors += 1
            log.exception("rematd: bookkeeping at the schedule's step failed")
        finally:
            self._clock.leave()

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._accounting.active:
            return  # nothing counted this forward (on CUDA, never): nothing to stop
        self._clock.enter()
        try:
            self._cycle.stop_counting()
        finally:
            self._clock.leave()

    def _accounting_on(self) -> bool:
        return self._cycle.counting()
